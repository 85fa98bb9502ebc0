"""The layer cost profile: what each block of a ModelSpec costs on one GPU, per sample.

One ``LayerCost`` per block, for one (model, sequence length, images/tiles, tp, sequence
parallel, ep, precision, kernel choices). Every quantity is *per GPU and per sample* (a
micro-batch of b samples costs b times as much), so the search can build these once per
(tp, sp, ep) and scale by the micro-batch in numpy. GEMM shapes are kept (not only FLOPs)
because efficiency depends on them (planner/cost/efficiency.py).

Activation bytes follow Korthikanti et al. 2022 (arXiv:2205.05198) Eq. 1-6, written as a sum
of the tensors each operation keeps for backward, so that a GPT layer with dropout and without
FlashAttention reproduces Table 2 exactly (reference/korthikanti2022_activation_
memory_formulas.csv) while GQA, SwiGLU, MLA, MoE, ViT tiles, the projector, the embedding and
the fp32 logits of the LM head get their own terms. Tensors split into *replicated* (held by
every TP rank; split by t only under sequence parallelism) and *sharded* (split by t).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from planner.cost.parallel import Workload
from planner.errors import UserError
from planner.model.spec import (
    Block,
    DecoderBlock,
    DenseMLP,
    EmbeddingBlock,
    LMHeadBlock,
    ModelSpec,
    MoEMLP,
    NormBlock,
    ProjectorBlock,
    VisionBlock,
    VisionEmbedBlock,
    norm_params,
)

ACT = 2  # bytes of a bf16/fp16 activation
MASK = 1  # bytes of a dropout mask element (Korthikanti: "sbh" for a mask of s*b*h)
RECOMPUTE_MODES = ("none", "selective", "full")
_NO_EXTRA: Mapping[str, float] = MappingProxyType({})


# Gemm, AttnCore and LayerCost are NamedTuples, immutable as a frozen dataclass but built in one
# tuple allocation: a search prices each block once per (tp, sp, ep), too few calls for the
# interpreter to specialise a frozen dataclass's __init__ (one object.__setattr__ per field).
class Gemm(NamedTuple):
    """``batch`` GEMMs of (tokens*b x k) @ (k x n) per sample; ``tokens`` scales with b."""

    tokens: float
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.n * self.k * self.batch


class AttnCore(NamedTuple):
    """Scores and attention-over-values: ``seqs`` sequences of ``seq`` tokens, ``heads`` per GPU."""

    seqs: int  # independent sequences per sample (1 for text, the tiles for a ViT)
    seq: int
    heads: float
    qk_dim: int
    v_dim: int
    causal: bool
    flash: bool
    dropout: bool

    @property
    def flops(self) -> float:
        """Model FLOPs, full s^2 (the Megatron/Korthikanti convention, causal or not)."""
        return 2.0 * self.seqs * self.seq**2 * self.heads * (self.qk_dim + self.v_dim)


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
    ep_a2a_count: int  # all-to-alls forward (dispatch + combine); backward repeats them
    checkpointed: bool  # full recompute applies (transformer layers only, as in Megatron)
    extra: Mapping[str, float] = _NO_EXTRA

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
class _Ctx:
    tp: int
    sp: bool
    ep: int
    flash: bool
    dropout: bool
    rope: bool = False

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


def vision_tiles(model: ModelSpec, workload: Workload) -> int:
    """ViT passes per sample: images x (local tiles + the global view)."""
    if model.vision is None:
        return 0
    return workload.images_per_sample * (workload.tiles_per_image + (1 if model.vision.global_view else 0))


def layer_costs(model: ModelSpec, workload: Workload, tp: int = 1, sp: bool = False, ep: int = 1,
                memo: dict[tuple[int, int, bool, int], LayerCost] | None = None) -> list[LayerCost]:
    """The cost profile of every block, in ModelSpec order.

    ``memo``: a dict the caller keeps across calls for one (model, workload), holding each
    block's cost by (index, tp, sp, ep), with ep 1 but for a mixture-of-experts layer (the only
    block that reads it): a search prices dozens of (tp, sp, ep), which differ in those layers only."""
    ctx = _Ctx(tp, sp, ep, workload.flash_attention, workload.dropout, uses_rope(model))
    s = workload.seq_len
    tiles = vision_tiles(model, workload)
    out: list[LayerCost] = []
    # Equal blocks cost the same (VL2's 27 ViT and 29 MoE layers, a dense model's every layer):
    # price each distinct one once and renumber the copies.
    seen: dict[object, LayerCost] = {}
    for i, b in enumerate(model.blocks):
        if memo is None:
            out.append(_block_cost(model, i, b, s, tiles, ctx, seen))
            continue
        key = (i, tp, sp, ep if b.kind == "decoder" and b.mlp.kind == "moe" else 1)
        cost = memo.get(key)
        if cost is None:  # priced directly: hashing a layer for ``seen`` costs about as much
            cost = memo[key] = _block_cost(model, i, b, s, tiles, ctx, None)
        out.append(cost)
    return out


def _block_cost(model: ModelSpec, i: int, b: Block, s: int, tiles: int, ctx: _Ctx,
                seen: dict[object, LayerCost] | None) -> LayerCost:
    """Block ``i``'s cost; a transformer layer equal to one in ``seen`` (when given) is that
    one renumbered.

    Dispatched on the blocks' ``kind`` tag: a failing isinstance against a pydantic model class
    runs ABCMeta's Python-level __instancecheck__, and a norm failed five before it matched."""
    kind = b.kind
    if kind == "decoder" or kind == "vision":
        cost = seen.get(b) if seen is not None else None
        if cost is None:
            if isinstance(b, DecoderBlock):
                cost = _decoder(i, b, s, ctx)
            else:
                assert model.vision is not None
                cost = _vision(i, b, tiles, model.vision.patches_per_tile, ctx)
            if seen is not None:
                seen[b] = cost
        return cost if cost.index == i else cost._replace(index=i)
    if kind == "vision_embed":
        assert isinstance(b, VisionEmbedBlock) and model.vision is not None
        return _vision_embed(i, b, tiles * model.vision.patches_per_tile, ctx)
    if kind == "projector":
        assert isinstance(b, ProjectorBlock) and model.vision is not None
        return _projector(i, b, tiles * model.vision.patches_per_tile, ctx)
    if kind == "embedding":
        assert isinstance(b, EmbeddingBlock)
        return _embedding(i, b, s, ctx)
    if kind == "norm":
        assert isinstance(b, NormBlock)
        tokens = tiles * model.vision.patches_per_tile if (model.vision and _in_vision_tower(model, i)) else s
        return _norm(i, b, tokens, ctx)
    if kind == "lm_head":
        assert isinstance(b, LMHeadBlock)
        return _lm_head(i, b, s, ctx)
    raise TypeError(f"unknown block {type(b).__name__}")  # pragma: no cover - the Block union is closed


def uses_rope(model: ModelSpec) -> bool:
    """Rotary positions (RoPE or M-RoPE), as the model states them (ModelSpec.positions). A spec
    built by hand without them: rotary unless it learns absolute positions (GPT-2/3) or uses
    ALiBi (BLOOM, recognisable by its embedding LayerNorm)."""
    if model.positions is not None:
        return model.positions.kind in ("rope", "mrope")
    emb = next((b for b in model.blocks if isinstance(b, EmbeddingBlock)), None)
    return emb is not None and emb.learned_positions == 0 and emb.norm is None


def _in_vision_tower(model: ModelSpec, index: int) -> bool:
    """A norm belongs to the vision tower when the block before it is a vision block."""
    return index > 0 and isinstance(model.blocks[index - 1], VisionBlock)


# -- transformer layers -----------------------------------------------------------------


def _attention_parts(b: DecoderBlock, tokens: int, ctx: _Ctx):
    """GEMMs, core, stored bytes (replicated, sharded), params split for one attention."""
    a, h, t = b.attention, b.hidden, ctx.tp
    heads = a.heads / t
    if a.kind == "mla":
        m = a.mla
        assert m is not None
        gemms, repl_store, shard_store = [], 0.0, 0.0
        if m.q_lora_rank:
            gemms += [Gemm(tokens, m.q_lora_rank, h), Gemm(tokens, int(a.heads * m.q_head_dim / t), m.q_lora_rank)]
            repl_store += 2 * ACT * m.q_lora_rank  # q_a output (norm input) and normed latent (q_b input)
            repl_params = h * m.q_lora_rank + m.q_lora_rank
            shard_params = m.q_lora_rank * a.heads * m.q_head_dim
        else:
            gemms.append(Gemm(tokens, int(a.heads * m.q_head_dim / t), h))
            repl_params, shard_params = 0, h * a.heads * m.q_head_dim
        # Megatron-Core MLA: the down-projections are replicated, the up-projections split by heads.
        gemms += [Gemm(tokens, m.kv_lora_rank + m.qk_rope_head_dim, h),
                  Gemm(tokens, int(a.heads * (m.qk_nope_head_dim + m.v_head_dim) / t), m.kv_lora_rank)]
        repl_store += ACT * (m.kv_lora_rank + m.qk_rope_head_dim) + ACT * m.kv_lora_rank
        repl_params += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        shard_params += m.kv_lora_rank * a.heads * (m.qk_nope_head_dim + m.v_head_dim)
        qk, v = m.q_head_dim, m.v_head_dim
        shard_store += ACT * a.heads * (2 * qk + v)  # q, k (nope + rope), v
        out_in = a.heads * v
    else:
        qw, kvw = a.heads * a.head_dim, a.kv_heads * a.head_dim
        gemms = [Gemm(tokens, int((qw + 2 * kvw) / t), h)]
        shard_store = ACT * (qw + 2 * kvw)  # Q, K, V kept for the score and value products
        repl_store, repl_params = 0.0, 0
        shard_params = h * (qw + 2 * kvw) + ((qw + 2 * kvw) if a.qkv_bias else 0)
        qk, v = a.head_dim, a.head_dim
        out_in = qw
    gemms.append(Gemm(tokens, h, int(out_in / t)))
    shard_store += ACT * out_in  # output-projection input
    shard_params += out_in * h
    repl_params += h if a.out_bias else 0
    core = AttnCore(1, tokens, heads, qk, v, causal=True, flash=ctx.flash, dropout=ctx.dropout)
    return gemms, core, repl_store, shard_store, repl_params, shard_params


def _score_bytes(core: AttnCore) -> float:
    """Bytes of the s^2 terms per sample on one GPU (0 with FlashAttention, which keeps only
    the fp32 log-sum-exp per row). Unfused: softmax output 2as^2b, plus with dropout the mask
    as^2b and its output 2as^2b (Korthikanti Eq. 1: 5as^2b)."""
    rows = core.seqs * core.heads * core.seq
    if core.flash:
        return 4.0 * rows
    per = ACT + ((MASK + ACT) if core.dropout else 0)
    return per * rows * core.seq


def _mlp_parts(b: DecoderBlock, tokens: int, ctx: _Ctx):
    """A dense or MoE MLP: GEMMs, stored bytes per token (replicated, sharded), parameters
    (replicated, TP-sharded, routed experts per GPU), memory traffic per token, EP traffic."""
    h, t, mlp = b.hidden, ctx.tp, b.mlp
    if isinstance(mlp, DenseMLP):
        g, stored, traffic = _ffn(mlp.ffn, mlp.gated, tokens, h, t, 1)
        out_bias = h if mlp.bias else 0
        return g, 0.0, stored / tokens, out_bias, mlp.params(h) - out_bias, 0.0, traffic / tokens, 0.0, 0
    assert isinstance(mlp, MoEMLP)
    gated = mlp.act == "swiglu"
    e, k = mlp.routed_experts, mlp.top_k
    gemms = [Gemm(tokens, e, h)]  # router, replicated
    repl = 2 * 4.0 * e  # fp32 router logits and probabilities
    shard, traffic = 0.0, 0.0
    if mlp.shared_ffn:
        g, stored, tr = _ffn(mlp.shared_ffn, gated, tokens, h, t, 1)
        gemms += g
        shard += stored / tokens
        traffic += tr / tokens
    # Routed experts: balanced routing gives each GPU tokens*top_k token-copies after the
    # dispatch, spread over its e/ep local experts (Megatron-Core grouped GEMM); expert
    # weights are split over TP as well (expert tensor parallel = tp, Megatron-Core's default).
    local = e // ctx.ep
    g, stored, tr = _ffn(mlp.expert_ffn, gated, tokens * k / local, h, t, local)
    gemms += g
    shard += stored / tokens
    repl += k * 2 * ACT * h  # permuted input copies and the expert outputs awaiting combine
    traffic += tr / tokens + k * 4 * ACT * h  # permute + unpermute: read and write each copy
    expert_rank = e * mlp.expert_params(h) / (t * ctx.ep)
    a2a = tokens * k * h * ACT / (t if ctx.sp else 1)
    return gemms, repl, shard, mlp.gate_params(h), mlp.shared_params(h), expert_rank, traffic, a2a, 2


def _ffn(width: int, gated: bool, tokens: float, h: int, t: int, batch: int):
    """A (gated) MLP of ``width`` over ``batch`` x ``tokens``: GEMMs, stored bytes and memory
    traffic per sample (totals, not per token)."""
    w = width / t
    up = 2 * w if gated else w
    gemms = [Gemm(tokens, int(up), h, batch), Gemm(tokens, h, int(w), batch)]
    rows = tokens * batch
    # gated: fc1 output (gate and up, 2w) + fc2 input (w); GELU: its input (w) + fc2 input (w).
    # The fc1 input is the layer's MLP input, counted with the replicated tensors.
    stored = rows * ACT * (3 * width if gated else 2 * width)  # whole width: the caller splits by t
    traffic = rows * ACT * (up + w)  # activation kernel: read fc1 output, write fc2 input
    return gemms, stored, traffic


def _decoder(i: int, b: DecoderBlock, s: int, ctx: _Ctx) -> LayerCost:
    h = b.hidden
    ag, core, a_repl, a_shard, a_rp, a_sp = _attention_parts(b, s, ctx)
    mg, m_repl, m_shard, m_rp, m_sp, expert_rank, m_traffic, a2a, a2a_count = _mlp_parts(b, s, ctx)
    if ctx.rope:  # fused RoPE reads and writes the rotary part of Q and K once
        m_traffic += 2 * ACT * _rope_width(b) / ctx.tp
    return _transformer_layer(i, "decoder", b.params(), h, s, 1, ag + mg, core, a_repl + m_repl, a_shard + m_shard,
                              a_rp + m_rp + 2 * norm_params(h, b.norm), a_sp + m_sp, expert_rank, m_traffic,
                              a2a, a2a_count, ctx)


def _rope_width(b: DecoderBlock) -> float:
    a = b.attention
    if a.kind == "mla":
        assert a.mla is not None
        return (a.heads + 1) * a.mla.qk_rope_head_dim  # per-head query part + the shared key part
    return (a.heads + a.kv_heads) * a.head_dim


def _vision(i: int, b: VisionBlock, tiles: int, patches: int, ctx: _Ctx) -> LayerCost:
    """A ViT block over ``tiles`` independent sequences of ``patches`` tokens (full attention)."""
    if b.heads % ctx.tp:
        raise UserError(f"--tp {ctx.tp} does not divide the vision tower's {b.heads} heads; pick a tp that divides {b.heads}")
    h, t, tokens = b.hidden, ctx.tp, tiles * patches
    gemms = [Gemm(tokens, int(3 * h / t), h), Gemm(tokens, h, int(h / t))]
    g, stored, traffic = _ffn(b.mlp, False, tokens, h, t, 1)
    core = AttnCore(tiles, patches, b.heads / t, h // b.heads, h // b.heads, False, ctx.flash, ctx.dropout)
    per_tok = stored / tokens if tokens else 0.0
    shard = ACT * 4 * h + per_tok  # Q, K, V, output-projection input + MLP
    repl_params = 2 * norm_params(h, b.norm) + h + h  # norms, out bias, fc2 bias
    return _transformer_layer(i, "vision", b.params(), h, tokens, tiles, gemms + g, core, 0.0, shard, repl_params,
                              b.params() - repl_params, 0.0, traffic / tokens if tokens else 0.0, 0.0, 0, ctx)


def _transformer_layer(i, kind, params, h, tokens, seqs, gemms, core, extra_repl, shard, repl_params, shard_params,
                       expert_rank, mlp_traffic, a2a, a2a_count, ctx: _Ctx) -> LayerCost:
    """Assemble a pre-norm transformer layer (Korthikanti Eq. 1 layout) from its parts."""
    t = ctx.tp
    # Replicated per token: two norm inputs, attention input, MLP input (4 x 2h = 8h), plus a
    # dropout mask after attention and after the MLP (2 x 1h): Korthikanti's 10sbh.
    repl = 4 * ACT * h + (2 * MASK * h if ctx.dropout else 0) + extra_repl
    scores = _score_bytes(core) / tokens if tokens else 0.0
    stored_none = ctx.repl(repl) + shard / t + scores
    stored_sel = stored_none - (scores if not core.flash else 0.0)
    checkpoint = ctx.repl(ACT * h)  # full recompute keeps the layer input only
    act = {"none": stored_none * tokens, "selective": stored_sel * tokens, "full": checkpoint * tokens}
    # Memory-bound traffic per token, forward: 2 norms (read 2h, write 2h), 2 residual adds
    # (read 4h, write 2h, + mask 1h with dropout), the MLP activation, and without
    # FlashAttention the softmax (+ dropout) over a*s scores per token.
    per_tok = 2 * 4 * h + 2 * (6 * h + (MASK * h if ctx.dropout else 0))
    per_tok = ctx.repl(per_tok) + mlp_traffic
    score_tok = 0.0 if core.flash else core.heads * core.seq * (2 * ACT + ((2 * ACT + MASK) if ctx.dropout else 0))
    per_tok += score_tok
    nbytes = tokens * h * ACT
    tp = ctx.tp_pair(nbytes) * 2
    bwd = tuple([(_MIRROR.get(op, op), n) for op, n in tp])
    return LayerCost(i, kind, params, repl_params + shard_params / t, expert_rank, tokens, h, tuple(gemms), core,
                     per_tok * tokens, act, stored_none * tokens, tp, bwd, a2a, a2a_count, True,
                     {"score_hbm": score_tok * tokens})


# A collective's backward partner (an all-reduce is its own).
_MIRROR = {"allgather": "reducescatter", "reducescatter": "allgather"}


# -- the other blocks -------------------------------------------------------------------


def _embedding(i: int, b: EmbeddingBlock, s: int, ctx: _Ctx) -> LayerCost:
    """Vocab-parallel lookup: each TP rank owns vocab/t rows; partial outputs are all-reduced
    (reduce-scattered under SP). Korthikanti Sec 4.3: only the dropout mask is kept."""
    h, t = b.hidden, ctx.tp
    rp = b.learned_positions * h + (norm_params(h, b.norm) if b.norm else 0)
    act = ctx.repl(MASK * h if ctx.dropout else 0) * s + (ctx.repl(ACT * h) * s if b.norm else 0)
    traffic = ctx.repl(3 * ACT * h) * s  # gather rows, add positions, write
    fwd = ((("reducescatter" if ctx.sp else "allreduce"), s * h * ACT),) if t > 1 else ()
    bwd = (("allgather", s * h * ACT),) if (t > 1 and ctx.sp) else ()
    return LayerCost(i, "embedding", b.params(), rp + b.vocab * h / t, 0.0, s, h, (), None, traffic,
                     _same(act), act, fwd, bwd, 0.0, 0, False)


def _vision_embed(i: int, b: VisionEmbedBlock, patches: int, ctx: _Ctx) -> LayerCost:
    """Patch embedding as a GEMM over patch pixels (replicated; small)."""
    gemms = (Gemm(patches, b.hidden, b.patch_pixels),) if patches else ()
    act = patches * ACT * b.patch_pixels  # pixels kept for the weight gradient
    return LayerCost(i, "vision_embed", b.params(), b.params(), 0.0, patches, b.hidden, gemms, None,
                     patches * ACT * 2 * b.hidden, _same(act), act, (), (), 0.0, 0, False)


def _projector(i: int, b: ProjectorBlock, patches: int, ctx: _Ctx) -> LayerCost:
    """Token merge + 2-layer GELU MLP, replicated over TP (it is a few percent of a layer)."""
    tokens = patches // b.merge
    gemms = (Gemm(tokens, b.mlp_hidden, b.merged_dim), Gemm(tokens, b.out_dim, b.mlp_hidden)) if tokens else ()
    per_tok = ACT * (b.merged_dim * (2 if b.in_norm else 1) + 2 * b.mlp_hidden)
    return LayerCost(i, "projector", b.params(), b.params(), 0.0, tokens, b.out_dim, gemms, None,
                     tokens * ACT * (2 * b.merged_dim + 2 * b.mlp_hidden), _same(tokens * per_tok), tokens * per_tok,
                     (), (), 0.0, 0, False)


def _norm(i: int, b: NormBlock, tokens: int, ctx: _Ctx) -> LayerCost:
    act = ctx.repl(ACT * b.hidden) * tokens  # Korthikanti Sec 4.3: final LN input 2sbh (/t with SP)
    return LayerCost(i, "norm", b.params(), b.params(), 0.0, tokens, b.hidden, (), None,
                     ctx.repl(4 * b.hidden) * tokens, _same(act), act, (), (), 0.0, 0, False)


def _lm_head(i: int, b: LMHeadBlock, s: int, ctx: _Ctx) -> LayerCost:
    """Column-parallel output layer + vocab-parallel cross-entropy. Keeps its input (2sbh,
    /t with SP) and the fp32 logits/softmax 4sbv/t (Korthikanti Sec 4.3) until backward; a
    tied head holds no weights of its own but still does the GEMM."""
    h, v, t = b.hidden, b.vocab, ctx.tp
    act = (ctx.repl(ACT * h) + 4.0 * v / t) * s
    # Vocab-parallel cross-entropy in fp32 over the logits (Megatron): write the 16-bit logits
    # (2), upcast (read 2, write 4), max and sum-exp reductions (read 4 + 4), softmax written
    # for backward (4), gradient read and 16-bit write in backward (4 + 2): ~30 bytes per logit.
    traffic = s * (v / t) * 30.0 / 3.0  # counted as forward traffic; backward doubles it
    fwd = (("allgather", s * h * ACT),) if (t > 1 and ctx.sp) else ()
    bwd = ((("reducescatter" if ctx.sp else "allreduce"), s * h * ACT),) if t > 1 else ()
    return LayerCost(i, "lm_head", b.params(), b.params() / t, 0.0, s, h, (Gemm(s, int(v / t), h),), None,
                     traffic, _same(act), act, fwd, bwd, 0.0, 0, False)


def _same(nbytes: float) -> dict[str, float]:
    return {mode: float(nbytes) for mode in RECOMPUTE_MODES}


# -- published formulas (tests compare the profile against these) ----------------------


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, mode: str = "none") -> float:
    """Korthikanti et al. 2022 Table 2, bytes per GPT layer (no FlashAttention, with dropout)."""
    if mode == "full":
        return 2.0 * s * b * h
    score = 0.0 if mode == "selective" else 5.0 * a * s / (h * t)
    if sp:
        return s * b * h * (34.0 / t + score)
    return s * b * h * (10.0 + 24.0 / t + score)
