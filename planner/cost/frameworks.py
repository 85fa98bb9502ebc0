"""The runtime a plan targets, and what that runtime can and cannot do.

Three runtimes, each with its own limits (checked here, one UserError naming the broken rule)
and its own behaviour the cost model reads (``Traits``):

- ``deepspeed``: ZeRO 0-3 and offload; AutoTP tensor parallelism only with ZeRO <= 2, on a
  dense model without a pipeline; ``PipelineModule`` pipelines, which DeepSpeed rejects with ZeRO-2/3
  (the pipeline engine asserts ``zero_stage < 2``); MoE with ``ep_size``; no sequence parallelism, no interleaved
  schedule, and per-layer (full) activation checkpointing only. Its PipelineEngine runs 1F1B's
  order but reduces gradients only after the drain and sends point-to-point one tensor at a
  time (``Traits.pipe_engine``); ZeRO-1/2 all-reduce gradients (``Traits.zero_grad_allreduce``).
- ``megatron-deepspeed``: Megatron's 3D parallelism on the DeepSpeed engine: ZeRO-1 with a
  pipeline (ZeRO-2/3 only without one), sequence parallelism, MoE, selective recompute; no
  interleaving, no multi-latent attention. ALiBi models (BLOOM) run on BigScience's fork of it.
- ``megatron`` (Megatron-LM / Megatron-Core): 3D parallelism, sequence parallelism, the
  interleaved 1F1B schedule, MLA, the distributed optimizer (``zero_stage=1`` here: optimizer
  states sharded over DP, ~ZeRO-1), Megatron-FSDP (``zero_stage=3``: ``--use-megatron-fsdp``
  with ``--data-parallel-sharding-strategy optim_grads_params``, weights, gradients and
  optimizer sharded over DP x CP), expert parallelism, selective recompute; no ZeRO-2.
  Optimizer CPU offload (``--optimizer-cpu-offload``: Megatron-Core's HybridDeviceOptimizer
  running torch's fused AdamW on the host) needs ``--use-precision-aware-optimizer``, which
  needs the distributed optimizer and Adam (megatron/core/optimizer/optimizer_config.py),
  and is built for bf16 training; there is no parameter offload. Any split of the decoder
  layers over pp x v chunks, interleaved or not, runs through
  ``--pipeline-model-parallel-layout`` (Megatron-Core's custom pipeline layout,
  docs/source/api-guide/pipeline_parallel_layout.md), so 126 Llama-3.1-405B layers interleave
  on 16 ranks; the layout has no vision-encoder layers, so a vision-language model keeps
  Megatron's even split and interleaves only when its layers divide by pp x v. The
  interleaved schedule needs at least pp micro-batches per step; a count that pp does not
  divide runs with a larger micro-batch group (memory.microbatch_group).
- ``torchtitan`` (PyTorch FSDP2 + TP + PP + CP, torchtitan 0.2.2): ``--zero 3`` is FSDP2
  (``fully_shard`` with bf16 parameters and fp32 reduction), ``--zero 0`` plain DDP on a
  data-parallel-only run; TP always with sequence parallelism (its TP plan shards norms and
  residuals), 1F1B and interleaved 1F1B pipelines, ring-attention context parallelism, expert
  parallelism over the FSDP ranks, torchao FP8 (tensorwise) and MXFP8. It builds only the models
  it has flavors for (planner/cost/torchtitan.py) and is searched only when asked for.

Batch divisibility (global batch = micro-batch x gradient accumulation x dp) is checked where
the accumulation is filled in: planner/cost/degrees.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from planner.cost.parallel import ParallelConfig
from planner.cost.precision import split_precision
from planner.cost.torchtitan import RULES as TORCHTITAN_RULES
from planner.errors import UserError, arg

if TYPE_CHECKING:
    from planner.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Traits:
    """Behaviour of a runtime that changes memory or time."""

    name: str
    # Gradients in fp32 (Megatron's main_grad buffer, reduced in fp32 for bf16) instead of the
    # working precision with an fp32 partition (DeepSpeed's ZeRO optimizers).
    fp32_grad_buffer: bool
    # What crosses a pipeline-stage boundary, per micro-batch:
    # - "full": the whole activation (DeepSpeed's PipelineModule with no model-parallel axis);
    # - "sequence_parallel": Megatron-Core sends (s/t, b, h) under sequence parallelism and the
    #   whole (s, b, h) otherwise (pipeline_parallel/schedules.py get_tensor_shapes; its
    #   p2p_communication has no scatter-gather any more);
    # - "partitioned": DeepSpeed's PipelineEngine over a tensor-parallel grid (Megatron-DeepSpeed)
    #   sends 1/t of activations and gradients and all-gathers them over the TP group: the
    #   receiver its input, the sender its output again before backward, and the sender the
    #   returning gradient (runtime/pipe/engine.py, pipe_partitioned / grad_partitioned).
    pp_send: str
    # Gradient reduction bucketed and started during the last micro-batch's backward
    # (DeepSpeed overlap_comm, Megatron-Core --overlap-grad-reduce, which dsplan's emitted
    # configs switch on).
    overlap_grad_reduce: bool
    # DeepSpeed ZeRO-1/2 bucket buffers (overlap_comm keeps ~4.5x the bucket sizes).
    zero_buckets: bool
    # Pipelines (pp > 1) run on DeepSpeed's PipelineEngine, which differs from Megatron's 1F1B in:
    # - no gradient reduction during backward: the engine turns its backward all-reduce off
    #   (runtime/pipe/engine.py:80, ``enable_backward_allreduce = False``) and
    #   ``deepspeed.initialize`` switches ZeRO's overlap_comm off for a PipelineModule
    #   (runtime/engine.py:2663-2666); TrainSchedule issues ReduceTiedGrads, ReduceGrads and
    #   OptimizerStep after a rank's last step (runtime/pipe/schedule.py:238-241), so a rank's
    #   reduction overlaps only the cool-down of the ranks before it;
    # - ReduceTiedGrads all-reduces the tied embedding's gradient between the ranks holding its
    #   two copies first (pipe/engine.py:269-285), so those ranks start their reduction only
    #   after rank 0's last backward;
    # - point-to-point transfers are separate blocking ``dist.send``/``dist.recv`` calls
    #   (runtime/pipe/p2p.py:48-81), issued one after the other (schedule.py:214-223: a
    #   forward step sends the last gradient, then receives the activation; a backward step
    #   receives the gradient, then sends the activation): two transfers per neighbour and
    #   micro-batch where Megatron's batched send_forward_recv_backward makes one; a
    #   partitioned tensor also sends its partition meta tensor before the data
    #   (engine.py:1043-1046, 1097-1100).
    pipe_engine: bool = False
    # ZeRO-1/2 reduce gradients with bucketed all-reduces, not reduce-scatters: DeepSpeed's
    # ``use_multi_rank_bucket_allreduce`` defaults to true (runtime/zero/config.py:119), which
    # sends every slice of a bucket through ``allreduce_and_scatter`` (zero/stage_1_and_2.py:1695)
    # and keeps the local partition.
    zero_grad_allreduce: bool = False
    # ZeRO-2 (partitioned gradients) reduces every micro-batch's gradients in that micro-batch's
    # backward, not once per step: the full-size gradients are not kept between micro-batches
    # (zero/stage_1_and_2.py:2293-2294, reduce_ready_partitions_and_remove_grads reduces when
    # partition_gradients or at the accumulation boundary; ZeRO-1 only at the boundary).
    zero2_reduces_every_microbatch: bool = False
    # Tensor-parallel collectives overlapped with the GEMMs beside them: Transformer Engine's
    # userbuffers (Megatron-Core ``--tp-comm-overlap``, which needs sequence parallelism and a TP
    # group inside one NVLink domain) split each all-gather / reduce-scatter into tp chunks and
    # pipeline them with the QKV, projection and MLP GEMMs, forward and backward. What stays
    # exposed per block: max(TP seconds - its GEMM seconds, one chunk = TP seconds / tp)
    # (block_times.overlapped_tp).
    tp_comm_overlap: bool = False
    # Attention through Transformer Engine (Megatron-Core's default TE layers: cuDNN's fused
    # attention), written for Hopper and Blackwell, so it levels off at the GPU's MAMF; the
    # others run FlashAttention-2 (flash-attn, PyTorch SDPA), which on Hopper levels off at
    # gpu.flash_attention_efficiency (efficiency.flash_efficiency).
    te_attention: bool = False
    # Blocks a ZeRO-3 / FSDP rank holds gathered whole: DeepSpeed's estimator counts the largest
    # layer once (estimate_zero3_model_states_mem_needs); Megatron-FSDP all-gathers the next FSDP
    # unit while one computes and reduce-scatters the last one's gradients while the next
    # back-propagates, so two units' weights and gradients are live (its double buffer).
    zero3_live_blocks: int = 1


TRAITS = {
    "deepspeed": Traits("deepspeed", False, "full", True, True, pipe_engine=True, zero_grad_allreduce=True,
                        zero2_reduces_every_microbatch=True),
    "megatron-deepspeed": Traits("megatron-deepspeed", False, "partitioned", True, True, pipe_engine=True,
                                 zero_grad_allreduce=True, zero2_reduces_every_microbatch=True),
    "megatron": Traits("megatron", True, "sequence_parallel", True, False, tp_comm_overlap=True, te_attention=True,
                       zero3_live_blocks=2),
    # FSDP2 reduce-scatters fp32 (training.mixed_precision_reduce) and gathers the next block while
    # one computes (two live); a stage sends (s/t, b, h); attention is SDPA, not TE; no async TP.
    "torchtitan": Traits("torchtitan", True, "sequence_parallel", True, False, zero3_live_blocks=2),
}

# DeepSpeed bucket sizes (elements) that dsplan plans with and that the emitted ds_config
# must use (planner/emit reads these): DeepSpeed's defaults are 5e8, which with overlap_comm
# costs 5e8 x 2 B x 2 x 4.5 = 9 GB (DeepSpeed docs, zero config "overlap_comm").
REDUCE_BUCKET_SIZE = int(2e8)
ALLGATHER_BUCKET_SIZE = int(2e8)
STAGE3_PREFETCH_BUCKET_SIZE = int(5e7)  # DeepSpeed default
STAGE3_MAX_LIVE_PARAMETERS = int(1e9)  # DeepSpeed default
OVERLAP_COMM_FACTOR = 4.5  # DeepSpeed docs: "overlap_comm uses 4.5x the allgather_bucket_size and reduce_bucket_size"


def traits(framework: str) -> Traits:
    return TRAITS[framework]


def grad_reduce_overlaps(t: Traits, pp: int) -> bool:
    """Whether gradient reduction starts during the last micro-batch's backward: where the
    runtime buckets it (Traits.overlap_grad_reduce), but not in DeepSpeed's PipelineEngine."""
    return t.overlap_grad_reduce and not (t.pipe_engine and pp > 1)


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


def check_framework(cfg: ParallelConfig, *, is_moe: bool, decoder_layers: int, is_vlm: bool, optimizer: str,
                    precision: str, mla: bool = False, positions: str = "rope", model: str = "") -> None:
    """Raise UserError naming the first rule of ``cfg.framework`` that ``cfg`` breaks.

    ``optimizer`` and ``precision`` are the workload's: what the CPU optimizers can step.
    ``precision`` is what ``--precision`` names: a working precision or a TE recipe."""
    work, recipe = split_precision(precision)
    facts = RunFacts(is_moe, decoder_layers, is_vlm, optimizer, work, mla, positions, recipe, model)
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


def check_framework_for(cfg: ParallelConfig, model: "ModelSpec", *, optimizer: str, precision: str) -> None:
    """``check_framework`` with the facts of ``model`` its rules read (the one place that
    picks them; the search passes them hoisted, since it asks thousands of times)."""
    check_framework(cfg, **model_facts(model), optimizer=optimizer, precision=precision)


def model_facts(model: "ModelSpec") -> dict[str, Any]:
    """The facts of ``model`` the rules read, as RunFacts / check_framework keywords."""
    return {"is_moe": model.is_moe, "decoder_layers": model.num_layers, "is_vlm": model.is_vlm,
            "mla": model.decoder_blocks[0].attention.kind == "mla",
            "positions": model.positions.kind if model.positions else "rope", "model": model.name}
