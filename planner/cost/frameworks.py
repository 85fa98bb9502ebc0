"""The runtime a plan targets, and what that runtime can and cannot do.

Three runtimes, each with its own limits (checked here, one UserError naming the broken rule)
and its own behaviour the cost model reads (``Traits``):

- ``deepspeed``: ZeRO 0-3 and offload; AutoTP tensor parallelism only with ZeRO <= 2, on a
  dense model without a pipeline; ``PipelineModule`` pipelines, which DeepSpeed rejects with ZeRO-2/3 (the pipeline engine
  asserts ``zero_stage < 2``); MoE with ``ep_size``; no sequence parallelism, no interleaved
  schedule, and per-layer (full) activation checkpointing only.
- ``megatron-deepspeed``: Megatron's 3D parallelism on the DeepSpeed engine: ZeRO-1 with a
  pipeline (ZeRO-2/3 only without one), sequence parallelism, MoE, selective recompute; no
  interleaving.
- ``megatron`` (Megatron-LM / Megatron-Core): 3D parallelism, sequence parallelism, the
  interleaved 1F1B schedule, the distributed optimizer (``zero_stage=1`` here: optimizer
  states sharded over DP, ~ZeRO-1), expert parallelism, selective recompute; no ZeRO-2/3.
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

Batch divisibility uses the data-parallel world size: global batch = micro-batch x
gradient accumulation x dp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.cost.parallel import ParallelConfig
from planner.errors import UserError

if TYPE_CHECKING:
    from planner.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Traits:
    """Behaviour of a runtime that changes memory or time."""

    name: str
    # Gradients in fp32 (Megatron's main_grad buffer, reduced in fp32 for bf16) instead of the
    # working precision with an fp32 partition (DeepSpeed's ZeRO optimizers).
    fp32_grad_buffer: bool
    # Megatron sends 1/t of a stage boundary's activation and all-gathers it over NVLink
    # (scatter-gather of pipeline tensors); DeepSpeed's PipelineModule sends the whole tensor.
    pp_scatter_gather: bool
    # Gradient reduction bucketed and started during the last micro-batch's backward
    # (DeepSpeed overlap_comm, Megatron-Core --overlap-grad-reduce, which dsplan's emitted
    # configs switch on).
    overlap_grad_reduce: bool
    # DeepSpeed ZeRO-1/2 bucket buffers (overlap_comm keeps ~4.5x the bucket sizes).
    zero_buckets: bool


TRAITS = {
    "deepspeed": Traits("deepspeed", False, False, True, True),
    "megatron-deepspeed": Traits("megatron-deepspeed", False, True, True, True),
    "megatron": Traits("megatron", True, True, True, False),
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


def check_framework(cfg: ParallelConfig, *, is_moe: bool, decoder_layers: int, is_vlm: bool, optimizer: str,
                    precision: str) -> None:
    """Raise UserError naming the first rule of ``cfg.framework`` that ``cfg`` breaks.

    ``optimizer`` and ``precision`` are the workload's: what the CPU optimizers can step."""
    f = cfg.framework
    if cfg.offload != "none" and optimizer == "sgd":
        # DeepSpeed swaps in DeepSpeedCPUAdam (its offload optimizers are Adam, Adagrad and Lion);
        # Megatron-Core's offload rides on the precision-aware optimizer, which is Adam only.
        raise UserError(f"framework {f}: optimizer offload steps Adam on the CPU, not sgd; use --optimizer adamw/adam "
                        "or --offload none")
    if f == "deepspeed":
        if cfg.tp > 1 and cfg.zero_stage > 2:
            raise UserError(f"framework deepspeed: AutoTP tensor parallelism (--tp {cfg.tp}) works with ZeRO <= 2, not ZeRO-{cfg.zero_stage}; use --zero 1/2 or --tp 1")
        if cfg.pp > 1 and cfg.zero_stage > 1:
            raise UserError(f"framework deepspeed: PipelineModule (--pp {cfg.pp}) rejects ZeRO-{cfg.zero_stage} (pipeline parallelism supports ZeRO 0/1); use --zero 1 or --pp 1")
        # AutoTP shards a plain module tree by layer names; it has no pipeline-stage or expert
        # groups (DeepSpeed's AutoTP training tutorial: ZeRO 0-2, no PipelineModule, no MoE).
        if cfg.tp > 1 and cfg.pp > 1:
            raise UserError(f"framework deepspeed: AutoTP tensor parallelism (--tp {cfg.tp}) does not combine with PipelineModule (--pp {cfg.pp}); use --framework megatron-deepspeed for 3D parallelism")
        if cfg.tp > 1 and is_moe:
            raise UserError(f"framework deepspeed: AutoTP tensor parallelism (--tp {cfg.tp}) does not shard DeepSpeed MoE layers; use --tp 1 with --ep, or --framework megatron-deepspeed")
        if cfg.sequence_parallel:
            raise UserError("framework deepspeed has no Megatron-style sequence parallelism; drop --sequence-parallel or use --framework megatron")
        if cfg.virtual_stages > 1:
            raise UserError("framework deepspeed has no interleaved pipeline schedule; use --virtual-stages 1 or --framework megatron")
        if cfg.recompute == "selective":
            raise UserError("framework deepspeed checkpoints whole layers only; use --recompute full/none or --framework megatron for selective recompute")
    elif f == "megatron-deepspeed":
        if cfg.pp > 1 and cfg.zero_stage > 1:
            raise UserError(f"framework megatron-deepspeed: 3D parallelism (--pp {cfg.pp}) runs with ZeRO <= 1, not ZeRO-{cfg.zero_stage}; use --zero 1")
        if cfg.tp > 1 and cfg.zero_stage > 2:
            raise UserError(f"framework megatron-deepspeed: ZeRO-3 does not combine with tensor parallelism (--tp {cfg.tp}); use --zero 1/2")
        if cfg.virtual_stages > 1:
            raise UserError("framework megatron-deepspeed has no interleaved pipeline schedule; use --virtual-stages 1 or --framework megatron")
    elif f == "megatron":
        if cfg.zero_stage > 1:
            raise UserError(f"framework megatron shards optimizer states only (distributed optimizer = --zero 1), not ZeRO-{cfg.zero_stage}; use --zero 0/1 or --framework deepspeed")
        if cfg.offload == "optimizer" and precision != "bf16":
            raise UserError(f"framework megatron: optimizer CPU offload (Megatron-Core's HybridDeviceOptimizer) is built "
                            f"for bf16 training, not {precision}; use --precision bf16, --offload none or --framework "
                            "deepspeed")
        if cfg.virtual_stages > 1:
            if is_vlm and decoder_layers % (cfg.pp * cfg.virtual_stages):
                raise UserError(f"framework megatron: interleaving a vision-language model needs its {decoder_layers} decoder "
                                f"layers divisible by --pp {cfg.pp} x --virtual-stages {cfg.virtual_stages} (Megatron's "
                                "custom pipeline layout has no vision-encoder layers)")
            if cfg.grad_accum < cfg.pp:
                raise UserError(f"framework megatron: the interleaved schedule needs at least --pp {cfg.pp} micro-batches "
                                f"per step, not {cfg.grad_accum}; use a smaller --micro-batch or --dp, a larger "
                                "--global-batch, or --virtual-stages 1")
    if cfg.ep > 1 and not is_moe:
        raise UserError(f"--ep {cfg.ep} needs a mixture-of-experts model; this model is dense (use --ep 1)")


def check_framework_for(cfg: ParallelConfig, model: "ModelSpec", *, optimizer: str, precision: str) -> None:
    """``check_framework`` with the facts of ``model`` its rules read (the one place that
    picks them; the search passes them hoisted, since it asks thousands of times)."""
    check_framework(cfg, is_moe=model.is_moe, decoder_layers=model.num_layers, is_vlm=model.is_vlm,
                    optimizer=optimizer, precision=precision)


def grad_accum_for(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per step per DP rank; UserError unless the batch divides evenly."""
    if global_batch % (micro_batch * dp):
        raise UserError(
            f"--global-batch {global_batch} is not divisible by --micro-batch {micro_batch} x dp {dp} = {micro_batch * dp}; "
            f"pick a global batch that is a multiple of {micro_batch * dp}")
    return global_batch // (micro_batch * dp)
