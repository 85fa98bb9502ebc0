"""``dsplan calibrate``'s fit: the cost model's global factors that best explain measured step times.

Given runs (a plan, the model it trains, the hardware profile it ran on, the step time
measured), find the factors of planner.hardware.profile.Calibration (gemm, hbm, network,
overlap) minimising

    sum over runs of log(predicted / measured)^2  +  RIDGE x sum over factors of log(factor)^2

where predicted is the cost model's step time of the plan with the profile's calibration
replaced by the candidate. The log makes a 10% miss on a 0.1 s step and on a 10 s step count
the same; the ridge pulls every factor toward 1.0, so a factor the runs cannot tell apart from
the others (the HBM rate on runs that spend 1% of their time in memory-bound kernels; the
overlap where no data-parallel traffic is exposed) stays at 1.0 instead of drifting to
whatever the last rounding error favours.

The optimiser works in log-factor space, each coordinate bounded to the schema's range:
Levenberg-Marquardt over forward-difference Jacobians, then a coordinate search with shrinking
steps, which moves factors the Jacobian sees as flat (the overlap is flat until some traffic is
exposed), then Levenberg-Marquardt again from there; all of it from two starts (every factor at
1.0, and the overlap at one half), keeping the better fit. numpy only; a few hundred cost-model
evaluations of a few milliseconds each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from planner import limits
from planner.errors import UserError
from planner.hardware.profile import Calibration

if TYPE_CHECKING:  # pragma: no cover
    from planner.cost.measured_blocks import LayerProfile
    from planner.cost.plan import Plan
    from planner.emit.plan_file import PlanFile
    from planner.hardware.profile import HardwareProfile
    from planner.model.spec import ModelSpec

FACTORS = ("gemm", "hbm", "network", "overlap")
RIDGE = 1e-6  # a factor of 2 the runs do not need costs as much as a 0.07% miss on one run
# Inside the schema's bounds by a hair, so exp(log(bound)) cannot round past them; overlap below 1%
# hides nothing anyway.
_LOW = np.log([limits.MIN_CALIBRATION_FACTOR] * 3 + [0.01]) + 1e-9
_HIGH = np.log([limits.MAX_CALIBRATION_FACTOR] * 3 + [1.0]) - np.array([1e-9] * 3 + [0.0])
_STEP = 1e-3  # forward-difference step in log-factor space
_DIGITS = 4  # decimals the fitted factors are written with


@dataclass(frozen=True)
class Run:
    """One measured run, as plain data."""

    name: str
    plan: "PlanFile"
    model: "ModelSpec"
    profile: "HardwareProfile"
    measured_s: float
    layer_profile: "LayerProfile | None" = None  # the measured block costs the run's plan was priced with


@dataclass(frozen=True)
class RunFit:
    """One run before and after the fit; errors are measured / predicted - 1 (docs/accuracy.md)."""

    name: str
    measured_s: float
    before_s: float
    after_s: float

    @property
    def error_before(self) -> float:
        return self.measured_s / self.before_s - 1

    @property
    def error_after(self) -> float:
        return self.measured_s / self.after_s - 1

    def to_json(self) -> dict[str, float | str]:
        return {"name": self.name, "measured_s": self.measured_s, "predicted_before_s": self.before_s,
                "predicted_after_s": self.after_s, "error_before": self.error_before, "error_after": self.error_after}


@dataclass(frozen=True)
class FitResult:
    system: str
    calibration: Calibration
    runs: list[RunFit]
    identified: dict[str, bool] = field(default_factory=dict)  # whether the runs' times move with each factor
    evaluations: int = 0


def price(plan: "PlanFile", model: "ModelSpec", profile: "HardwareProfile",
          layer_profile: "LayerProfile | None" = None) -> "Plan":
    """The cost model's Plan for a plan file on ``profile`` (its calibration included): the
    degrees, batch split, workload and stage partition the file fixes, priced afresh (with the
    measured block costs of ``layer_profile``, as ``--profile`` priced it)."""
    from planner.cost.estimate import estimate
    from planner.hardware.cluster import Cluster

    cluster = Cluster.build(profile.with_gpus_per_node(plan.gpus_per_node), plan.nodes)
    cfg = plan.parallel_config()
    blocks = plan.stage_blocks
    partition = [tuple(b) for b in blocks] if blocks and len(blocks) == cfg.pp * cfg.virtual_stages else None
    workload = plan.workload().model_copy(update={"layer_profile": layer_profile})
    return estimate(model, cluster, workload, cfg, partition)


def calibrated(profile: "HardwareProfile", calibration: Calibration) -> "HardwareProfile":
    return profile.model_copy(update={"calibration": calibration})


def predict(run: Run, calibration: Calibration | None = None) -> float:
    """The run's predicted step time in seconds, under ``calibration`` (None: the profile's own)."""
    profile = run.profile if calibration is None else calibrated(run.profile, calibration)
    return price(run.plan, run.model, profile, run.layer_profile).step_time_s


def check_one_system(runs: Sequence[Run]) -> str:
    """The one hardware profile every run ran on; runs on two are a UserError naming both."""
    if not runs:
        raise UserError("no runs to calibrate on; give the report.json of at least one measured run")
    first = runs[0]
    for run in runs[1:]:
        if run.profile.name != first.profile.name:
            raise UserError(f"runs on different systems: {first.name} on {first.profile.name}, {run.name} on "
                            f"{run.profile.name}; a calibration is for one system: calibrate each on its own runs")
    return first.profile.name


def factors_of(x: np.ndarray, fitted_on: Sequence[str] = ()) -> Calibration:
    """The Calibration of log factors ``x`` (rounded to the digits written to the file)."""
    values = {name: round(math.exp(v), _DIGITS) for name, v in zip(FACTORS, x)}
    values["overlap"] = min(values["overlap"], 1.0)
    return Calibration(**values, fitted_on=list(fitted_on))


def fit(runs: Sequence[Run], ridge: float = RIDGE,
        predictor: Callable[[Run, Calibration], float] = predict) -> FitResult:
    """The factors that best explain ``runs`` (module docstring), and each run before and after."""
    system = check_one_system(runs)
    for run in runs:
        if not (math.isfinite(run.measured_s) and run.measured_s > 0):
            raise UserError(f"run {run.name}: measured step time {run.measured_s!r}; need seconds above 0")
    logs = np.log([run.measured_s for run in runs])
    evaluations = 0

    def residuals(x: np.ndarray) -> np.ndarray:
        nonlocal evaluations
        evaluations += 1
        cal = Calibration(**{n: math.exp(v) for n, v in zip(FACTORS, x)})
        times = np.array([predictor(run, cal) for run in runs])
        return np.concatenate([np.log(times) - logs, math.sqrt(ridge) * x])

    x = _best_of(residuals, [_minimise(residuals, start) for start in _starts()])
    sensitive = _sensitive(residuals, x, len(runs))
    if not all(sensitive):  # a factor no run depends on at the fit goes back to 1.0, if nothing is lost
        back = np.where(sensitive, x, 0.0)
        r, rb = residuals(x)[:len(runs)], residuals(back)[:len(runs)]
        if rb @ rb <= r @ r + 1e-12:
            x = back
    cal = factors_of(x, [run.name for run in runs])
    # a factor kept away from 1.0 (at a bound, where it no longer moves the runs) was still fitted
    identified = {name: bool(s or abs(v) > 1e-9) for name, s, v in zip(FACTORS, sensitive, x)}
    rows = [RunFit(run.name, run.measured_s, predictor(run, run.profile.calibration), predictor(run, cal))
            for run in runs]
    return FitResult(system, cal, rows, identified, evaluations)


def _starts() -> list[np.ndarray]:
    """Where the search starts: every factor at 1.0, and the same with the overlap at one half.
    At 1.0 the model is flat in the overlap wherever the traffic it hides fits under compute, so
    a search from there can settle on other factors explaining the exposed time; from one half
    it sees the overlap move the runs."""
    half = np.zeros(len(FACTORS))
    half[FACTORS.index("overlap")] = math.log(0.5)
    return [np.zeros(len(FACTORS)), half]


def _best_of(residuals: Callable[[np.ndarray], np.ndarray], found: list[np.ndarray]) -> np.ndarray:
    """The point of ``found`` with the smallest objective (the first among equals)."""
    costs = [float(r @ r) for r in (residuals(x) for x in found)]
    return found[int(np.argmin(costs))]


def _minimise(residuals: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """Levenberg-Marquardt, a coordinate search, Levenberg-Marquardt again (module docstring)."""
    x, r, _ = _coordinate_search(residuals, x, residuals(x), 1.0, 0.05)
    x, r = _levenberg_marquardt(residuals, x, r)
    x, r, moved = _coordinate_search(residuals, x, r, 0.1, 0.002)
    if moved:
        x, r = _levenberg_marquardt(residuals, x, r)
    return x


def _jacobian(residuals: Callable[[np.ndarray], np.ndarray], x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Forward differences, stepping back from an upper bound."""
    columns = []
    for j in range(len(x)):
        h = _STEP if x[j] + _STEP <= _HIGH[j] else -_STEP
        xh = x.copy()
        xh[j] += h
        columns.append((residuals(xh) - r) / h)
    return np.stack(columns, axis=1)


def _levenberg_marquardt(residuals, x: np.ndarray, r: np.ndarray, iterations: int = 30):
    damping = 1e-3
    for _ in range(iterations):
        jac = _jacobian(residuals, x, r)
        a, g = jac.T @ jac, jac.T @ r
        while True:
            step = np.linalg.solve(a + damping * (np.diag(np.diag(a)) + 1e-12 * np.eye(len(x))), -g)
            trial = np.clip(x + step, _LOW, _HIGH)
            rt = residuals(trial)
            if rt @ rt < r @ r:
                break
            damping *= 8
            if damping > 1e8:
                return x, r
        gain = r @ r - rt @ rt
        x, r, damping = trial, rt, max(damping / 4, 1e-9)
        if gain < 1e-14 or np.max(np.abs(step)) < 1e-7:
            break
    return x, r


def _coordinate_search(residuals, x: np.ndarray, r: np.ndarray, size: float, smallest: float):
    """Steps of ``size`` up and down each log factor, halved down to ``smallest``; each kept
    where the objective falls."""
    moved = False
    while size >= smallest:
        better = False
        for j in range(len(x)):
            for sign in (1.0, -1.0):
                trial = x.copy()
                trial[j] = np.clip(trial[j] + sign * size, _LOW[j], _HIGH[j])
                if trial[j] == x[j]:
                    continue
                rt = residuals(trial)
                if rt @ rt < r @ r - 1e-14:
                    x, r, better, moved = trial, rt, True, True
                    break
        if not better:
            size /= 2
    return x, r, moved


def _sensitive(residuals, x: np.ndarray, runs: int) -> list[bool]:
    """Whether some run's predicted time moves with each factor: d log(time) / d log(factor)
    above 0.1% at the fit (below it the ridge, not the runs, set the factor)."""
    r = residuals(x)
    jac = _jacobian(residuals, x, r)[:runs]
    return [bool(np.max(np.abs(jac[:, j])) > 1e-3) for j in range(len(x))]


def describe_factor(name: str) -> str:
    """What a factor scales, for tables and help."""
    return {"gemm": "GEMM and attention-kernel rate", "hbm": "memory-bound kernels' bandwidth",
            "network": "collectives' bandwidth", "overlap": "share of the backward hiding data-parallel traffic"}[name]

