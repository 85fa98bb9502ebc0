"""ParallelConfig and Workload: the plain data every cost function takes.

ParallelConfig is the single home of the degree rules (in the spirit of torchtitan's
ParallelDims): it checks every cross-degree rule when it is built and exposes the derived
facts as tiny properties. Rules that depend on the model (TP divides heads, EP divides the
experts) live in ``check_against_model``; rules that depend on the runtime live in
planner/cost/frameworks.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from planner.cost.dualpipe import SCHEDULES
from planner.cost.eager_kernels import COMPILE_COMPONENTS, CompileComponent
from planner.cost.layer_cost import RECOMPUTE_MODES, RECOMPUTE_MODULES
from planner.cost.measured_blocks import LayerProfile
from planner.cost.precision import RECIPE_NAMES
from planner.errors import UserError, arg

if TYPE_CHECKING:
    from planner.model.spec import ModelSpec

Framework = Literal["deepspeed", "megatron-deepspeed", "megatron", "torchtitan"]
Offload = Literal["none", "optimizer", "optimizer+params"]
Recompute = Literal["none", "selective", "full", "op"]
RecomputeModule = Literal["core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "moe", "shared_experts"]
Precision = Literal["bf16", "fp16", "fp32"]
RecipeName = Literal["fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]
PrecisionName = Literal["bf16", "fp16", "fp32", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]
Optimizer = Literal["adamw", "adam", "sgd"]
# How context-parallel ranks exchange attention inputs (Megatron-Core's --cp-comm-type): a ring
# of K/V chunks over p2p, overlapped with each step's attention; an all-to-all of Q, K, V and
# the output over heads (DeepSpeed Ulysses, Megatron "a2a"); a2a inside a node and p2p across.
CpComm = Literal["p2p", "a2a", "a2a+p2p"]
ZeroPP = Literal["qwz", "hpz", "qgz"]  # DeepSpeed ZeRO++: int8 weight gather, hierarchical partition, int4 grads
ZERO_PP = ("qwz", "hpz", "qgz")
# The pipeline schedule (planner/cost/dualpipe.py): looped 1F1B (interleaved when a rank holds
# more than one chunk) or DeepSeek's DualPipeV, two chunks per rank in a V.
PpSchedule = Literal["1f1b", "dualpipev"]
assert get_args(PpSchedule) == SCHEDULES, "Workload.pp_schedule takes dualpipe.SCHEDULES"


# ``--zeropp auto`` on suggest: none, each option alone, and all three, each searched.
ZERO_PP_AUTO: tuple[tuple[str, ...], ...] = ((), ("qwz",), ("hpz",), ("qgz",), ZERO_PP)


def zero_pp_variants(value: "str | Sequence[str]") -> tuple[tuple[str, ...], ...]:
    """The ZeRO++ choices a search tries: ``auto``'s five, or the one list given."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return ZERO_PP_AUTO
    return (parse_zero_pp(value),)


def parse_zero_pp(value: "str | Sequence[str]") -> tuple[str, ...]:
    """``--zeropp``: a comma list of qwz, hpz, qgz (or none), in any order."""
    items = [v.strip().lower() for v in (value.split(",") if isinstance(value, str) else value)]
    items = [v for v in items if v and v != "none"]
    bad = [v for v in items if v not in ZERO_PP]
    if bad:
        raise UserError(f"{arg('zero_pp')}: unknown ZeRO++ option {bad[0]!r}; give a comma list of "
                        f"{', '.join(ZERO_PP)} (or none; suggest also takes auto)")
    return tuple(k for k in ZERO_PP if k in items)

# Appended, never reordered: search columns and cached tables hold indices into it.
FRAMEWORKS: tuple[str, ...] = ("deepspeed", "megatron-deepspeed", "megatron", "torchtitan")
# What the search tries when no --framework is given: torchtitan only when asked for, so the
# default search is not a third slower for a runtime most users pin when they want it.
SEARCHED_BY_DEFAULT: tuple[str, ...] = ("deepspeed", "megatron-deepspeed", "megatron")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
RECOMPUTES: tuple[str, ...] = RECOMPUTE_MODES
CP_COMMS: tuple[str, ...] = ("p2p", "a2a", "a2a+p2p")


# The largest --moe-imbalance: every token of a layer on one rank of a 64-way expert group.
MAX_MOE_IMBALANCE = 64.0
MAX_MTP_LAYERS = 16  # multi-token-prediction depths (DeepSeek-V3 trains one)
# The largest --mtbf-hours: a century (beyond it no checkpoint interval changes).
MAX_MTBF_HOURS = 876_000.0


class Workload(BaseModel):
    """What is trained per optimizer step, independent of how it is parallelised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_batch: PositiveInt  # samples per optimizer step
    seq_len: PositiveInt  # language tokens per sample (image tokens included for VLMs)
    images_per_sample: int = Field(0, ge=0)
    tiles_per_image: int = Field(0, ge=0)  # local tiles; the global view (if any) is added by the model
    precision: Precision = "bf16"
    # A Transformer Engine recipe on top of bf16 (planner/cost/precision.py). Give either
    # precision="fp8-tensorwise" (split here) or precision="bf16", recipe="fp8-tensorwise".
    recipe: RecipeName | None = None
    optimizer: Optimizer = "adamw"
    # Kernel facts that change memory and time (see planner/cost/README.md):
    # FlashAttention (the default in Megatron-Core/TE, HF sdpa) keeps no s^2 score matrix and
    # recomputes the scores in backward; False models the unfused kernels of Korthikanti et
    # al. 2022 Table 2 (softmax output + dropout mask/output stored, 5*a*s^2*b bytes per layer).
    flash_attention: bool = True
    # The FlashAttention generation the stack runs: 2 (FlashAttention-2, PyTorch SDPA's flash
    # backend) or 1 (flash-attn 1.x and the Triton kernel derived from it, llm-foundry's
    # attn_impl: triton), about half FlashAttention-2's rate (efficiency.FLASH1_SPEED).
    flash_version: Literal[1, 2] = 2
    # Hidden/attention dropout (GPT-2/3 era, Megatron GPT defaults 0.1). Modern LLM
    # pre-training (Llama, DeepSeek, Qwen) uses none; with it each dropout stores a 1-byte mask.
    dropout: bool = False
    # Tensor-parallel collectives overlapped with the GEMMs where the runtime can
    # (frameworks.Traits.tp_comm_overlap: Megatron-Core with TE's userbuffers, --tp-comm-overlap,
    # under sequence parallelism). False models runs without it (Megatron-LM 2021-22).
    tp_comm_overlap: bool = True
    # Megatron-Core's attention through Transformer Engine (frameworks.Traits.te_attention); False
    # prices FlashAttention-2 for it too (a stack without TE).
    te_attention: bool = True
    # Expert all-to-alls overlapped with the other micro-batch's compute where the runtime can
    # (frameworks.Traits.ep_comm_overlap: Megatron-Core's --overlap-moe-expert-parallel-comm, as
    # NVIDIA's MoE recipes run); False prices them exposed.
    ep_comm_overlap: bool = True
    # Tokens the busiest expert-parallel rank receives over the mean (max / mean of a layer's
    # routing): 1.0 is the forced balance NVIDIA's published MoE benchmarks run; real routing
    # under an auxiliary loss runs above it. The step waits for the busiest rank at every
    # all-to-all, so its grouped GEMMs, permutes and received bytes scale by it.
    moe_imbalance: float = Field(1.0, ge=1.0, le=MAX_MOE_IMBALANCE)
    # Megatron-Core's token dispatcher (planner/cost/moe_dispatch.py): the NCCL all-to-all of every
    # top-k copy, allgather (every token to every rank of the experts' TP x EP group, a reduce-
    # scatter back), or flex (DeepEP / HybridEP), which sends one copy per destination node.
    moe_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"
    # Megatron-Core's capacity-factor token dropping with padding (--moe-expert-capacity-factor F
    # --moe-pad-expert-input-to-capacity): every expert takes exactly F x its mean tokens, dropped
    # above and padded below, so the exchange and the expert GEMMs run at F whatever the routing.
    # None: dropless (Megatron's default), priced at moe_imbalance.
    moe_capacity_factor: float | None = Field(None, gt=0, le=MAX_MOE_IMBALANCE)
    # Weights kept and all-gathered in the recipe's FP8 format where the runtime can (Megatron-Core's
    # --fp8-param-gather with the distributed optimizer, under a recipe with Recipe.param_gather),
    # as NVIDIA's Megatron-Bridge recipes run; False keeps the bf16 weights beside the FP8 copies.
    fp8_param_gather: bool = True
    # Megatron-Core's precision-aware optimizer (--use-precision-aware-optimizer, TE's FusedAdam) with
    # bf16 Adam moments (--exp-avg-dtype / --exp-avg-sq-dtype bf16); where TE keeps the fp32 master
    # weights (bf16 training, delayed FP8) it stores only their 16-bit remainders beside the bf16
    # weights (OptimizerConfig.store_param_remainders, on by default): 2 + 4 bytes of optimizer
    # state per parameter instead of 4 + 8 (megatron/core/optimizer/optimizer_config.py).
    precision_aware_optimizer: bool = False
    # DeepSpeed ZeRO++ on ZeRO-3 (Wang et al. 2023, arXiv:2306.10209; planner/cost/zero3_fetch.py):
    # qwz all-gathers int8 weights (zero_quantized_weights), hpz keeps a secondary 16-bit weight
    # partition inside each node and gathers from it after the step's first forward
    # (zero_hpz_partition_size), qgz reduces gradients as int4 in two all-to-alls, inside the
    # node and then across (zero_quantized_gradients).
    zero_pp: tuple[ZeroPP, ...] = ()
    # The job's mean time between failures, hours (planner/cost/goodput.py); None: from the
    # hardware profile's per-GPU and per-node rates, scaled by the job's size.
    mtbf_hours: float | None = Field(None, gt=0, le=MAX_MTBF_HOURS)
    # Block costs measured by ``dsplan profile`` (planner/cost/measured_blocks.py), replacing the
    # analytic ones where given: how this job's blocks run on this system.
    layer_profile: LayerProfile | None = None
    # Multi-token-prediction depths trained beside the model (DeepSeek-V3's MTP module, Megatron-Core's
    # --mtp-num-layers; model.spec.MTPBlock): None keeps the model's own (num_nextn_predict_layers).
    mtp_layers: int | None = Field(None, ge=0, le=MAX_MTP_LAYERS)
    # What Megatron's selective recompute runs again (--recompute-modules; layer_cost.RECOMPUTE_MODULES):
    # its default, the attention core, or the modules NVIDIA's MoE recipes pick (DeepSeek-V3:
    # mla_up_proj; GPT-OSS: layernorm, moe_act), which free more for a little memory-bound work.
    recompute_modules: tuple[RecomputeModule, ...] = Field(("core_attn",), min_length=1)
    # The pipeline schedule of plans with pp > 1: looped 1F1B (Megatron-Core's and PyTorch's
    # 1F1B / interleaved 1F1B, by virtual stages) or DualPipeV (torchtitan; two chunks per rank).
    pp_schedule: PpSchedule = "1f1b"
    # torchtitan's compile.components: the transformer blocks ("model") and the loss compiled by
    # inductor, their elementwise ops fused, as dsplan's torchtitan configs run them (DualPipeV's
    # stages run eager). What is left out runs PyTorch's eager kernels (planner/cost/eager_kernels.py).
    compile: tuple[CompileComponent, ...] = COMPILE_COMPONENTS
    # Eager RMSNorm: PyTorch 2.8's fused kernel, or aten's composite of PyTorch before 2.8 (the
    # December 2024 torchtitan runs bench_torchtitan_published prices).
    rms_norm_kernel: Literal["fused", "composite"] = "fused"

    @model_validator(mode="before")
    @classmethod
    def _split_recipe(cls, data):
        """``precision`` may name a recipe: it trains in bf16 with that recipe."""
        if isinstance(data, dict) and data.get("precision") in RECIPE_NAMES:
            data = {**data, "recipe": data["precision"], "precision": "bf16"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _allgather_runs_no_overlap(cls, data):
        """Megatron-Core overlaps the expert exchange with alltoall and flex only (transformer_config.py:
        "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher")."""
        if isinstance(data, dict) and data.get("moe_dispatcher") == "allgather":
            data = {**data, "ep_comm_overlap": False}
        if isinstance(data, dict) and "moe" in (data.get("recompute_modules") or ()):
            # "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm"
            data = {**data, "ep_comm_overlap": False}
        if isinstance(data, dict) and data.get("moe_dispatcher") == "flex" and data.get("moe_capacity_factor"):
            # Megatron-Core: "Flex token dispatcher with deepep backend does not support
            # moe_pad_expert_input_to_capacity" (transformer_config.py); HybridEP's padding is not priced
            raise ValueError("moe_capacity_factor with moe_dispatcher flex: DeepEP does not pad to capacity; "
                             "use the alltoall or allgather dispatcher, or no capacity factor")
        return data

    @field_validator("zero_pp", mode="after")
    @classmethod
    def _zero_pp_order(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(k for k in ZERO_PP if k in value)

    @field_validator("compile", mode="after")
    @classmethod
    def _compile_order(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(k for k in COMPILE_COMPONENTS if k in value)

    @field_validator("recompute_modules", mode="after")
    @classmethod
    def _modules_order(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(m for m in RECOMPUTE_MODULES if m in value)

    def trained(self, model: "ModelSpec") -> "ModelSpec":
        """``model`` as this workload trains it: with ``mtp_layers`` MTP depths when given."""
        if self.mtp_layers is None or self.mtp_layers == model.mtp_layers:
            return model
        return model.with_mtp_layers(self.mtp_layers)

    def resolved(self, model: "ModelSpec") -> "Workload":
        """This workload with the MTP depths it trains ``model`` with stated, as plans record them."""
        n = model.mtp_layers if self.mtp_layers is None else self.mtp_layers
        return self if self.mtp_layers == n else self.model_copy(update={"mtp_layers": n})

    @property
    def precision_name(self) -> str:
        """What ``--precision`` said: the recipe, or the working precision."""
        return self.recipe or self.precision

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def bytes_per_param(self) -> int:
        """Bytes of a weight or gradient in the working precision."""
        return 4 if self.precision == "fp32" else 2

    @property
    def state_dtypes(self) -> dict[str, int]:
        """Bytes per parameter of one optimizer moment and of the master weights, as
        memory.bytes_per_param keywords: bf16 moments under the precision-aware optimizer, and
        16-bit remainders of the master weights where TE's FusedAdam holds them (bf16 training or
        delayed FP8; under current scaling Megatron-Core keeps fp32 master weights itself,
        megatron/core/optimizer/__init__.py use_precision_aware_optimizer_no_fp8_or_ds_fp8)."""
        if not self.precision_aware_optimizer:
            return {"moment_bytes": 4, "master_bytes": 4}
        return {"moment_bytes": 2, "master_bytes": 2 if self.recipe in (None, "fp8-delayed") else 4}

    @property
    def optimizer_moments(self) -> int:
        """fp32 moment tensors the optimizer keeps per parameter (Adam: momentum and variance)."""
        return 0 if self.optimizer == "sgd" else 2


class ParallelConfig(BaseModel):
    """How a job is split: degrees, ZeRO, offload, batch split and recomputation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    ep: PositiveInt = 1
    # Expert tensor parallel (MoE parallel folding, Megatron-Core --expert-tensor-parallel-size):
    # the routed experts' own TP degree, 1 or tp (None: tp, Megatron's default). At 1 under
    # tp > 1 the TP ranks become expert-parallel ranks: experts span tp x dp x cp / ep ranks.
    etp: PositiveInt | None = None
    cp: PositiveInt = 1  # context parallel: each sample's sequence split over cp ranks
    cp_comm: CpComm = "p2p"
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload: Offload = "none"
    micro_batch: PositiveInt = 1
    grad_accum: PositiveInt = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    virtual_stages: PositiveInt = 1  # interleaved 1F1B chunks per pipeline rank
    framework: Framework = "deepspeed"
    # Hybrid sharding: the dp x cp ranks form dp_replicate groups of dp_shard ranks; ZeRO shards
    # within a group and the groups replicate each other (Megatron's
    # --num-distributed-optimizer-instances, torchtitan's data_parallel_replicate_degree).
    dp_replicate: PositiveInt = 1
    # Decoder layers whose activations go to host memory in the forward and come back for the
    # backward (Megatron-Core --cpu-offloading-num-layers, TE's CPU offload; activation_offload.py).
    activation_offload: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _experts_take_tp(cls, data: Any) -> Any:
        """An unset ``etp`` is the attention's tp, so that equal layouts compare equal."""
        if isinstance(data, dict) and data.get("etp") is None:
            return {**data, "etp": data.get("tp", 1)}
        return data

    @model_validator(mode="after")
    def _rules(self) -> "ParallelConfig":
        # Expert parallelism reuses data-parallel ranks (DeepSpeed MoE, Megatron-Core EP):
        # experts are sharded over `ep` ranks of the DP group (with context parallelism, of the
        # dp x cp ranks that reduce a dense gradient: Megatron-Core's expert mapping folds cp in;
        # with etp 1 under tp > 1, of the tp x dp x cp ranks: parallel folding).
        if self.etp not in (1, self.tp):
            raise ValueError(f"etp ({self.etp}) must be 1 or tp ({self.tp}): the experts keep the attention's "
                             "tensor parallelism or fold it into expert parallelism")
        if (self.dp_ranks * self.tp // self.expert_tp) % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide {'dp x cp' if self.expert_tp == self.tp else 'tp x dp x cp'}"
                             f" ({self.dp_ranks * self.tp // self.expert_tp}): expert parallel ranks come from the "
                             "data-parallel group" + (" and the folded TP ranks" if self.expert_tp < self.tp else ""))
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallel needs tp > 1 (it splits the TP-replicated activations)")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages need pp > 1")
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise ValueError("parameter offload needs ZeRO-3")
        if self.offload == "optimizer" and self.zero_stage == 0:
            raise ValueError("optimizer offload needs ZeRO 1, 2 or 3")
        if not replicates_evenly(self.dp, self.cp, self.ep, self.dp_replicate, self.tp // self.expert_tp):
            raise ValueError(f"dp_replicate ({self.dp_replicate}) must divide dp ({self.dp}) and the expert "
                             f"replicas ({self.expert_dp}), and leave at least 2 ranks per sharding group")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_ranks(self) -> int:
        """Ranks a dense gradient is reduced over and ZeRO shards over: the DP group with its
        context-parallel ranks (which hold the same weights and see other tokens)."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks ZeRO shards over: one sharding group of the dp x cp ranks (all of them unless
        hybrid sharding replicates ``dp_replicate`` groups)."""
        return self.dp_ranks // self.dp_replicate

    @property
    def samples_per_step(self) -> int:
        """Global batch: micro-batch x accumulation x data-parallel world size."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel degree (``etp``)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert (expert_replicas)."""
        return expert_replicas(self.dp_ranks, self.tp, self.ep, self.expert_tp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step on each pipeline (1F1B runs this many)."""
        return self.grad_accum

    @property
    def pipelined(self) -> bool:
        return self.pp > 1


def expert_replicas(dp_ranks, tp, ep, etp):
    """Replicas of each routed expert, the group its gradients reduce over: the ranks of one
    pipeline stage, tp x dp x cp, over etp x ep (Megatron-Core's expert mapping); dp x cp / ep
    while the experts keep the attention's tp. Ints or numpy arrays alike."""
    return dp_ranks * tp // (etp * ep)


def expert_tp_of(choice: int | None, tp: int) -> int:
    """The experts' TP beside ``tp`` under a search's expert-TP choice (None: tp; 1: folded)."""
    return tp if choice is None else min(choice, tp)


def replicates_evenly(dp: int, cp: int, ep: int, rep: int, fold: int = 1) -> bool:
    """Whether ``rep`` hybrid-sharding groups split the dp x cp ranks evenly: whole DP replicas
    (torchtitan's replicate x shard mesh), whole expert-DP groups (Megatron-Core's partial
    expert data parallel; ``fold``: tp / etp), and at least two ranks to shard over."""
    return rep == 1 or (dp % rep == 0 and (dp * cp * fold // ep) % rep == 0 and dp * cp // rep >= 2)


def check_against_model(cfg: ParallelConfig, *, heads: int, kv_heads: int, routed_experts: int, blocks: int) -> None:
    """Rules that need the model: raise UserError saying which rule broke."""
    tp, ep = arg("tp"), arg("ep")
    if heads % cfg.tp:
        raise UserError(f"{tp} {cfg.tp} does not divide the {heads} attention heads; pick a tp that divides {heads}")
    if kv_heads % cfg.tp:
        # Megatron-LM asserts num_query_groups % tensor_model_parallel_size == 0.
        raise UserError(f"{tp} {cfg.tp} does not divide the {kv_heads} KV heads; pick a tp that divides {kv_heads}")
    if cfg.ep > 1 and routed_experts == 0:
        raise UserError(f"{ep} {cfg.ep} needs a mixture-of-experts model; this model is dense (use {ep} 1)")
    if routed_experts and routed_experts % cfg.ep:
        raise UserError(f"{ep} {cfg.ep} does not divide the {routed_experts} routed experts; pick an ep that divides "
                        f"{routed_experts}")
    if cfg.pp * cfg.virtual_stages > blocks:
        raise UserError(f"{arg('pp')} {cfg.pp} x {arg('virtual_stages')} {cfg.virtual_stages} exceeds the model's "
                        f"{blocks} blocks")
