"""Goodput: the share of wall time that trains, given failures, checkpoints and restarts.

Failures are a Poisson process at the job's rate: its GPUs over the per-GPU MTBF plus its nodes
over the per-node MTBF (HardwareProfile.reliability), or ``--mtbf-hours`` for the whole job. A
job computes ``tau`` seconds, stalls ``delta`` to checkpoint, and after a failure pays ``R``
(restart + checkpoint read) and redoes the work since the last durable checkpoint. Under those
assumptions the expected wall time per ``tau`` of work is ``M e^(R/M) (e^((tau+delta)/M) - 1)``
(Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22), so goodput is ``tau`` over that. The interval that maximises it is Daly's
higher-order estimate, which reduces to Young's ``sqrt(2 delta M)`` when
``delta << M``. An asynchronous save is durable only ``persist`` after it starts: a failure
in that window loses the interval before it too, priced as that much more restart time, and
the next save cannot start before the last one is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost.checkpoint_io import CheckpointArrays, checkpoint_arrays
from planner.cost.parallel import Workload
from planner.hardware.profile import HardwareProfile
from planner.model.spec import ModelSpec

HOUR = 3600.0


def job_mtbf_s(profile: HardwareProfile, nodes: int, gpus_per_node: int, mtbf_hours: float | None = None) -> float:
    """The job's mean time between failures, in seconds: the override, or its parts' rates summed."""
    if mtbf_hours is not None:
        return mtbf_hours * HOUR
    r = profile.reliability
    rate = nodes * gpus_per_node / r.gpu_mtbf_hours + nodes / r.node_mtbf_hours
    return HOUR / rate


def daly_interval(delta: np.ndarray, mtbf: float) -> np.ndarray:
    """Daly's higher-order optimum compute time between checkpoints; ``mtbf`` when delta >= 2M."""
    delta = np.asarray(delta, dtype=float)
    x = delta / (2.0 * mtbf)
    tau = np.sqrt(2.0 * delta * mtbf) * (1.0 + np.sqrt(x) / 3.0 + x / 9.0) - delta
    return np.where(delta < 2.0 * mtbf, np.maximum(tau, 0.0), mtbf)


def goodput(tau: np.ndarray, delta: np.ndarray, restart: np.ndarray, mtbf: float) -> np.ndarray:
    """Useful time over wall time under Daly's model, in (0, 1]."""
    tau = np.asarray(tau, dtype=float)
    wall = mtbf * np.exp(np.asarray(restart, dtype=float) / mtbf) * np.expm1((tau + delta) / mtbf)
    return np.where(wall > 0, tau / np.maximum(wall, 1e-300), 1.0)


@dataclass(frozen=True)
class Schedule:
    """Per candidate: steps between checkpoints, and the goodput that interval gives."""

    interval_steps: np.ndarray
    goodput: np.ndarray


def schedule(step_s: np.ndarray, stall_s: np.ndarray, persist_s: np.ndarray, restore_s: np.ndarray,
             restart_s: float, mtbf: float) -> Schedule:
    """The checkpoint interval in whole steps (Daly's optimum, at least the time to persist the
    last save) and the goodput it gives."""
    step_s = np.asarray(step_s, dtype=float)
    lag = np.maximum(persist_s - stall_s, 0.0)
    restart = restart_s + restore_s + lag
    tau = np.maximum(daly_interval(stall_s, mtbf), lag)
    steps = np.maximum(np.round(tau / np.maximum(step_s, 1e-300)), 1.0)
    steps = np.where(steps * step_s < lag, np.ceil(lag / np.maximum(step_s, 1e-300)), steps)
    return Schedule(steps.astype(np.int64), goodput(steps * step_s, stall_s, restart, mtbf))


@dataclass(frozen=True)
class CheckpointPlan:
    """One plan's checkpoint and failure facts, as plan.json's "checkpoint" reports them."""

    full_bytes: float
    model_bytes: float
    stall_s: float
    persist_s: float
    restore_s: float
    restart_s: float
    interval_steps: int
    mtbf_s: float
    goodput: float

    def to_json(self, step_s: float) -> dict[str, float | int]:
        return {"full_bytes": self.full_bytes, "model_only_bytes": self.model_bytes, "save_stall_s": self.stall_s,
                "save_persist_s": self.persist_s, "restore_s": self.restore_s, "restart_s": self.restart_s,
                "interval_steps": self.interval_steps, "interval_s": self.interval_steps * step_s,
                "mtbf_hours": self.mtbf_s / HOUR, "goodput": self.goodput}


def candidates_goodput(col: dict[str, np.ndarray], step_s: np.ndarray, model: ModelSpec, workload: Workload,
                       profile: HardwareProfile, nodes: int) -> tuple[Schedule, float, CheckpointArrays]:
    """The checkpoint schedule and goodput of each candidate of ``col`` at its step time; the
    job's MTBF in seconds; and the checkpoint facts."""
    ckpt = checkpoint_arrays(col, model, workload, profile, nodes)
    mtbf = job_mtbf_s(profile, nodes, profile.gpus_per_node, workload.mtbf_hours)
    return schedule(step_s, ckpt.stall_s, ckpt.persist_s, ckpt.restore_s, profile.reliability.restart_s, mtbf), \
        mtbf, ckpt


def plan_checkpoint(col: dict[str, np.ndarray], step_s: float, model: ModelSpec, workload: Workload,
                    profile: HardwareProfile, nodes: int) -> CheckpointPlan:
    """``candidates_goodput`` of one candidate (``col`` of length 1)."""
    sched, mtbf, ckpt = candidates_goodput(col, np.array([step_s]), model, workload, profile, nodes)
    return CheckpointPlan(float(ckpt.full_bytes[0]), float(ckpt.model_bytes[0]), float(ckpt.stall_s[0]),
                          float(ckpt.persist_s[0]), float(ckpt.restore_s[0]), profile.reliability.restart_s,
                          int(sched.interval_steps[0]), mtbf, float(sched.goodput[0]))
