"""A plan as torchtitan's TOML job config (``torchtitan.toml``), the file its trainer reads with
``--job.config_file`` (torchtitan 0.2.2 torchtitan/config/manager.py: CLI > TOML > defaults).

torchtitan 0.2.2 is the last release whose ConfigManager loads a TOML job config; 0.3 replaced
it with Python config registries plus tyro overrides (docs/running.md says what a 0.3 user
does). Every section and key written here is a field of 0.2.2's JobConfig
(torchtitan/config/job_config.py); tests/test_torchtitan.py loads each emitted file with
that ConfigManager.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import tomllib  # Python 3.11+
except ModuleNotFoundError:  # 3.10: the render is not read back
    tomllib = None  # type: ignore[assignment]

from planner.cost import torchtitan as tt
from planner.cost.eager_kernels import compiled_components
from planner.cost.precision import gathers_fp8_params
from planner.emit.ds_config import TrainSettings
from planner.emit.plan_file import PlanFile
from planner.emit.resilience import collective_timeout_s
from planner.errors import UserError, arg
from planner.model.spec import ModelSpec

TORCHTITAN_VERSION = "0.2.2"
CONFIG_FILE = "torchtitan.toml"
# Hugging Face repos whose tokenizer torchtitan's scripts/download_hf_assets.py fetches into
# model.hf_assets_path, per train spec.
_HF_ASSETS = {"llama3": "meta-llama/Llama-3.1-8B", "deepseek_v3": "deepseek-ai/DeepSeek-V3"}
_PRECISION = {"bf16": "bfloat16", "fp32": "float32"}
_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam"}


def torchtitan_job(plan: PlanFile, model: ModelSpec, settings: TrainSettings) -> dict[str, Any]:
    """Long: the job config as nested sections, from the plan (checked against torchtitan's
    rules before this is called: planner/emit/render.py check_plan_against_model).

    The batch: torchtitan's local_batch_size is one data-parallel rank's samples per
    accumulation step and global_batch_size / (local x dp) its gradient accumulation
    (train.py); with a pipeline the accumulation is the pipeline's micro-batches instead
    (local_batch_size / pipeline_parallel_microbatch_size, distributed/pipeline_parallel.py).
    """
    name, flavor = tt.MODELS[model.name]
    dual = plan.pp_schedule == "dualpipev" and plan.pp > 1
    compiled = list(compiled_components(plan.compile, plan.pp_schedule == "dualpipev"))
    divisor = plan.tp * 2 * plan.cp  # ParallelDims.seq_len_divisor: SP over tp, CP's head-tail halves
    if plan.seq_len % divisor:
        raise UserError(f"framework torchtitan: {arg('seq_len')} {plan.seq_len} must be divisible by "
                        f"{arg('tp')} x 2 x {arg('cp')} = {divisor} (torchtitan's ParallelDims.seq_len_divisor)")
    local = plan.micro_batch * (plan.grad_accum if plan.pp > 1 else 1)
    work = "bf16" if plan.precision not in _PRECISION else plan.precision
    recipe = plan.precision if plan.precision in tt.RECIPES else None
    parallelism: dict[str, Any] = {
        # FSDP2 over the DP group (--zero 3), HSDP with dp_replicate replicas of dp / dp_replicate
        # shards (torchtitan folds CP into the shard mesh), or DDP replicas (--zero 0).
        "data_parallel_replicate_degree": plan.dp if plan.zero_stage == 0 else plan.dp_replicate,
        "data_parallel_shard_degree": 1 if plan.zero_stage == 0 else plan.dp // plan.dp_replicate,
        "fsdp_reshard_after_forward": "default",
        "tensor_parallel_degree": plan.tp,
        "disable_loss_parallel": False,
        "enable_async_tensor_parallel": False,  # priced without TP overlap (Traits.tp_comm_overlap)
        "pipeline_parallel_degree": plan.pp,
        "pipeline_parallel_schedule": tt.schedule(plan.virtual_stages, plan.pp_schedule),
        # DualPipeV's expert all-to-alls under the other pass's compute (dual_pipe_v.py), as priced: not
        # with activation checkpointing, which torchtitan refuses beside it (get_dual_pipe_v_flag).
        "pipeline_parallel_expert_parallel_overlap": dual and plan.ep > 1 and plan.recompute == "none"
        and plan.ep_comm_overlap,
        "pipeline_parallel_microbatch_size": plan.micro_batch,
        "context_parallel_degree": plan.cp,
        "context_parallel_rotate_method": "alltoall",  # K/V passed around the ring (dsplan's p2p)
        "expert_parallel_degree": plan.ep,
        "expert_tensor_parallel_degree": (plan.etp or plan.tp) if plan.ep > 1 else 1,  # as dsplan prices
    }
    if plan.pp > 1:
        parallelism["module_fqns_per_model_part"] = module_fqns(plan, model)
    job: dict[str, Any] = {
        "job": {"dump_folder": "./outputs", "description": f"dsplan plan for {model.name}"},
        "metrics": {"log_freq": settings.steps_per_print, "enable_tensorboard": False},
        "model": {"name": name, "flavor": flavor, "hf_assets_path": f"./assets/hf/{_HF_ASSETS[name].split('/')[1]}",
                  "converters": [tt.RECIPES[recipe]] if recipe else []},
        "optimizer": {"name": _OPTIMIZER[plan.optimizer], "lr": settings.lr, "eps": settings.eps,
                      "weight_decay": settings.weight_decay},
        "lr_scheduler": {"warmup_steps": settings.warmup, "decay_type": settings.scheduler,
                         "min_lr_factor": settings.min_lr_ratio},
        "training": {"dataset": "c4", "local_batch_size": local, "global_batch_size": plan.global_batch,
                     "seq_len": plan.seq_len, "steps": settings.steps, "max_norm": settings.grad_clip,
                     "mixed_precision_param": _PRECISION[work], "mixed_precision_reduce": "float32",
                     "enable_cpu_offload": plan.offload == "optimizer+params"},
        "parallelism": parallelism,
        # Each transformer block and the loss compiled (inductor) unless the plan says otherwise: what
        # is compiled runs fused elementwise kernels, the rest eager ones, each priced so
        # (planner/cost/eager_kernels.py). ScheduleDualPipeV refuses compiled stage modules
        # (_check_torch_compile_compatibility), so its stages run eager.
        "compile": {"enable": bool(compiled), "components": list(compiled)},
        # none, full, or "op": torchtitan's per-op selective AC (selective is Megatron's: refused)
        "activation_checkpoint": ({"mode": "selective", "selective_ac_option": "op"} if plan.recompute == "op"
                                  else {"mode": plan.recompute}),
        # DCP saves every interval, in the background as priced (checkpoint_io.saves_async), the
        # newest two kept; a restart loads the newest from the same folder.
        "checkpoint": {"enable": bool(settings.checkpoint_every), "folder": "checkpoint",
                       "interval": settings.checkpoint_every or settings.steps, "async_mode": "async",
                       "keep_latest_k": 2},
        "comm": {"init_timeout_seconds": 600, "train_timeout_seconds": collective_timeout_s(plan)},
    }
    if recipe == "fp8-tensorwise":
        # FSDP2 all-gathers in float8 where the plan was priced so (precision.gathers_fp8_params), with
        # the scales of every weight computed in one pass after the optimizer step; the LM head in bf16.
        fp8_gather = gathers_fp8_params(recipe, plan.fp8_param_gather, plan.framework, plan.zero_stage, plan.offload)
        job["quantize"] = {"linear": {"float8": {"recipe_name": "tensorwise",
                                                 "enable_fsdp_float8_all_gather": fp8_gather,
                                                 "precompute_float8_dynamic_scale_for_fsdp": fp8_gather,
                                                 "filter_fqns": ["output"]}}}
    elif recipe == "mxfp8":
        job["quantize"] = {"linear": {"mx": {"recipe_name": "mxfp8_cublas", "filter_fqns": ["output"]}}}
    return job


def module_fqns(plan: PlanFile, model: ModelSpec) -> list[list[str]]:
    """The plan's blocks per pipeline chunk as torchtitan module names (tok_embeddings,
    layers.N, norm, output: the names generate_llm_fqn_per_model_part uses), chunk k on rank
    k mod pp as the looped schedules place them."""
    chunks = plan.pp * plan.virtual_stages
    if not plan.stage_blocks or len(plan.stage_blocks) != chunks:
        raise UserError(f"plan: framework torchtitan needs stage_blocks with {arg('pp')} x {arg('virtual_stages')} "
                        f"= {chunks} chunks; plan again (dsplan estimate or suggest)")
    names, layer = [], 0
    for block in model.blocks:
        if block.kind == "decoder":
            names.append(f"layers.{layer}")
            layer += 1
        else:
            names.append({"embedding": "tok_embeddings", "norm": "norm", "lm_head": "output"}[block.kind])
    return [names[first:last] for first, last in plan.stage_blocks]


def to_toml(job: dict[str, Any]) -> str:
    """TOML text of nested sections of strings, numbers, booleans and lists of them, checked by
    reading it back (tomllib) so a broken render never reaches the disk."""
    lines: list[str] = []

    def section(path: str, table: dict[str, Any]) -> None:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if plain:
            lines.append(f"[{path}]")
            lines.extend(f"{key} = {_value(value)}" for key, value in plain.items())
            lines.append("")
        for key, value in table.items():
            if isinstance(value, dict):
                section(f"{path}.{key}", value)

    for name, table in job.items():
        section(name, table)
    text = "\n".join(lines)
    assert tomllib is None or tomllib.loads(text) == job, "torchtitan.toml did not read back as written"
    return text


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")
