"""What each runtime cannot run, as one table of rules (``RULES``) that answers for one plan
(``check_framework``: a UserError naming the first broken rule) and for the search's columns of
thousands of candidates (``first_broken``). The runtimes themselves are described in
planner/cost/frameworks.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from planner.cost.eager_kernels import COMPILE_COMPONENTS
from planner.cost.parallel import ParallelConfig
from planner.cost.precision import split_precision
from planner.cost.torchtitan import ONLY_HERE as TORCHTITAN_ONLY
from planner.cost.torchtitan import RULES as TORCHTITAN_RULES
from planner.errors import UserError, arg
from planner.model.parts import MoEMLP

if TYPE_CHECKING:
    from planner.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the rules read besides the config: the model's and the workload's facts."""

    is_moe: bool
    decoder_layers: int
    is_vlm: bool
    optimizer: str
    precision: str
    mla: bool = False  # multi-latent attention (DeepSeek-V2/V3)
    positions: str = "rope"  # Positions.kind: learned | rope | mrope | alibi
    recipe: str | None = None  # a Transformer Engine recipe (precision.py); precision is then bf16
    model: str = ""  # the model's name: torchtitan builds only its own flavors (cost/torchtitan.py)
    precision_aware_optimizer: bool = False  # Workload.precision_aware_optimizer
    expert_bias: bool = False  # MoE experts with biased linears (gpt-oss)
    window: bool = False  # sliding-window attention on some layer (gpt-oss)
    zero_pp: tuple[str, ...] = ()  # Workload.zero_pp: DeepSpeed ZeRO++ options
    mtp: bool = False  # trains a multi-token-prediction module (ModelSpec.mtp_layers)
    ep_overlap: bool = False  # Workload.ep_comm_overlap: the expert all-to-alls overlapped where the runtime can
    dispatcher: str = "alltoall"  # Workload.moe_dispatcher (planner/cost/moe_dispatch.py)
    modules: tuple[str, ...] = ("core_attn",)  # Workload.recompute_modules: what selective recompute runs again
    pp_schedule: str = "1f1b"  # Workload.pp_schedule: looped 1F1B or DualPipeV (dualpipe.py)
    compiled: tuple[str, ...] = COMPILE_COMPONENTS  # Workload.compile: what torchtitan's torch.compile covers


@dataclass(frozen=True, slots=True)
class Rule:
    """One thing a runtime cannot run. ``broken`` is written with ``&``, ``|`` and comparisons
    only, so it answers for one ParallelConfig (a bool) and for ``ConfigColumns`` (a mask over
    thousands of candidates) alike: the messages and the search's filter are one table. A
    condition on the facts alone (a plain bool) comes first, joined with ``and``, so where the
    model or workload rules a rule out it answers False without reading the config."""

    framework: str | None  # None: every runtime
    broken: Callable[[Any, RunFacts], Any]
    message: Callable[[Any, RunFacts], str]


def _moe_zero3_rule(f: str) -> Rule:
    # DeepSpeed 0.19's engine asserts "Native DeepSpeed MoE is not supported with ZeRO Stage 3"
    # (runtime/engine.py); Megatron-DeepSpeed's MoE layers are DeepSpeed's.
    return Rule(f, lambda c, x: x.is_moe and c.zero_stage > 2,
                lambda c, x: f"framework {f}: DeepSpeed's MoE layers do not run under ZeRO-3 (DeepSpeed refuses "
                             f"the engine); use {arg('zero')} 1/2 or {arg('framework')} megatron")


def _interleave_rule(f: str) -> Rule:
    return Rule(f, lambda c, x: c.virtual_stages > 1,
                lambda c, x: f"framework {f} has no interleaved pipeline schedule; use {arg('virtual_stages')} 1 or "
                             f"{arg('framework')} megatron")


# The runtimes whose experts have a TP degree of their own (MoE parallel folding).
EXPERT_TP_RUNTIMES = ("megatron", "torchtitan")

# In the order they are checked: a config breaking several is told about the first.
RULES: tuple[Rule, ...] = (
    # First, what the runtime cannot build at all, whatever the layout: the one thing to say.
    # deepspeedai/Megatron-DeepSpeed's model is Megatron's GPT of 2023: no MLA layer. ALiBi
    # is BigScience's fork (bigscience-workshop/Megatron-DeepSpeed megatron/arguments.py:
    # --position-embedding-type alibi), which trained BLOOM-176B, so megatron-deepspeed prices it.
    Rule("megatron-deepspeed", lambda c, x: x.mla and c.tp > 0,
         lambda c, x: "framework megatron-deepspeed has no multi-latent attention (MLA) layer; use "
                      f"{arg('framework')} megatron (Megatron-Core's --multi-latent-attention) or deepspeed"),
    # Megatron-Core's --position-embedding-type: learned_absolute, rope, mrope, relative, none.
    Rule("megatron", lambda c, x: x.positions == "alibi" and c.tp > 0,
         lambda c, x: "framework megatron has no ALiBi position biases (--position-embedding-type offers "
                      "learned_absolute, rope, mrope, relative and none), so it cannot build this model; use "
                      f"{arg('framework')} megatron-deepspeed (BigScience's fork trained BLOOM) or deepspeed"),
    # BigScience's fork is Megatron of 2021: no sequence parallelism, and --checkpoint-activations
    # checkpoints whole layers (its megatron/arguments.py has neither of the later flags).
    Rule("megatron-deepspeed", lambda c, x: x.positions == "alibi" and c.sequence_parallel == True,  # noqa: E712
         lambda c, x: "framework megatron-deepspeed runs ALiBi models on BigScience's fork, which has no sequence "
                      f"parallelism; use {arg('no_sequence_parallel')}"),
    Rule("megatron-deepspeed", lambda c, x: x.positions == "alibi" and c.recompute == "selective",
         lambda c, x: "framework megatron-deepspeed runs ALiBi models on BigScience's fork, which checkpoints whole "
                      f"layers only; use {arg('recompute')} full or none"),
    # The TE recipes are Megatron-Core's (--fp8-recipe, --fp4-recipe); DeepSpeed's engine and
    # Megatron-DeepSpeed's model have no Transformer Engine layers to run them.
    Rule(None, lambda c, x: x.recipe is not None and (c.framework != "megatron") & (c.framework != "torchtitan"),
         lambda c, x: f"framework {c.framework} has no Transformer Engine recipe to run {arg('precision')} "
                      f"{x.recipe}; use {arg('framework')} megatron or {arg('precision')} bf16"),
    # DeepSpeed swaps in DeepSpeedCPUAdam (its offload optimizers are Adam, Adagrad and Lion);
    # Megatron-Core's offload rides on the precision-aware optimizer, which is Adam only.
    Rule(None, lambda c, x: x.optimizer == "sgd" and c.offload != "none",
         lambda c, x: f"framework {c.framework}: optimizer offload steps Adam on the CPU, not sgd; use "
                      f"{arg('optimizer')} adamw/adam or {arg('offload')} none"),
    # TE's FusedAdam under the distributed optimizer only (megatron/core/optimizer/__init__.py
    # get_megatron_optimizer; optimizer_config.py asserts adam); offload already runs on it.
    Rule(None, lambda c, x: x.precision_aware_optimizer and (
        (c.framework != "megatron") | (c.zero_stage != 1) | (c.offload != "none") | (x.optimizer == "sgd")
        | (x.precision != "bf16")),
         lambda c, x: f"{arg('precision_aware_optimizer')} is Megatron-Core's (TE's FusedAdam over the distributed "
                      f"optimizer, bf16 training, Adam, no offload); use {arg('framework')} megatron {arg('zero')} 1 "
                      f"{arg('offload')} none or drop it"),
    # ZeRO++ is DeepSpeed's ZeRO-3 (zero_hpz_partition_size, zero_quantized_weights and
    # zero_quantized_gradients act in runtime/zero/stage3.py and partition_parameters.py only).
    Rule(None, lambda c, x: bool(x.zero_pp) and (
        ((c.framework != "deepspeed") & (c.framework != "megatron-deepspeed")) | (c.zero_stage != 3)),
         lambda c, x: f"{arg('zero_pp')} {','.join(x.zero_pp)} is DeepSpeed's ZeRO++, which runs on ZeRO-3; use "
                      f"{arg('framework')} deepspeed {arg('zero')} 3 or drop it"),
    # Hybrid sharding: Megatron-Core's --num-distributed-optimizer-instances (the distributed
    # optimizer, or Megatron-FSDP's HSDP: mcore_fsdp_adapter.py enable_hsdp) and torchtitan's
    # FSDP2 over a replicate x shard mesh. DeepSpeed 0.19 removed MiCS; its hpZ is ZeRO++ (--zeropp).
    Rule(None, lambda c, x: (c.dp_replicate > 1)
         & ((c.framework != "megatron") | ((c.zero_stage != 1) & (c.zero_stage != 3)))
         & ((c.framework != "torchtitan") | (c.zero_stage != 3)),
         lambda c, x: f"{arg('dp_replicate')} {c.dp_replicate} (hybrid sharding) runs on {arg('framework')} megatron "
                      f"with {arg('zero')} 1 or 3 (--num-distributed-optimizer-instances) or torchtitan with "
                      f"{arg('zero')} 3 (HSDP); not on framework {c.framework} with ZeRO-{c.zero_stage}: use one of "
                      f"those, or {arg('dp_replicate')} 1"),
    # What only torchtitan runs (DualPipeV, a choice of what torch.compile covers), on the others.
    *(Rule(None, lambda c, x, b=broken: b(x) and (c.framework != "torchtitan"), message)
      for broken, message in TORCHTITAN_ONLY),
    _moe_zero3_rule("deepspeed"),
    Rule("deepspeed", lambda c, x: (c.tp > 1) & (c.zero_stage > 2),
         lambda c, x: f"framework deepspeed: AutoTP tensor parallelism ({arg('tp')} {c.tp}) works with ZeRO <= 2, "
                      f"not "
                      f"ZeRO-{c.zero_stage}; use {arg('zero')} 1/2 or {arg('tp')} 1"),
    Rule("deepspeed", lambda c, x: (c.pp > 1) & (c.zero_stage > 1),
         lambda c, x: f"framework deepspeed: PipelineModule ({arg('pp')} {c.pp}) rejects ZeRO-{c.zero_stage} "
                      f"(pipeline parallelism supports ZeRO 0/1); use {arg('zero')} 1 or {arg('pp')} 1"),
    # AutoTP shards a plain module tree by layer names; it has no pipeline-stage or expert
    # groups (DeepSpeed's AutoTP training tutorial: no PipelineModule, no MoE). DeepSpeed 0.19's
    # engine sets its groups to a (data_parallel, tensor_parallel) mesh over the whole world
    # (runtime/engine.py _configure_tensor_parallel_states, utils/groups.py _init_tp_mesh_device):
    # no pipeline axis, so BLOOM's TP4 x PP12 runs as megatron-deepspeed.
    Rule("deepspeed", lambda c, x: (c.tp > 1) & (c.pp > 1),
         lambda c, x: f"framework deepspeed: AutoTP tensor parallelism ({arg('tp')} {c.tp}) does not combine with "
                      f"PipelineModule ({arg('pp')} {c.pp}); use {arg('framework')} megatron-deepspeed for 3D "
                      "parallelism"),
    Rule("deepspeed", lambda c, x: x.is_moe and c.tp > 1,
         lambda c, x: f"framework deepspeed: AutoTP tensor parallelism ({arg('tp')} {c.tp}) does not shard DeepSpeed "
                      f"MoE layers; use {arg('tp')} 1 with {arg('ep')}, or {arg('framework')} megatron-deepspeed"),
    Rule("deepspeed", lambda c, x: c.sequence_parallel == True,  # noqa: E712 (elementwise on columns)
         lambda c, x: "framework deepspeed has no Megatron-style sequence parallelism; drop "
                      f"{arg('sequence_parallel')} or use {arg('framework')} megatron"),
    _interleave_rule("deepspeed"),
    # "op" is torchtitan's per-op selective activation checkpointing (torch.utils.checkpoint's
    # selective policies); the other runtimes checkpoint whole layers or Megatron's attention core.
    Rule(None, lambda c, x: (c.recompute == "op") & (c.framework != "torchtitan"),
         lambda c, x: f"{arg('recompute')} op is torchtitan's per-op selective activation checkpointing; framework "
                      f"{c.framework} has none: use {arg('recompute')} full or none"
                      + (" (or selective, Megatron's attention-core recompute)" if c.framework == "megatron" else "")),
    # Megatron-Core's --recompute-modules; Megatron-DeepSpeed's selective recompute is the attention core only.
    Rule("megatron-deepspeed", lambda c, x: x.modules != ("core_attn",) and c.recompute == "selective",
         lambda c, x: f"framework megatron-deepspeed's selective recompute is the attention core only (which frees "
                      f"nothing under FlashAttention), not {arg('recompute_modules')} {','.join(x.modules)}: use "
                      f"{arg('recompute')} full or none, or {arg('framework')} megatron"),
    Rule("deepspeed", lambda c, x: c.recompute == "selective",
         lambda c, x: f"framework deepspeed checkpoints whole layers only; use {arg('recompute')} full/none or "
                      f"{arg('framework')} megatron for selective recompute"),
    Rule("megatron-deepspeed", lambda c, x: (c.pp > 1) & (c.zero_stage > 1),
         lambda c, x: f"framework megatron-deepspeed: 3D parallelism ({arg('pp')} {c.pp}) runs with ZeRO <= 1, not "
                      f"ZeRO-{c.zero_stage}; use {arg('zero')} 1"),
    _moe_zero3_rule("megatron-deepspeed"),
    Rule("megatron-deepspeed", lambda c, x: (c.tp > 1) & (c.zero_stage > 2),
         lambda c, x: "framework megatron-deepspeed: ZeRO-3 does not combine with tensor parallelism "
                      f"({arg('tp')} {c.tp}); use {arg('zero')} 1/2"),
    _interleave_rule("megatron-deepspeed"),
    Rule("megatron", lambda c, x: c.zero_stage == 2,
         lambda c, x: f"framework megatron shards optimizer states (the distributed optimizer, {arg('zero')} 1) or "
                      f"everything (Megatron-FSDP, {arg('zero')} 3), not ZeRO-2; use {arg('zero')} 1 or 3"),
    # Megatron-FSDP: its optimizer is the distributed optimizer on sharded main weights (no
    # HybridDeviceOptimizer path); NVIDIA's FSDP recipes run without a pipeline, and dsplan
    # prices per-block gathers against one rank's whole model (step_time.dp_exposed).
    Rule("megatron", lambda c, x: (c.zero_stage == 3) & (c.offload != "none"),
         lambda c, x: f"framework megatron: Megatron-FSDP ({arg('zero')} 3) keeps its sharded optimizer on the GPU; "
                      f"use {arg('offload')} none, or {arg('zero')} 1 for Megatron-Core's optimizer CPU offload"),
    Rule("megatron", lambda c, x: (c.zero_stage == 3) & (c.pp > 1),
         lambda c, x: f"framework megatron: dsplan plans Megatron-FSDP ({arg('zero')} 3) without a pipeline, as "
                      f"NVIDIA's FSDP recipes run; use {arg('pp')} 1 or {arg('zero')} 1"),
    Rule("megatron", lambda c, x: x.precision != "bf16" and c.offload == "optimizer",
         lambda c, x: f"framework megatron: optimizer CPU offload (Megatron-Core's HybridDeviceOptimizer) is built "
                      f"for bf16 training, not {x.precision}; use {arg('precision')} bf16, {arg('offload')} none or "
                      f"{arg('framework')} deepspeed"),
    Rule("megatron", lambda c, x: x.is_vlm
         and (c.virtual_stages > 1) & (x.decoder_layers % (c.pp * c.virtual_stages) != 0),
         lambda c, x: f"framework megatron: interleaving a vision-language model needs its {x.decoder_layers} decoder "
                      f"layers divisible by {arg('pp')} {c.pp} x {arg('virtual_stages')} {c.virtual_stages} "
                      "(Megatron's custom pipeline layout has no vision-encoder layers)"),
    Rule("megatron", lambda c, x: (c.virtual_stages > 1) & (c.grad_accum < c.pp),
         lambda c, x: f"framework megatron: the interleaved schedule needs at least {arg('pp')} {c.pp} micro-batches "
                      f"per step, not {c.grad_accum}; use a smaller {arg('micro_batch')} or {arg('dp')}, a larger "
                      f"{arg('global_batch')}, or {arg('virtual_stages')} 1"),
    # Context parallelism off Megatron-Core is DeepSpeed Ulysses (an all-to-all over heads,
    # deepspeed.sequence.layer.DistributedAttention), with ZeRO data parallelism; Megatron-DeepSpeed
    # wires it as --ds-sequence-parallel-size, its Ulysses examples without a pipeline.
    Rule(None, lambda c, x: (c.cp > 1) & (c.framework != "megatron") & (c.framework != "torchtitan")
         & (c.cp_comm != "a2a"),
         lambda c, x: f"framework {c.framework}: its context parallelism is DeepSpeed Ulysses (an all-to-all "
                      f"over heads); use {arg('cp_comm')} a2a or {arg('framework')} megatron for {c.cp_comm}"),
    Rule(None, lambda c, x: (c.cp > 1) & (c.framework != "megatron") & (c.framework != "torchtitan")
         & ((c.pp > 1) | ((c.tp > 1) & (c.framework == "deepspeed"))),
         lambda c, x: f"framework {c.framework}: dsplan plans Ulysses sequence parallelism ({arg('cp')} {c.cp}) "
                      f"without a pipeline{' or AutoTP' if c.framework == 'deepspeed' else ''}; use {arg('pp')} 1"
                      f"{' ' + arg('tp') + ' 1' if c.framework == 'deepspeed' else ''} or {arg('framework')} megatron"),
    # torchtitan's own limits, each a (broken, message) pair (planner/cost/torchtitan.py).
    *(Rule("torchtitan", broken, message) for broken, message in TORCHTITAN_RULES),
    # Megatron-Core asserts "Bias in Moe is only supported when ETP==1" (transformer_config.py).
    Rule("megatron", lambda c, x: x.expert_bias and c.etp > 1,
         lambda c, x: f"framework megatron: this model's experts have biases, which Megatron-Core runs only "
                      f"without expert tensor parallelism; use {arg('etp')} 1 or {arg('tp')} 1"),
    # Experts folded out of TP (MoE parallel folding): Megatron-Core's --expert-tensor-parallel-size
    # and torchtitan's expert_tensor_parallel_degree; DeepSpeed's MoE layers keep the TP ranks.
    Rule(None, lambda c, x: (c.etp < c.tp) & (c.framework != EXPERT_TP_RUNTIMES[0])
         & (c.framework != EXPERT_TP_RUNTIMES[1]),
         lambda c, x: f"framework {c.framework}: its MoE layers have no expert tensor parallelism of their own "
                      f"({arg('etp')} {c.etp} under {arg('tp')} {c.tp}); use {arg('etp')} {c.tp}, or "
                      f"{arg('framework')} megatron or torchtitan"),
    # Megatron-Core's MoE layer raises in training under TP without sequence parallelism
    # (transformer/moe/moe_layer.py, 0.19.2): its dispatch routes each TP rank's own tokens.
    Rule("megatron", lambda c, x: x.is_moe and (c.tp > 1) & (c.sequence_parallel == False),  # noqa: E712
         lambda c, x: f"framework megatron: its MoE layers under tensor parallelism ({arg('tp')} {c.tp}) need "
                      f"sequence parallelism (Megatron-Core raises without it); add {arg('sequence_parallel')}"),
    # Transformer Engine runs sliding-window attention under context parallelism only with the
    # all-to-all exchange (its assertion: cp_comm_type a2a or all_gather).
    Rule("megatron", lambda c, x: x.window and (c.cp > 1) & (c.cp_comm != "a2a"),
         lambda c, x: f"framework megatron: this model's sliding-window attention runs under context parallelism "
                      f"only with the all-to-all exchange (Transformer Engine); use {arg('cp_comm')} a2a or "
                      f"{arg('cp')} 1"),
    # Multi-token prediction: Megatron-Core's --mtp-num-layers. Megatron-DeepSpeed, DeepSpeed's
    # engine over the reference trainer and torchtitan 0.2.2's deepseek_v3 (its 671B flavor is the
    # main model) build no MTP module.
    Rule(None, lambda c, x: x.mtp and c.framework != "megatron",
         lambda c, x: f"framework {c.framework} has no multi-token-prediction module (the model trains with "
                      f"one); use {arg('framework')} megatron, or {arg('mtp_layers')} 0 to plan the main model only"),
    # Activation offload is Megatron-Core's --cpu-offloading-num-layers through Transformer Engine's
    # offload context (activation_offload.py); its TransformerConfig refuses it under a pipeline and
    # with recomputation, and for as many layers as the model has.
    Rule(None, lambda c, x: (c.activation_offload > 0) & (c.framework != "megatron"),
         lambda c, x: f"{arg('activation_offload')} is Megatron-Core's activation CPU offloading (Transformer "
                      f"Engine's offload context); framework {c.framework} has none: use {arg('framework')} megatron "
                      f"or {arg('activation_offload')} 0"),
    Rule("megatron", lambda c, x: (c.activation_offload > 0) & (c.pp > 1),
         lambda c, x: f"framework megatron offloads activations only without pipeline parallelism (Megatron-Core "
                      f"refuses {arg('pp')} {c.pp} with CPU offloading); use {arg('pp')} 1 or "
                      f"{arg('activation_offload')} 0"),
    Rule("megatron", lambda c, x: (c.activation_offload > 0) & (c.recompute != "none"),
         lambda c, x: f"framework megatron does not offload activations while recomputing them (Megatron-Core "
                      f"refuses CPU offloading with {arg('recompute')} {c.recompute}); use {arg('recompute')} none or "
                      f"{arg('activation_offload')} 0"),
    Rule("megatron", lambda c, x: (c.activation_offload >= x.decoder_layers) & (c.activation_offload > 0),
         lambda c, x: f"{arg('activation_offload')} {c.activation_offload}: Megatron-Core offloads fewer layers than "
                      f"the model's {x.decoder_layers} decoder layers; use at most {x.decoder_layers - 1}"),
    # Megatron-Core's combined 1F1B runs two micro-batches' layers interleaved, which TE's
    # layer-ordered offload schedule does not follow: dsplan prices offload on the plain schedule.
    Rule("megatron", lambda c, x: x.ep_overlap and (c.activation_offload > 0) & (c.ep > 1),
         lambda c, x: f"{arg('activation_offload')} with the expert all-to-all overlap (two micro-batches "
                      f"interleaved layer by layer) is not priced; use {arg('no_ep_comm_overlap')} or "
                      f"{arg('activation_offload')} 0"),
    # The flex dispatcher is Megatron-Core's (--moe-token-dispatcher-type flex over DeepEP or
    # HybridEP, moe_dispatch.py); its DeepEP path asserts "DeepEP dispatcher requires TPxEP > 1"
    # (token_dispatcher.py, MoEFlexTokenDispatcher: the experts' TP x EP).
    Rule(None, lambda c, x: x.is_moe and x.dispatcher != "alltoall" and c.framework != "megatron",
         lambda c, x: f"{arg('moe_dispatcher')} {x.dispatcher} is Megatron-Core's (--moe-token-dispatcher-type "
                      f"{x.dispatcher}); framework {c.framework} runs its own all-to-all: use "
                      f"{arg('framework')} megatron or {arg('moe_dispatcher')} alltoall"),
    Rule("megatron", lambda c, x: x.is_moe and x.dispatcher == "flex" and (c.ep * c.etp < 2),
         lambda c, x: f"{arg('moe_dispatcher')} flex dispatches between expert-parallel or expert-TP ranks, and this "
                      f"plan has one ({arg('ep')} {c.ep}, {arg('etp')} {c.etp}); use {arg('ep')} 2 or more, or "
                      f"{arg('moe_dispatcher')} alltoall"),
    Rule(None, lambda c, x: not x.is_moe and c.ep > 1,
         lambda c, x: f"{arg('ep')} {c.ep} needs a mixture-of-experts model; this model is dense (use {arg('ep')} 1)"),
)

# The runtimes some rule is particular to (first_broken).
_RULE_FRAMEWORKS = tuple(dict.fromkeys(r.framework for r in RULES if r.framework is not None))


@dataclass(frozen=True, slots=True, eq=False)
class Coded:
    """A column of strings held as indices into ``names``. It compares to a name as numpy compares
    its codes to the name's index, so the rules, written for strings (``c.offload != "none"``),
    run on ints: numpy compares a string column character by character (~8x slower here)."""

    codes: np.ndarray
    names: tuple[str, ...]

    def _code(self, name: object) -> int:
        return self.names.index(name) if name in self.names else -1  # -1: no code, equal to nothing

    def __eq__(self, name: object) -> np.ndarray:  # type: ignore[override]
        return self.codes == self._code(name)

    def __ne__(self, name: object) -> np.ndarray:  # type: ignore[override]
        return self.codes != self._code(name)


@dataclass(slots=True)
class ConfigColumns:
    """ParallelConfig's fields as equal-length arrays (strings as numpy string arrays or as
    ``Coded``): many configs for ``first_broken``."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    ep: np.ndarray
    zero_stage: np.ndarray
    offload: np.ndarray | Coded
    micro_batch: np.ndarray
    grad_accum: np.ndarray
    recompute: np.ndarray | Coded
    sequence_parallel: np.ndarray
    virtual_stages: np.ndarray
    framework: np.ndarray | Coded
    cp: np.ndarray | int = 1
    cp_comm: np.ndarray | Coded | str = "p2p"
    dp_replicate: np.ndarray | int = 1
    etp: np.ndarray | int | None = None  # None: tp
    activation_offload: np.ndarray | int = 0

    def __post_init__(self) -> None:
        if self.etp is None:
            self.etp = self.tp


def check_framework(cfg: ParallelConfig, *, is_moe: bool, decoder_layers: int, is_vlm: bool, optimizer: str,
                    precision: str, mla: bool = False, positions: str = "rope", model: str = "",
                    precision_aware_optimizer: bool = False, expert_bias: bool = False,
                    window: bool = False, zero_pp: tuple[str, ...] = (), mtp: bool = False,
                    ep_overlap: bool = False, dispatcher: str = "alltoall",
                    modules: tuple[str, ...] = ("core_attn",), pp_schedule: str = "1f1b",
                    compiled: tuple[str, ...] = COMPILE_COMPONENTS) -> None:
    """Raise UserError naming the first rule of ``cfg.framework`` that ``cfg`` breaks.

    ``optimizer`` and ``precision`` are the workload's: what the CPU optimizers can step.
    ``precision`` is what ``--precision`` names: a working precision or a TE recipe."""
    work, recipe = split_precision(precision)
    facts = RunFacts(is_moe, decoder_layers, is_vlm, optimizer, work, mla, positions, recipe, model,
                     precision_aware_optimizer, expert_bias, window, zero_pp, mtp, ep_overlap, dispatcher, modules,
                     pp_schedule, compiled)
    for rule in RULES:
        if (rule.framework is None or rule.framework == cfg.framework) and rule.broken(cfg, facts):
            raise UserError(rule.message(cfg, facts))


def first_broken(cols: ConfigColumns, facts: RunFacts) -> np.ndarray:
    """Per config of many, the index in ``RULES`` of the rule ``check_framework`` would name
    (the first broken one), or -1 when the runtime runs it: the search's filter, one numpy
    pass per rule rather than one call per config, and the tally behind "most often"."""
    out = np.full(len(cols.tp), -1, dtype=np.int64)
    # Which configs run on each runtime, compared once per runtime, not once per rule: numpy
    # compares string columns character by character.
    runs_on = {f: cols.framework == f for f in _RULE_FRAMEWORKS}
    for k in range(len(RULES) - 1, -1, -1):  # backwards, so the first broken rule writes last
        rule = RULES[k]
        hit = rule.broken(cols, facts)
        if hit is False:  # ruled out by the facts alone (Rule)
            continue
        hit = np.asarray(hit, dtype=bool)
        if rule.framework is not None:
            hit = hit & runs_on[rule.framework]
        out[hit] = k
    return out


def check_framework_for(cfg: ParallelConfig, model: "ModelSpec", *, optimizer: str, precision: str,
                        precision_aware_optimizer: bool = False, zero_pp: tuple[str, ...] = (),
                        ep_overlap: bool = False, dispatcher: str = "alltoall",
                        modules: tuple[str, ...] = ("core_attn",), pp_schedule: str = "1f1b",
                        compiled: tuple[str, ...] = COMPILE_COMPONENTS) -> None:
    """``check_framework`` with the facts of ``model`` its rules read (the one place that
    picks them; the search passes them hoisted, since it asks thousands of times)."""
    check_framework(cfg, **model_facts(model), optimizer=optimizer, precision=precision,
                    precision_aware_optimizer=precision_aware_optimizer, zero_pp=zero_pp, ep_overlap=ep_overlap,
                    dispatcher=dispatcher, modules=modules, pp_schedule=pp_schedule, compiled=compiled)


def model_facts(model: "ModelSpec") -> dict[str, Any]:
    """The facts of ``model`` the rules read, as RunFacts / check_framework keywords."""
    return {"is_moe": model.is_moe, "decoder_layers": model.num_layers, "is_vlm": model.is_vlm,
            "mla": model.decoder_blocks[0].attention.kind == "mla",
            "positions": model.positions.kind if model.positions else "rope", "model": model.name,
            "expert_bias": any(isinstance(b.mlp, MoEMLP) and b.mlp.expert_bias for b in model.decoder_blocks),
            "window": any(b.attention.window is not None for b in model.decoder_blocks), "mtp": model.mtp_layers > 0}
