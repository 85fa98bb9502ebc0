"""Build DeepSpeed's ds_config.json (and moe.json) from a plan, as plain dicts.

Every number here is either the plan's own (batch split, ZeRO stage, offload, degrees) or sized
from the model the plan trains; DeepSpeed buffer sizes are the ones the cost model planned memory
with (planner.cost.frameworks), so the job uses what was predicted. DeepSpeed's own
``DeepSpeedConfig`` accepts every config this module builds (tests/test_emit_ds_config.py sweeps
a matrix of plans through it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from planner.cost import frameworks as fw
from planner.cost.framework_rules import check_framework_for
from planner.cost.zero3_fetch import node_ranks
from planner.emit.plan_file import PlanFile
from planner.model.spec import DecoderBlock, ModelSpec, MoEMLP


class TrainSettings(BaseModel):
    """Optimizer, schedule and logging choices that are not part of a parallel plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: PositiveInt = 1000  # optimizer steps the schedule spans (and the builtin trainer runs)
    warmup_steps: int = Field(-1, ge=-1)  # -1: 1% of the steps, at least 1
    lr: PositiveFloat = 3e-4
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    scheduler: Literal["cosine", "linear"] = "cosine"
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    grad_clip: PositiveFloat = 1.0
    steps_per_print: PositiveInt = 10
    # Steps between checkpoints; None: the plan's interval (planner/cost/goodput.py, resolved by
    # render_run_dir), 0: never.
    checkpoint_every: int | None = Field(None, ge=0)
    checkpoint_copy: str | None = None  # a second location each published checkpoint is copied to

    @property
    def warmup(self) -> int:
        if self.warmup_steps >= 0:
            return min(self.warmup_steps, self.steps)
        return max(1, self.steps // 100)


def _precision(plan: PlanFile) -> dict[str, Any]:
    if plan.work_precision == "bf16":  # a TE recipe trains in bf16 too (its GEMMs are TE's, not DeepSpeed's)
        return {"bf16": {"enabled": True}}
    if plan.work_precision == "fp16":
        # loss_scale 0 = dynamic loss scaling, starting at 2**16 (DeepSpeed's documented defaults).
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    return {}


def _optimizer(plan: PlanFile, settings: TrainSettings) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": settings.lr, "weight_decay": settings.weight_decay}
    if plan.optimizer == "sgd":  # never with offload (framework_rules.check_framework)
        return {"type": "SGD", "params": {**params, "momentum": 0.9}}
    params.update(betas=list(settings.betas), eps=settings.eps)
    if plan.optimizer == "adam":
        # DeepSpeed's "Adam" decouples weight decay unless told otherwise.
        return {"type": "Adam", "params": {**params, "adam_w_mode": False}}
    # With optimizer offload DeepSpeed swaps in DeepSpeedCPUAdam for this by itself.
    return {"type": "AdamW", "params": params}


def _scheduler(settings: TrainSettings) -> dict[str, Any]:
    if settings.scheduler == "cosine":
        return {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": settings.steps,
                "warmup_num_steps": settings.warmup,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": settings.min_lr_ratio,
            },
        }
    return {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": settings.steps,
            "warmup_min_lr": 0.0,
            "warmup_max_lr": settings.lr,
            "warmup_num_steps": settings.warmup,
            "warmup_type": "linear",
        },
    }


def _zero(plan: PlanFile, model: ModelSpec) -> dict[str, Any]:
    stage = plan.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return zero
    # Bucket sizes are the ones the cost model planned the buffers with (one source of truth).
    zero.update(overlap_comm=True, contiguous_gradients=stage >= 2, reduce_scatter=True,
                reduce_bucket_size=fw.REDUCE_BUCKET_SIZE)
    if stage in (1, 2):
        zero["allgather_bucket_size"] = fw.ALLGATHER_BUCKET_SIZE
    if plan.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage in (1, 2):
            # Spreads the CPU-side gradient copies over ranks (DeepSpeed's ZeRO-Offload advice).
            zero["round_robin_gradients"] = True
    if plan.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # The fetch sizes the cost model priced its gathers with (planner/cost/zero3_fetch.py).
        zero.update(
            stage3_prefetch_bucket_size=fw.STAGE3_PREFETCH_BUCKET_SIZE,
            stage3_param_persistence_threshold=fw.stage3_persistence_threshold(model.hidden),
            stage3_max_live_parameters=fw.STAGE3_MAX_LIVE_PARAMETERS,
            stage3_max_reuse_distance=fw.STAGE3_MAX_LIVE_PARAMETERS,
            stage3_gather_16bit_weights_on_model_save=True,
        )
        # ZeRO++ as priced (planner/cost/zero3_fetch.py): hpZ's secondary partition over one node's DP ranks.
        if "hpz" in plan.zero_pp:
            zero["zero_hpz_partition_size"] = node_ranks(plan.gpus_per_node, plan.dp * plan.cp)
        if "qwz" in plan.zero_pp:
            zero["zero_quantized_weights"] = True
        if "qgz" in plan.zero_pp:
            zero["zero_quantized_gradients"] = True
    return zero


def build_ds_config(plan: PlanFile, model: ModelSpec, settings: TrainSettings | None = None) -> dict[str, Any]:
    """The ds_config.json dict for ``plan`` (batch sizes use the plan's data-parallel world size)."""
    settings = settings or TrainSettings()
    # The runtime rules a ds_config cannot express (PipelineModule with ZeRO-2/3, AutoTP with ZeRO-3, ...).
    check_framework_for(plan.parallel_config(), model, optimizer=plan.optimizer, precision=plan.precision,
                        precision_aware_optimizer=plan.precision_aware_optimizer, zero_pp=plan.zero_pp,
                        ep_overlap=plan.ep_comm_overlap, dispatcher=plan.moe_dispatcher,
                        modules=plan.recompute_modules, pp_schedule=plan.pp_schedule, compiled=plan.compile)
    config: dict[str, Any] = {
        "train_batch_size": plan.micro_batch * plan.grad_accum * plan.dp,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        **_precision(plan),
        "optimizer": _optimizer(plan, settings),
        "scheduler": _scheduler(settings),
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": _zero(plan, model),
    }
    if plan.optimizer == "sgd" and plan.zero_stage > 0:
        config["zero_allow_untested_optimizer"] = True
    if plan.recompute != "none":
        config["activation_checkpointing"] = {
            # Partitioning saved activations over the TP group only helps when TP > 1.
            "partition_activations": plan.tp > 1,
            "cpu_checkpointing": plan.offload == "optimizer+params",
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    if plan.pp > 1:
        config["pipeline"] = {
            # Splitting the p2p activations and gradients over the TP group only applies with TP > 1.
            "pipe_partitioned": plan.tp > 1,
            "grad_partitioned": plan.tp > 1,
            "activation_checkpoint_interval": 1 if plan.recompute != "none" else 0,
        }
    if plan.framework == "deepspeed" and plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.cp > 1:
        # Ulysses: DeepSpeedConfig reads the data-parallel world as world / sequence_parallel_size
        # (runtime/config.py), so the batch sizes above stay per data-parallel rank.
        config["sequence_parallel_size"] = plan.cp
    config["checkpoint"] = {"tag_validation": "Warn", "use_node_local_storage": False}
    config["steps_per_print"] = settings.steps_per_print
    config["wall_clock_breakdown"] = False
    return config


def moe_layer_indices(model: ModelSpec) -> list[int]:
    """Decoder-layer indices (0-based, over the decoder blocks only) whose MLP is MoE."""
    return [i for i, block in enumerate(model.decoder_blocks) if block.is_moe]


def build_moe_config(plan: PlanFile, model: ModelSpec) -> dict[str, Any] | None:
    """moe.json: what DeepSpeed MoE needs in code (``deepspeed.moe.layer.MoE`` arguments), or None.

    ``deepspeed_moe`` holds keyword arguments the entry passes to ``MoE(hidden_size=..., expert=...,
    **deepspeed_moe)``; the rest describes the experts so the entry can build them.
    """
    moe_blocks = [b for b in model.decoder_blocks if isinstance(b.mlp, MoEMLP)]
    if not moe_blocks:
        return None
    first: DecoderBlock = moe_blocks[0]
    mlp = first.mlp
    assert isinstance(mlp, MoEMLP)
    return {
        "ep_size": plan.ep,
        "num_experts": mlp.routed_experts,
        "top_k": mlp.top_k,
        "expert_ffn": mlp.expert_ffn,
        "shared_experts": mlp.shared_experts,
        "shared_ffn": mlp.shared_ffn,
        "moe_layers": moe_layer_indices(model),
        "deepspeed_moe": {
            "num_experts": mlp.routed_experts,
            "ep_size": plan.ep,
            "k": mlp.top_k,
            # Capacity with token dropping (GShard / DeepSeek-V2's device-level dropping) at the
            # planned routing imbalance (Workload.moe_imbalance, 1.0 balanced): DeepSpeed's top-k
            # gating sends fixed buffers of capacity x the mean copies, which is what dsplan priced,
            # and the reference trainer runs the same factor. min_capacity keeps tiny micro-batches
            # from dropping everything.
            "capacity_factor": plan.moe_capacity_factor or plan.moe_imbalance,
            "eval_capacity_factor": plan.moe_capacity_factor or plan.moe_imbalance,
            "min_capacity": 4,
            "drop_tokens": True,
            # DeepSpeed's Residual-MoE: a dense MLP beside the experts, the shared experts here.
            "use_residual": mlp.shared_experts > 0,
            "use_rts": True,
            "enable_expert_tensor_parallelism": plan.tp > 1,
        },
    }
