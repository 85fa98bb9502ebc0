"""Run directories written by hand, without ``dsplan generate``: for the trainer's tests.

``write_run_dir`` writes ``plan.json`` and ``ds_config.json`` (the two files the reference
trainer reads) and nothing else: no launch scripts, no entry.sh, so ``dsplan run`` would not
take it; the tests start the ``deepspeed`` launcher themselves. ``plan.json`` is in the one
schema generate writes (planner.emit.plan_file), so a plan needs every field that has no default.
``default_ds_config`` is what generate's DeepSpeed config comes to for such a plan, in miniature
(fp32, for CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.run.rundir import DS_CONFIG_FILE, PLAN_FILE, write_json_atomic


def default_ds_config(plan: PlanFile, *, offload_optimizer: bool = False, lr: float = 1e-3) -> dict[str, Any]:
    """A DeepSpeed config matching ``plan`` (fp32 on CPU)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "train_batch_size": plan.micro_batch * plan.grad_accum * plan.dp,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": plan.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.pp > 1:
        cfg["pipeline"] = {"stages": plan.pp, "partition": "planner"}
    return cfg


def write_run_dir(run_dir: Path, plan: dict[str, Any], ds_config: dict[str, Any] | None = None) -> Path:
    """Create ``run_dir`` with ``plan.json`` (validated first, as run/ reads it) and ``ds_config.json``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parsed = plan_from_dict(plan, f"{run_dir}/{PLAN_FILE}")
    write_json_atomic(run_dir / PLAN_FILE, plan)
    write_json_atomic(run_dir / DS_CONFIG_FILE, ds_config if ds_config is not None else default_ds_config(parsed))
    return run_dir
