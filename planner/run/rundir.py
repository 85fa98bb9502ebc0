"""The run-directory contract the reference trainer reads.

A run directory (written by ``dsplan generate``) holds ``ds_config.json`` (a standard
DeepSpeed config) and ``plan.json`` (the planner's decision, in the one schema
planner.emit.plan_file defines: generate writes it, run/ reads it back with the same checks).

Metrics: one JSON line per step and rank in ``<log stem>.rank<R><suffix>`` (for the default
``DIR/metrics.jsonl``: ``DIR/metrics.rank0.jsonl``, ...); ``metrics_path`` is the one place
that rule lives so the supervisor reads what the trainer writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.atomic import write_bytes_atomically
from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.errors import UserError

PLAN_FILE = "plan.json"
DS_CONFIG_FILE = "ds_config.json"
DEFAULT_LOG = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
REGENERATE = "regenerate the run directory with `dsplan generate`"


def read_plan(run_dir: Path) -> PlanFile:
    """Load ``plan.json``; a missing or malformed file is the user's to fix (exit 2)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a run directory (no {PLAN_FILE}); create one with `dsplan generate`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); regenerate it with `dsplan generate`")
    return plan_from_dict(data, str(path), REGENERATE)


def _megatron_hint(framework: str) -> str:
    owner = "Megatron-DeepSpeed" if framework == "megatron-deepspeed" else "Megatron-LM"
    return (f"run it with {owner}'s own training script instead (`dsplan generate ... --entry pretrain_gpt.py "
            "-- ARGS`; megatron_args.sh holds the plan's flags)")


def check_reference_trainer(plan: PlanFile, ds_config: dict[str, Any], is_moe: bool) -> None:
    """A UserError naming what of ``plan`` the reference trainer cannot run, else nothing.

    It runs plans on DeepSpeed's engine: AutoTP for tensor parallelism (and only without
    pipeline stages or MoE layers), PipelineModule with one contiguous chunk per stage. Every
    rank checks this before it trains, and ``dsplan run`` before it starts any rank.
    """
    if plan.tp > 1 and plan.framework != "deepspeed":
        raise UserError(f"plan.json: a {plan.framework} plan with tp={plan.tp}, which the reference trainer shards only "
                        f"with DeepSpeed's AutoTP (framework deepspeed); {_megatron_hint(plan.framework)}")
    if plan.tp > 1 and (plan.pp > 1 or is_moe):
        raise UserError("plan.json: the reference trainer runs AutoTP (tp > 1) only without pipeline stages "
                        "and MoE layers; use tp=1 for this plan")
    if plan.virtual_stages > 1:
        raise UserError(f"plan.json: virtual_stages={plan.virtual_stages}; DeepSpeed's PipelineModule runs one "
                        f"contiguous chunk per stage, so the reference trainer needs virtual_stages=1; {_megatron_hint('megatron')}")
    if plan.pp > 1 and not plan.stage_blocks:
        raise UserError("plan.json: stage_blocks is required when pp > 1 (the planner's partition)")
    tp_cfg = int(ds_config.get("tensor_parallel", {}).get("autotp_size", 1) or 1)
    if tp_cfg != plan.tp:
        raise UserError(f"ds_config.json: tensor_parallel.autotp_size is {tp_cfg} but plan.json has tp={plan.tp}; "
                        "regenerate the run directory")


def read_ds_config(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found; pass --deepspeed_config or regenerate the run directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def metrics_path(log: Path, rank: int) -> Path:
    """Per-rank metrics file: ``metrics.jsonl`` -> ``metrics.rank3.jsonl``."""
    log = Path(log)
    return log.with_name(f"{log.stem}.rank{rank}{log.suffix or '.jsonl'}")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(path, (json.dumps(data, indent=2) + "\n").encode(), fsync=True)
