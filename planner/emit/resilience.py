"""What a run directory does about failures, from the plan's checkpoint record (plan.json's
"checkpoint", planner/cost/goodput.py): how often it saves, whether the save is asynchronous,
how long a collective may wait before the job is declared hung, and how often a launcher
restarts it."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from planner.cost.checkpoint_io import saves_async
from planner.cost.parallel import FRAMEWORKS
from planner.emit.ds_config import TrainSettings
from planner.emit.megatron_flag import Arg, _a
from planner.emit.plan_file import PlanFile
from planner.errors import UserError

# PyTorch's default process-group timeout for NCCL (torch.distributed.constants.default_pg_nccl_timeout).
DEFAULT_TIMEOUT_S = 600
# A collective may wait this many times the longest thing a rank legitimately waits for.
TIMEOUT_MARGIN = 4
# Launcher restarts of a failed job before a person looks: a node that fails again after three
# restarts is a node to drain, not to retry (the run supervisor's --max-restarts decides for
# `dsplan run`).
RESTARTS = 3


def _record(plan: PlanFile) -> dict:
    extra = plan.model_extra or {}
    record = extra.get("checkpoint")
    return record if isinstance(record, dict) else {}


def planned_interval(plan: PlanFile, steps: int) -> int:
    """The plan's checkpoint interval in steps, at most ``steps`` (a save at the end); 0 when the
    plan file carries no prediction (a hand-written plan.json)."""
    every = _record(plan).get("interval_steps")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return 0
    return min(every, steps)


def async_save(plan: PlanFile) -> bool:
    """Whether the runtime saves in the background (as the cost model prices it)."""
    return bool(saves_async(np.array([FRAMEWORKS.index(plan.framework)]), np.array([plan.zero_stage]))[0])


def collective_timeout_s(plan: PlanFile) -> int:
    """How long a rank may wait in one collective: TIMEOUT_MARGIN x the longest wait the plan
    predicts (a whole step, for pipeline stages and the optimizer's all-reduce; the barrier of a
    synchronous save, which waits for the slowest writer; reading a checkpoint back), in whole
    minutes, never below PyTorch's default."""
    extra = plan.model_extra or {}
    record = _record(plan)
    waits = [extra.get("step_time_s"), record.get("save_stall_s"), record.get("restore_s")]
    longest = max((float(w) for w in waits if isinstance(w, (int, float)) and math.isfinite(w)), default=0.0)
    return max(DEFAULT_TIMEOUT_S, 60 * math.ceil(TIMEOUT_MARGIN * longest / 60))


def resolved_settings(plan: PlanFile, settings: TrainSettings) -> TrainSettings:
    """``settings`` with the checkpoint interval decided: the plan's when not given."""
    if settings.checkpoint_every is not None:
        return settings
    return settings.model_copy(update={"checkpoint_every": planned_interval(plan, settings.steps)})


def check_copy_dir(path: str, source: str = "--checkpoint-copy") -> str:
    """A second checkpoint location must be an absolute path whose nearest existing directory is
    writable here (the nodes see it at the same path: a shared filesystem)."""
    p = Path(path)
    if not p.is_absolute():
        raise UserError(f"{source} {path}: give an absolute path on a filesystem every node mounts")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{source} {path}: {probe} is not a writable directory; give a path you can write to")
    return str(p)


def megatron_checkpoint_args(plan: PlanFile, every: int) -> list[Arg]:
    """Megatron-LM's save and load flags: the run directory's checkpoints/ (a restart loads the
    newest there; an empty one starts from scratch), the plan's interval, the asynchronous
    torch_dist save the cost model prices (Megatron-LM disables --async-save without the
    persistent worker), and the collective timeout."""
    args = [_a("--save", '"$RUN_DIR/checkpoints"', raw=True), _a("--load", '"$RUN_DIR/checkpoints"', raw=True)]
    if every:
        args.append(_a("--save-interval", every))
    if plan.framework != "megatron":  # the Megatron-DeepSpeed fork has neither the format nor the async save
        return args
    if every and async_save(plan):
        args += [_a("--ckpt-format", "torch_dist"), _a("--async-save"), _a("--use-persistent-ckpt-worker")]
    return args + [_a("--distributed-timeout-minutes", collective_timeout_s(plan) // 60)]
