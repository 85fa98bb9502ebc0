"""What torchtitan (PyTorch's FSDP2 + TP + PP + CP training stack) can build: the facts the
framework rules (planner/cost/framework_rules.py) and the emitter (planner/emit/torchtitan_config.py)
both read. Sources are torchtitan 0.2.2's own files, named where each fact is used.

torchtitan builds its models from named train specs and flavors, not from a config.json, so a
plan runs on it only for a dsplan preset with the same architecture as one of its flavors.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from planner.cost import dualpipe
from planner.cost.eager_kernels import COMPILE_COMPONENTS, compiled_components
from planner.errors import arg

# dsplan preset -> (torchtitan train spec, flavor). torchtitan/models/__init__.py lists the
# specs; llama3/__init__.py has 8B, 70B, 405B (Llama 3 / 3.1: the same shapes, rope 500000);
# deepseek_v3/__init__.py has 16B (DeepSeek-V2-Lite's shapes: 27 layers, 64 experts, 2
# shared, no q-LoRA), 236B (DeepSeek-V2) and 671B (DeepSeek-V3, without its MTP module).
MODELS: dict[str, tuple[str, str]] = {
    "llama-3-8b": ("llama3", "8B"),
    "llama-3.1-8b": ("llama3", "8B"),
    "llama-3-70b": ("llama3", "70B"),
    "llama-3.1-70b": ("llama3", "70B"),
    "llama-3.1-405b": ("llama3", "405B"),
    "deepseek-v2-lite": ("deepseek_v3", "16B"),
    "deepseek-v2": ("deepseek_v3", "236B"),
    "deepseek-v3": ("deepseek_v3", "671B"),
}

# dsplan recipe -> the torchao converter torchtitan applies (model.converters; its settings
# under quantize.linear.*, torchtitan/components/quantization/{float8,mx}.py). Float8Linear's
# recipes are tensorwise, rowwise and rowwise_with_gw_hp: no delayed scaling and no 128x128
# blockwise weights; MXLinear's mxfp8_cublas needs Blackwell (checked with the GPU's peaks);
# 0.2.2 has no NVFP4 training converter.
RECIPES: dict[str, str] = {
    "fp8-tensorwise": "quantize.linear.float8",
    "mxfp8": "quantize.linear.mx",
}

# The pipeline schedules dsplan prices, by virtual stages per rank: torchtitan's
# parallelism.pipeline_parallel_schedule names PyTorch's schedule classes
# (torch/distributed/pipelining/schedules.py get_schedule_class).
SCHEDULE_1F1B = "1F1B"
SCHEDULE_INTERLEAVED = "Interleaved1F1B"


def schedule(virtual_stages: int, pp_schedule: str = "1f1b") -> str:
    """One contiguous chunk per rank runs 1F1B; more run interleaved 1F1B (looped stages:
    chunk k on rank k mod pp, torchtitan distributed/pipeline_parallel.py _get_stage_indices);
    DualPipeV places its two chunks per rank in a V (style "v" there; dualpipe.py)."""
    if pp_schedule == "dualpipev":
        return dualpipe.TORCH_NAME
    return SCHEDULE_INTERLEAVED if virtual_stages > 1 else SCHEDULE_1F1B


def models_text() -> str:
    """The presets torchtitan runs, for messages."""
    return ", ".join(MODELS)


_FW = "framework torchtitan"


def _no_fsdp(c: Any) -> Any:
    """No FSDP2 group: ``--zero 0``, or a DP x CP group of one (ParallelDims.fsdp_enabled is
    dp_shard > 1 or cp > 1)."""
    return (c.zero_stage == 0) | (c.dp * c.cp == 1)


# What torchtitan cannot run, as framework_rules.Rule's (broken, message) pairs, in the order they are
# checked. ``c`` is a ParallelConfig or ConfigColumns, ``x`` the RunFacts; a condition on the facts
# alone comes first, joined with ``and`` (framework_rules.Rule).
RULES: tuple[tuple[Callable[[Any, Any], Any], Callable[[Any, Any], str]], ...] = (
    (lambda c, x: x.model not in MODELS and c.tp > 0,
     lambda c, x: f"{_FW} has no implementation of {x.model or 'this model'} (it builds its own flavors: "
                  f"{models_text()}); use {arg('framework')} megatron or deepspeed"),
    # training.mixed_precision_param takes bfloat16 or float32 (config/job_config.py).
    (lambda c, x: x.precision == "fp16" and c.tp > 0,
     lambda c, x: f"{_FW} trains in bf16 or fp32 (training.mixed_precision_param), not fp16; use "
                  f"{arg('precision')} bf16"),
    (lambda c, x: x.recipe is not None and x.recipe not in RECIPES and c.tp > 0,
     lambda c, x: f"{_FW} runs low precision through torchao: {' and '.join(RECIPES)} (Float8Linear tensorwise, "
                  f"MXLinear), not {x.recipe}; use {arg('precision')} {' or '.join(RECIPES)}, or "
                  f"{arg('framework')} megatron"),
    # quantize.grouped_mm.* (the experts' grouped GEMMs) is a prototype needing torchao nightly
    # (config/job_config.py Float8GroupedMM, MXGroupedMM), so dsplan plans no recipe for MoE on it.
    (lambda c, x: x.is_moe and x.recipe is not None and c.tp > 0,
     lambda c, x: f"{_FW}: low precision for the experts' grouped GEMMs is a torchao-nightly prototype that "
                  f"dsplan does not plan; use {arg('precision')} bf16 or {arg('framework')} megatron"),
    # components/quantization/mx.py asserts "TP not yet supported with torch.compile for mxfp8", and
    # uncompiled blocks' casts are not priced (below).
    (lambda c, x: x.recipe == "mxfp8" and c.tp > 1,
     lambda c, x: f"{_FW}: MXFP8 (torchao MXLinear) does not run with tensor parallelism under torch.compile "
                  f"(components/quantization/mx.py); use {arg('tp')} 1, or {arg('precision')} fp8-tensorwise"),
    # torchao's float8 / MX casts (amax, scale, clamp, cast; each layout of each linear's input and
    # gradient) run as eager kernels where the blocks are not compiled, which eager_kernels.py does
    # not count: refused rather than priced as the compiled casts.
    (lambda c, x: x.recipe is not None and "model" not in compiled_components(x.compiled, x.pp_schedule == "dualpipev")
     and c.tp > 0,
     lambda c, x: f"{_FW}: torchao's {x.recipe} casts run eager in blocks torch.compile leaves out ("
                  + ("DualPipeV's stages" if x.pp_schedule == "dualpipev" else f"{arg('compile')} without model")
                  + f"), which dsplan does not price; use {arg('precision')} bf16"
                  + ("" if x.pp_schedule == "dualpipev" else f", or compile the model ({arg('compile')} model,loss)")),
    # components/optimizer.py build_optimizers: {"Adam", "AdamW"}.
    (lambda c, x: x.optimizer == "sgd" and c.tp > 0,
     lambda c, x: f"{_FW} builds Adam or AdamW only (optimizer.name); use {arg('optimizer')} adamw or adam"),
    (lambda c, x: (c.zero_stage == 1) | (c.zero_stage == 2),
     lambda c, x: f"{_FW} has DDP ({arg('zero')} 0) and FSDP2 ({arg('zero')} 3), no ZeRO-{c.zero_stage}; use "
                  f"{arg('zero')} 3 or {arg('framework')} deepspeed"),
    # FSDP2's CPUOffloadPolicy (training.enable_cpu_offload; parallelize.py apply_fsdp) moves the
    # sharded parameters and gradients to the host and steps the optimizer there: all or nothing.
    (lambda c, x: c.offload == "optimizer",
     lambda c, x: f"{_FW} offloads through FSDP2's CPUOffloadPolicy, which moves parameters, gradients and the "
                  f"optimizer step to the host together; use {arg('offload')} optimizer+params or none"),
    # parallelize.py: without FSDP, DDP "has not supported > 1D parallelism", and
    # distributed/utils.py maybe_enable_amp turns mixed precision off for TP or PP.
    (lambda c, x: _no_fsdp(c) & ((c.tp > 1) | (c.pp > 1)),
     lambda c, x: f"{_FW} runs TP or PP in mixed precision only under FSDP2 over more than one rank "
                  f"(without it, DDP takes no second dimension and TP/PP train in fp32); use {arg('zero')} 3 "
                  f"with {arg('dp')} x {arg('cp')} > 1"),
    # ParallelDims: the fsdp mesh is dp_shard x cp, and expert parallelism borrows from it.
    (lambda c, x: (c.zero_stage == 0) & ((c.cp > 1) | (c.ep > 1)),
     lambda c, x: f"{_FW} shards over its context- and expert-parallel ranks with FSDP2 (ParallelDims folds cp "
                  f"into the fsdp mesh, ep borrows from it); use {arg('zero')} 3"),
    # activation_checkpoint.mode selective is per-op or every-n-layers SAC, not Megatron's
    # recomputation of the attention core, so dsplan prices no torchtitan "selective".
    (lambda c, x: c.recompute == "selective",
     lambda c, x: f"{_FW}'s selective activation checkpointing is per-op (or every-n-layer) SAC, not "
                  f"Megatron's selective recompute; use {arg('recompute')} op (its per-op policy), full or none"),
    # Per-op SAC is priced for dense GQA / MHA blocks (transformer_layers.op_sac): which of a
    # deepseek_v3 block's matmuls it keeps (MLA's projections, the router, grouped experts that
    # are no aten.mm) is not.
    (lambda c, x: (x.is_moe or x.mla) and c.recompute == "op",
     lambda c, x: f"{_FW}'s per-op SAC ({arg('recompute')} op) is priced for the dense Llama 3 flavors; use "
                  f"{arg('recompute')} full or none for this model"),
    (lambda c, x: (c.tp > 1) & (c.sequence_parallel == False),  # noqa: E712 (elementwise on columns)
     lambda c, x: f"{_FW}'s tensor-parallel plan always shards norms and residuals over the sequence "
                  f"(SequenceParallel); add {arg('sequence_parallel')}"),
    # PyTorch's context_parallel rotates K/V chunks around the CP ring (the alltoall rotater
    # passes them to the next rank; parallelism.context_parallel_rotate_method): no head all-to-all.
    (lambda c, x: (c.cp > 1) & (c.cp_comm != "p2p"),
     lambda c, x: f"{_FW}'s context parallelism is PyTorch's ring attention (K/V passed around the ring), "
                  f"not {c.cp_comm}; use {arg('cp_comm')} p2p"),
    # ScheduleDualPipeV: "ZBV requires exactly 2 stages per rank", and at least as many
    # micro-batches as stages (torch/distributed/pipelining/schedules.py; dualpipe.py).
    (lambda c, x: x.pp_schedule == "dualpipev" and (c.pp > 1) & (c.virtual_stages != 2),
     lambda c, x: f"{_FW}: DualPipeV runs two model chunks per pipeline rank (a V); use {arg('virtual_stages')} 2"),
    (lambda c, x: x.pp_schedule == "dualpipev" and (c.pp > 1) & (c.grad_accum < 2 * c.pp),
     lambda c, x: f"{_FW}: DualPipeV needs at least 2 x {arg('pp')} = {2 * c.pp} micro-batches per step (one per "
                  f"stage), not {c.grad_accum}; raise {arg('global_batch')} or lower {arg('micro_batch')}, "
                  f"{arg('dp')} or {arg('pp')}"),
    # ScheduleInterleaved1F1B: rounds = max(1, n // pp), and n must be a multiple of the rounds.
    (lambda c, x: x.pp_schedule != "dualpipev" and (c.virtual_stages > 1)
     & (c.grad_accum % np.maximum(1, c.grad_accum // c.pp) != 0),
     lambda c, x: f"{_FW}: PyTorch's interleaved 1F1B needs the {c.grad_accum} micro-batches per step to be a "
                  f"multiple of {max(1, c.grad_accum // c.pp)} (micro-batches // {arg('pp')}); change "
                  f"{arg('global_batch')} or {arg('micro_batch')}"),
)


# What only torchtitan runs, as (broken by the run's facts, message) for the other frameworks.
ONLY_HERE = (
    # DualPipeV is PyTorch's ScheduleDualPipeV; Megatron-LM and DeepSpeed have no DualPipe.
    (lambda x: x.pp_schedule == "dualpipev",
     lambda c, x: f"{arg('pp_schedule')} dualpipev is DeepSeek's DualPipeV, which torchtitan runs (PyTorch's "
                  f"ScheduleDualPipeV); framework {c.framework} has no DualPipe schedule: use {arg('framework')} "
                  f"torchtitan or {arg('pp_schedule')} 1f1b"),
    # torch.compile's components are torchtitan's (compile.components); Megatron-LM runs TE's fused
    # kernels and DeepSpeed the model it is given, which dsplan prices fused.
    (lambda x: x.compiled != COMPILE_COMPONENTS,
     lambda c, x: f"{arg('compile')} {','.join(x.compiled) or 'none'} chooses what torchtitan compiles; framework "
                  f"{c.framework} runs fused kernels: use {arg('framework')} torchtitan, or leave "
                  f"{arg('compile')} out"),
)
