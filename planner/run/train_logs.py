"""Measured step times for ``dsplan calibrate``: dsplan's report.json, Megatron-LM's and DeepSpeed's logs.

Each reader returns a MeasuredRun: the plan the run trained (a PlanFile) and its step time in
seconds, the median of the steps it logged after the first (the first pays for allocation,
compilation and warm-up). The formats, as their sources print them:

- dsplan's report.json (planner/run/report.py): ``measured.step_time_s``, already the median
  after the warm-up steps, over ``measured.steps_measured`` steps;
- Megatron-LM (megatron/training/training.py ``training_log``), one line per log interval,
  averaged over it: `` [2026-08-22 15:22:22.123456] iteration      100/  500000 | consumed
  samples: ... | elapsed time per iteration (ms): 1234.5 | ... | global batch size:   128 |``;
- DeepSpeed 0.19 (deepspeed/utils/timer.py ``ThroughputTimer``), every ``steps_per_print``
  steps: ``epoch=0/micro_step=40/global_step=10, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=
  12.3, MemAllocated=...GB, MaxMemAllocated=...GB``; CurrSamplesPerSec is the global batch
  (``train_batch_size``) over the time of that one optimizer step, so the step took global
  batch / CurrSamplesPerSec. The pipeline engine (deepspeed/runtime/pipe/engine.py
  ``train_batch``) prints its step time directly, averaged over the print interval: ``steps: 10
  loss: 2.3456 iter time (s): 0.512 samples/sec: 125.000``; preferred where present. Without
  either, ``wall_clock_breakdown``'s global timers (``time (ms) | fwd: ... | bwd: ... | step:
  ...``) sum to the step's time less the data loading.

Pure Python: nothing here imports torch or DeepSpeed.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.emit.plan_file import PlanFile, load_plan_file, plan_from_dict
from planner.errors import UserError
from planner.limits import path_kind, shown_path
from planner.run.rundir import read_json_object

REPORT_FILE = "report.json"
UNSCALED_FIX = ("run it unscaled: plan it for this machine (`dsplan generate ... --hardware cpu-local`) and "
                "`dsplan run DIR --local --scale 1`, so the model and sequence are the plan's")

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan))"
MEGATRON_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*" + _NUMBER)
MEGATRON_BATCH = re.compile(r"global batch size:\s*(\d+)")
DEEPSPEED_LINE = re.compile(r"epoch=\d+/micro_step=\d+/global_step=(\d+), RunningAvgSamplesPerSec=[^,]*, "
                            r"CurrSamplesPerSec=" + _NUMBER + r", MemAllocated=")
DEEPSPEED_PIPE_LINE = re.compile(r"steps: (\d+) loss: \S+ .*?iter time \(s\): " + _NUMBER + r" samples/sec: ")
DEEPSPEED_WALL_LINE = re.compile(r"time \(ms\) \| fwd: " + _NUMBER + r" \| bwd: " + _NUMBER
                                 + r"(?: \| [a-z_]+: [-+.\deE]+)*? \| step: " + _NUMBER)


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: what it trained and how long its optimizer step took."""

    name: str  # how the tables and the calibration's fitted_on name it
    source: str  # the file(s) it was read from
    kind: str  # "report", "megatron" or "deepspeed"
    plan: PlanFile
    step_time_s: float
    steps: int  # logged steps (or log lines) the median is over
    base_dir: Path | None = None  # where a relative model path in the plan resolves (the run directory)


def read_report(path: str | Path) -> MeasuredRun:
    """A report.json of ``dsplan run``, or a run directory holding one."""
    given = Path(path).expanduser()
    is_dir = path_kind(given) == "dir"
    file = given / REPORT_FILE if is_dir else given
    where = shown_path(str(file))
    report = _read_json(file, where)
    measured = report.get("measured")
    if not isinstance(measured, dict) or "plan" not in report:
        raise UserError(f"{where}: not a report of `dsplan run` (no measured and plan sections); give the "
                        f"report.json a run wrote, or a training log with --log PLAN.json LOG")
    step, count = measured.get("step_time_s"), measured.get("steps_measured")
    if not _positive(step) or not isinstance(count, int) or count < 1:
        raise UserError(f"{where}: the run measured no steps (measured.steps_measured is {count!r}); run it "
                        f"again for more steps than the warm-up (`dsplan run DIR --steps N`) and calibrate on "
                        "its new report")
    _check_unscaled(report, where)
    run_dir = Path(report["run_dir"]) if isinstance(report.get("run_dir"), str) else file.parent
    plan = _report_plan(report, file, run_dir, where)
    name = (given if is_dir else file.parent if file.name == REPORT_FILE else file.with_suffix("")).resolve().name
    return MeasuredRun(name=name or str(file), source=str(file), kind="report", plan=plan, step_time_s=float(step),
                       steps=count, base_dir=run_dir if path_kind(run_dir) == "dir" else file.parent)


def _read_json(file: Path, where: str) -> dict[str, Any]:
    if path_kind(file) is None:
        raise UserError(f"{where}: no such file; give a report.json of `dsplan run` or its run directory")
    return read_json_object(file, where, "give the report.json `dsplan run` wrote")


def _check_unscaled(report: dict[str, Any], where: str) -> None:
    """A --local run of a scaled model measured another job than its plan: refused."""
    local = report.get("local_adaptation")
    if not report.get("local") or not isinstance(local, dict):
        return
    scale, seq, planned = local.get("scale"), local.get("seq_len"), local.get("planned_seq_len")
    if str(scale) != "1" or seq != planned:
        raise UserError(f"{where}: a --local run of the model at scale {scale!r} with {seq} tokens per sample, "
                        f"not the plan's full model with {planned}: its step time is not the plan's; {UNSCALED_FIX}")


def _report_plan(report: dict[str, Any], file: Path, run_dir: Path, where: str) -> PlanFile:
    """The report's plan; an older report carries only part of it, so its run directory's plan.json."""
    plan = report["plan"]
    if isinstance(plan, dict) and "framework" not in plan:  # written before reports carried every input
        for candidate in (run_dir / "plan.json", file.parent / "plan.json"):
            if path_kind(candidate) == "file":
                return load_plan_file(candidate, where)
        raise UserError(f"{where}: an older report that carries only part of its plan, and no plan.json "
                        "beside it; keep it in its run directory, or give the plan with --log PLAN.json LOG")
    return plan_from_dict(plan, f"{where}: plan", "give the report.json `dsplan run` wrote, unedited")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# -- training logs ---------------------------------------------------------------------------


def megatron_step_times(text: str, global_batch: int | None = None) -> list[tuple[int, float]]:
    """(iteration, seconds per iteration) of each Megatron-LM log line, in the order logged, the
    latest line of an iteration logged twice (a restart) kept; with ``global_batch``, only the
    lines at that batch size (a batch-size ramp logs smaller ones first)."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        match = MEGATRON_LINE.search(line)
        if not match:
            continue
        batch = MEGATRON_BATCH.search(line)
        if global_batch is not None and batch is not None and int(batch[1]) != global_batch:
            continue
        out.pop(int(match[1]), None)
        out[int(match[1])] = float(match[2]) / 1e3
    return [(step, t) for step, t in out.items() if _positive(t)]


def megatron_batches(text: str) -> set[int]:
    """The global batch sizes Megatron-LM's iteration lines report."""
    lines = (line for line in text.splitlines() if MEGATRON_LINE.search(line))
    return {int(b[1]) for line in lines if (b := MEGATRON_BATCH.search(line))}


def deepspeed_step_times(text: str, global_batch: int) -> list[tuple[int, float]]:
    """(global step, seconds) from DeepSpeed's log: the pipeline engine's ``iter time (s)``
    lines where there are any, else the throughput timer's (global batch / CurrSamplesPerSec;
    the slowest rank's where several ranks logged one step), else the wall-clock breakdown's
    fwd + bwd + step (numbered in the order logged)."""
    pipe: dict[int, float] = {}
    timer: dict[int, float] = {}
    wall: list[float] = []
    for line in text.splitlines():
        if match := DEEPSPEED_PIPE_LINE.search(line):
            pipe[int(match[1])] = max(pipe.get(int(match[1]), 0.0), float(match[2]))
        elif (match := DEEPSPEED_LINE.search(line)) and _positive(rate := float(match[2])):
            timer[int(match[1])] = max(timer.get(int(match[1]), 0.0), global_batch / rate)
        elif match := DEEPSPEED_WALL_LINE.search(line):
            wall.append((float(match[1]) + float(match[2]) + float(match[3])) / 1e3)
    found = pipe or timer or dict(enumerate(wall, start=1))
    return sorted((step, t) for step, t in found.items() if _positive(t))


def read_log(plan_path: str | Path, log_path: str | Path) -> MeasuredRun:
    """A Megatron-LM or DeepSpeed training log, with the plan it ran (``--log PLAN.json LOG``)."""
    where = f"--log {shown_path(str(plan_path))} {shown_path(str(log_path))}"
    plan = load_plan_file(plan_path, "--log")
    file = Path(log_path).expanduser()
    if path_kind(file) != "file":
        raise UserError(f"{where}: no such log file; give the training log of the run of that plan")
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise UserError(f"{where}: no such log file; give the training log of the run of that plan") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{where}: cannot read the log ({err.__class__.__name__}: {err})") from None
    kind, steps = "megatron", megatron_step_times(text, plan.global_batch)
    if not steps and megatron_batches(text):
        raise UserError(f"{where}: the log's iterations ran global batch size "
                        f"{', '.join(map(str, sorted(megatron_batches(text))))}, the plan {plan.global_batch}; "
                        "give the plan that run trained")
    if not steps:
        kind, steps = "deepspeed", deepspeed_step_times(text, plan.global_batch)
    if not steps:
        raise UserError(f"{where}: no iteration lines in the log: neither Megatron-LM's 'iteration N/ M | ... "
                        "elapsed time per iteration (ms): T |' nor DeepSpeed's 'epoch=E/micro_step=M/global_step=G, "
                        "..., CurrSamplesPerSec=S, ...' (DeepSpeed logs it every steps_per_print steps); give the "
                        "run's full training log")
    if len(steps) < 2:
        raise UserError(f"{where}: the log times one step only ({steps[0][0]}), and the first pays for the warm-up; "
                        "log more steps (Megatron-LM --log-interval, DeepSpeed steps_per_print)")
    times = [t for _, t in steps[1:]]
    name = file.stem if file.stem not in ("", "log", "train", "stdout") else file.parent.name or file.stem
    return MeasuredRun(name=name, source=f"{plan_path} {log_path}", kind=kind, plan=plan,
                       step_time_s=statistics.median(times), steps=len(times), base_dir=Path(plan_path).parent)
