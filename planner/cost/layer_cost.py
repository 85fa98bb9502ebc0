"""What one block costs on one GPU, per sample: the records the layer cost profile is made of.

``LayerCost`` holds a block's parameters, GEMM shapes, attention core, memory-bound bytes,
stored activations per recompute mode and its collectives; ``LayerContext`` the parallel
layout and kernel choices a block is priced under (layers.py, transformer_layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from planner.cost.eager_kernels import Bytes, Eager
from planner.cost.precision import Recipe

ACT = 2  # bytes of a bf16/fp16 activation
MASK = 1  # bytes of a dropout mask element (Korthikanti: "sbh" for a mask of s*b*h)
# Megatron's selective recompute (the attention core), full recomputation of each transformer
# layer, and torchtitan's per-op selective activation checkpointing ("op": transformer_layers.py
# op_sac). Appended, never reordered: block tables and search columns index it.
RECOMPUTE_MODES = ("none", "selective", "full", "op")
# Megatron-Core's --recompute-modules that dsplan prices (transformer_config.py): what its
# selective recompute runs again. "core_attn" is Megatron's default; "layernorm", "moe_act" and
# "mla_up_proj" discard their outputs (CheckpointWithoutOutput), "mlp", "moe" (the whole MoE layer,
# its dispatch and combine again) and "shared_experts" checkpoint the module.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "moe", "shared_experts")
_NO_EXTRA: Mapping[str, float] = MappingProxyType({})


# Gemm, AttnCore and LayerCost are immutable records (NamedTuples).
class Gemm(NamedTuple):
    """``batch`` GEMMs of (tokens*b x k) @ (k x n) per sample; ``tokens`` scales with b."""

    tokens: float
    n: int
    k: int
    batch: int = 1
    low: bool = False  # runs in the recipe's low-precision format (planner/cost/precision.py)
    # Shares of the weight held as separate tensors (the reference trainer's and Hugging Face's
    # q/k/v and gate/up projections are modules of their own): what ZeRO-3 fetches (zero3_fetch.py).
    split: tuple[float, ...] = (1.0,)

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.n * self.k * self.batch


class Rerun(NamedTuple):
    """What one recompute module of a block runs again and frees, per sample on one GPU: the
    GEMMs, the memory-bound bytes, the TP collectives, the passes of the block's EP all-to-alls,
    and the stored bytes it no longer keeps."""

    gemms: tuple[Gemm, ...] = ()
    traffic: float = 0.0
    tp: tuple[tuple[str, float], ...] = ()
    saved: float = 0.0
    a2a: int = 0

    def __add__(self, other: "Rerun") -> "Rerun":  # type: ignore[override]
        return Rerun(self.gemms + other.gemms, self.traffic + other.traffic, self.tp + other.tp,
                     self.saved + other.saved, self.a2a + other.a2a)


NO_RERUN = Rerun()


class AttnCore(NamedTuple):
    """Scores and attention-over-values: ``seqs`` sequences of ``seq`` query tokens, ``heads``
    per GPU, each query block attending to ``context`` blocks of ``seq`` keys (context
    parallelism: a rank's s/cp queries against the whole sequence, causally balanced so every
    rank does 1/cp of the work). A causal sliding ``window`` keeps ``window_share`` of that
    work for a fused kernel (FlashAttention skips the key blocks outside the band; an unfused
    one forms every score and masks, so its time reads ``seq`` and not the window)."""

    seqs: int  # independent sequences per sample (1 for text, the tiles for a ViT)
    seq: int
    heads: float
    qk_dim: int
    v_dim: int
    causal: bool
    flash: bool
    dropout: bool
    context: int = 1
    window: int | None = None  # causal sliding window: keys per query at most, itself included

    @property
    def window_share(self) -> float:
        """The share of a causal attention's query-key pairs a sliding window of w keeps. Over
        n positions query i sees min(i + 1, w) keys: w(w + 1)/2 + (n - w)w pairs for w < n,
        against n(n + 1)/2 without a window (1.0 with none, or one as long as the sequence)."""
        n, w = self.seq * self.context, self.window
        if w is None or w >= n:
            return 1.0
        return (w * (w + 1) / 2 + (n - w) * w) / (n * (n + 1) / 2)

    @property
    def flops(self) -> float:
        """Model FLOPs, full s^2 (the Megatron/Korthikanti convention, causal or not), times
        the share of the causal work a sliding window keeps."""
        return (2.0 * self.seqs * self.seq**2 * self.context * self.heads * (self.qk_dim + self.v_dim)
                * self.window_share)


class LayerCost(NamedTuple):
    """Per-GPU, per-sample cost of one block (see the module docstring)."""

    index: int
    kind: str
    params: int  # whole block, unsharded
    params_rank: float  # non-expert parameters one GPU holds after TP
    expert_params_rank: float  # routed-expert parameters one GPU holds after TP and EP
    tokens: int  # tokens this block processes per sample
    hidden: int  # width of the block's output (what PP sends)
    gemms: tuple[Gemm, ...]
    attn: AttnCore | None
    hbm_fwd: float  # bytes of memory-bound traffic (norms, activations, softmax, ...) forward
    act: dict[str, float]  # bytes kept for backward per recompute mode
    act_live: float  # bytes of the block's activations while it is (re)computed
    tp_fwd: tuple[tuple[str, float], ...]  # (collective, bytes) over the TP group, forward
    tp_bwd: tuple[tuple[str, float], ...]
    ep_a2a: float  # bytes one GPU sends per all-to-all (dispatch; combine is the same)
    ep_a2a_count: int  # all-to-alls forward (dispatch + combine); backward repeats them. The
    # allgather dispatcher: extra["ep_gather"] bytes all-gathered and reduce-scattered instead
    checkpointed: bool  # full recompute applies (transformer layers only, as in Megatron)
    extra: Mapping[str, float] = _NO_EXTRA
    # The GEMMs whose outputs torchtitan's per-op SAC keeps (recompute mode "op"): the rest of the
    # block's forward runs again in its backward, its attention core and TP reduce-scatters aside.
    sac_saved: tuple[Gemm, ...] = ()
    # What Megatron's selective recompute runs again beside the attention core (which
    # extra["sel_attn"] says it recomputes): the chosen modules' Rerun summed (LayerContext.modules).
    rerun: Rerun = NO_RERUN

    @property
    def low_params(self) -> float:
        """Weights one GPU holds of the GEMMs that run in the recipe's format (the quantized
        weight cache holds them): n x k per GEMM, times its local experts."""
        return float(sum(g.n * g.k * g.batch for g in self.gemms if g.low))

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops for g in self.gemms)

    @property
    def fwd_flops(self) -> float:
        """Model FLOPs of the forward pass, per sample, on one GPU."""
        return self.gemm_flops + (self.attn.flops if self.attn else 0.0)

    @property
    def pp_bytes(self) -> float:
        """Bytes of this block's output per sample (what a pipeline boundary after it sends)."""
        return float(self.tokens * self.hidden * ACT)


@dataclass(frozen=True, slots=True)
class LayerContext:
    """The layout (tp, sequence parallel, ep, cp, expert tp) and kernel choices a block is priced under."""

    tp: int
    sp: bool
    ep: int
    flash: bool
    dropout: bool
    rope: bool = False
    recipe: Recipe | None = None  # the TE recipe of the transformer layers' linear GEMMs
    cp: int = 1  # context parallel: the block sees seq_len / cp tokens of each sample
    imbalance: float = 1.0  # Workload.moe_imbalance: the busiest EP rank's token copies over the mean
    etp: int | None = None  # the routed experts' TP degree, 1 or tp (None: tp)
    flex: bool = False  # Workload.moe_dispatcher flex: the MoE layers say their routing (moe_dispatch.py)
    allgather: bool = False  # Workload.moe_dispatcher allgather (moe_dispatch.py)
    capacity: float = 0.0  # Workload.moe_capacity_factor: every expert padded to it (0: dropless)
    vocab_parallel: bool = True  # False: AutoTP's whole vocabulary (frameworks.Traits.vocab_parallel)
    modules: frozenset[str] = frozenset({"core_attn"})  # Workload.recompute_modules (RECOMPUTE_MODULES)
    eager: Eager | None = None  # what runs uncompiled (eager_kernels.py); None: fused kernels throughout

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def linear_input_bytes(self) -> float:
        """Bytes per element of a linear layer's input kept for backward: TE keeps the quantized copy."""
        return self.recipe.element_bytes if self.recipe else ACT

    def repl(self, nbytes: float) -> float:
        """Replicated across TP ranks unless sequence parallelism splits it."""
        return nbytes / self.tp if self.sp else nbytes

    def tp_pair(self, nbytes: float) -> tuple[tuple[str, float], ...]:
        """The collective that closes a row-parallel matmul (and its SP partner)."""
        if self.tp == 1:
            return ()
        if self.sp:
            return (("allgather", nbytes), ("reducescatter", nbytes))
        return (("allreduce", nbytes),)


# A collective's backward partner (an all-reduce is its own).
_MIRROR = {"allgather": "reducescatter", "reducescatter": "allgather"}


def mirrored(ops: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """A forward's TP collectives as its backward runs them."""
    return tuple((_MIRROR.get(op, op), n) for op, n in ops)


def same_in_every_mode(nbytes: float) -> dict[str, float]:
    """Stored bytes that no recompute mode changes."""
    return {mode: float(nbytes) for mode in RECOMPUTE_MODES}


def eager_extra(extra: Bytes | None) -> Mapping[str, float]:
    """LayerCost.extra of a block's eager kernels (eager_kernels.py): the bytes they move beyond
    the fused price, forward ("eager_fwd") and backward ("eager_bwd"), per sample."""
    if extra is None or not (extra.fwd or extra.bwd):
        return _NO_EXTRA
    return MappingProxyType({"eager_fwd": extra.fwd, "eager_bwd": extra.bwd})
