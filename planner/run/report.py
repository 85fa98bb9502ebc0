"""report.json: what the run measured, beside what the plan predicted, with the relative error.

Measured values come from the trainer's per-rank metrics (one record per step and rank):
- step time: per step, the slowest rank's time (the step ends when every rank is done); the
  reported value is the median over the steps after each attempt's warm-up steps (the first
  steps pay for allocation, JIT and cache warm-up);
- tokens/s: the tokens of one global step over that median step time;
- peak memory: the highest value each rank logged;
- loss curve: rank 0's loss per step, from the attempt that last ran the step.
A step run twice (before a failure and again after the restart) counts once, from the later attempt.
- goodput: the time of the steps that count (each once, its slowest rank's) over the run's wall
  time; start-up, checkpoint saves, steps lost to a failure and restarts are what it leaves out,
  as the plan's predicted goodput (planner/cost/goodput.py) does.

``plan`` holds every input of plan.json (planner.emit.plan_file.PlanFile's fields), so the report
alone can be priced again (``dsplan calibrate``), even moved away from its run directory.

Predicted values come from plan.json as dsplan wrote it: ``step_time_s``, ``tokens_per_s``, and
the peak memory of each rank's pipeline stage (``stages[i].memory.peak_bytes``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from planner.run.job import Job
from planner.run.local import planned_for_cpu
from planner.run.supervisor import RunResult

WARMUP_STEPS = 1
LOCAL_NOTE = (
    "Measured with --local: CPU processes (DS_ACCELERATOR=cpu, gloo) training the model at scale '{scale}' "
    "with {seq} tokens per sample. The predictions are for the planned GPUs and the full model, so the "
    "relative errors are not a statement about the planner's accuracy; they only show that the "
    "run directory trains and that the report is complete."
)
AS_PLANNED_NOTE = ("Measured with --local on the CPU hardware profile the plan was made for ({hardware}): the "
                   "model, sequence and precision as planned, so the relative errors are the planner's accuracy.")
ADAPTED_NOTE = ("no prediction for this CPU run: dsplan's cost model has no CPU hardware profile, "
                "so re-estimating the plan for it would not be meaningful")


def relative_error(measured: float | None, predicted: float | None) -> float | None:
    """(measured - predicted) / predicted; None when either side is missing or the prediction is 0."""
    if measured is None or predicted is None or predicted == 0:
        return None
    return (measured - predicted) / predicted


def final_records(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, step) -> the record of the latest attempt that ran that step."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for record in records:
        key = (int(record.get("rank", 0)), int(record["step"]))
        if key not in out or record.get("attempt", 0) >= out[key].get("attempt", 0):
            out[key] = record
    return out


def measure(records: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """Median step time after warm-up, tokens/s, peak memory per rank, rank 0's loss curve."""
    final = final_records(records)
    if not final:
        return {"steps_logged": 0, "step_time_s": None, "tokens_per_s": None, "tokens_per_step": None,
                "peak_memory_bytes_per_rank": {}, "peak_memory_bytes_max": None, "warmup_steps_excluded": 0,
                "steps_measured": 0}
    first_of_attempt: dict[int, int] = {}
    for record in final.values():
        a = record.get("attempt", 0)
        first_of_attempt[a] = min(first_of_attempt.get(a, record["step"]), record["step"])
    per_step: dict[int, float] = {}
    warm: set[int] = set()
    for (_, step), record in final.items():
        per_step[step] = max(per_step.get(step, 0.0), float(record["step_time_s"]))
        if step < first_of_attempt[record.get("attempt", 0)] + warmup:
            warm.add(step)
    measured_steps = sorted(s for s in per_step if s not in warm) or sorted(per_step)
    step_time = statistics.median(per_step[s] for s in measured_steps)
    tokens = next((int(r["tokens"]) for r in final.values() if r.get("tokens")), None)
    peak: dict[str, int] = {}
    for (rank, _), record in sorted(final.items()):
        if record.get("peak_memory_bytes") is not None:
            peak[str(rank)] = max(peak.get(str(rank), 0), int(record["peak_memory_bytes"]))
    return {
        "steps_logged": len(per_step),
        "steps_measured": len(measured_steps),
        "warmup_steps_excluded": len(per_step) - len(measured_steps),
        "step_time_s": step_time,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_time if tokens and step_time > 0 else None,
        "peak_memory_bytes_per_rank": peak,
        "peak_memory_bytes_max": max(peak.values()) if peak else None,
    }


def measured_goodput(records: list[dict[str, Any]], wall_s: float) -> float | None:
    """Useful step time over wall time (None before a step or without wall time)."""
    per_step: dict[int, float] = {}
    for (_, step), record in final_records(records).items():
        per_step[step] = max(per_step.get(step, 0.0), float(record["step_time_s"]))
    if not per_step or wall_s <= 0:
        return None
    return min(1.0, sum(per_step.values()) / wall_s)


def loss_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    final = final_records(records)
    rank0 = sorted((step, r) for (rank, step), r in final.items() if rank == 0)
    return [{"step": step, "loss": r["loss"], "attempt": r.get("attempt", 0)} for step, r in rank0]


def predict(plan: dict[str, Any], stage_of_rank: dict[int, int]) -> dict[str, Any]:
    """The plan's own numbers, per rank where the plan has them per pipeline stage."""
    memory = plan.get("memory") if isinstance(plan.get("memory"), dict) else {}
    stage_peak = {int(s.get("rank", i)): s["memory"]["peak_bytes"] for i, s in enumerate(plan.get("stages") or [])
                  if isinstance(s, dict) and isinstance(s.get("memory"), dict) and "peak_bytes" in s["memory"]}
    default_peak = memory.get("peak_bytes")
    per_rank = {str(rank): stage_peak.get(stage, default_peak) for rank, stage in sorted(stage_of_rank.items())}
    return {
        "step_time_s": plan.get("step_time_s"),
        "tokens_per_s": plan.get("tokens_per_s"),
        "tokens_per_step": (plan["global_batch"] * plan["seq_len"]
                            if "global_batch" in plan and "seq_len" in plan else None),
        "peak_memory_bytes_per_rank": per_rank,
        "peak_memory_bytes_max": max((v for v in per_rank.values() if v is not None), default=default_peak),
        "mfu": plan.get("mfu"),
        "goodput": plan.get("goodput"),
    }


def _stages(run_dir: Path, ranks: list[int]) -> dict[int, int]:
    import json

    stages = {}
    for rank in ranks:
        try:
            info = json.loads((run_dir / f"run_info.rank{rank}.json").read_text())
            stages[rank] = int(info.get("pipeline_stage", 0))
        except (OSError, ValueError):
            stages[rank] = 0
    return stages


def comparison(measured: dict[str, Any], predicted: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for metric in ("step_time_s", "tokens_per_s", "peak_memory_bytes_max", "goodput"):
        rows.append({"metric": metric, "measured": measured.get(metric), "predicted": predicted.get(metric),
                     "relative_error": relative_error(measured.get(metric), predicted.get(metric))})
    for rank, value in measured["peak_memory_bytes_per_rank"].items():
        pred = predicted["peak_memory_bytes_per_rank"].get(rank)
        rows.append({"metric": f"peak_memory_bytes_rank{rank}", "measured": value, "predicted": pred,
                     "relative_error": relative_error(value, pred)})
    return rows


def plan_inputs(plan: dict[str, Any]) -> dict[str, Any]:
    """Every input of the plan (each PlanFile field, defaults filled; not its predictions): what
    ``dsplan calibrate`` re-prices the run from, with no plan.json beside the report."""
    from pydantic import ValidationError

    from planner.emit.plan_file import PlanFile

    try:
        data = PlanFile.model_validate(plan).to_json()
    except ValidationError:  # inspect_run_dir validated it; a hand-built job keeps what it has
        data = plan
    out = {k: data[k] for k in PlanFile.model_fields if k in data}
    if plan.get("layer_profile"):  # priced with dsplan profile's blocks: calibrate needs the same file
        out["layer_profile"] = plan["layer_profile"]
    return out


def build_report(job: Job, result: RunResult, warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    info = job.info
    measured = measure(result.records, warmup)
    measured["goodput"] = measured_goodput(result.records, result.ended - result.started)
    ranks = sorted(int(r) for r in measured["peak_memory_bytes_per_rank"]) or list(range(info.world_size))
    predicted = predict(info.plan, _stages(info.path, ranks))
    local = job.local
    as_planned = local is not None and local.scale == "1" and local.seq_len == local.planned_seq_len \
        and planned_for_cpu(info.plan)
    curve = loss_curve(result.records)
    return {
        "run_dir": str(info.path),
        "status": result.status,
        "launcher": job.launcher,
        "local": local is not None,
        "local_adaptation": local.to_json() if local is not None else None,
        "note": (AS_PLANNED_NOTE.format(hardware=info.plan.get("hardware")) if as_planned else
                 LOCAL_NOTE.format(scale=local.scale, seq=local.seq_len) if local is not None else None),
        "plan": plan_inputs(info.plan),
        "steps": {"target": job.target_steps, "last": curve[-1]["step"] if curve else None,
                  "logged": measured["steps_logged"]},
        "wall_time_s": result.ended - result.started,
        "started": _iso(result.started),
        "measured": measured,
        "predicted": predicted,
        "comparison": comparison(measured, predicted),
        "adapted_prediction": None,
        "adapted_prediction_note": ADAPTED_NOTE if local is not None and not as_planned else None,
        "loss_curve": curve,
        "restarts": [{"attempt": r.attempt, "time": r.time, "time_iso": _iso(r.time), "reason": r.reason,
                      "resumed_from_step": r.resumed_from_step, "first_step_after_restart": r.first_step}
                     for r in result.restarts],
        "attempts": [{"index": a.index, "started": a.started, "ended": a.ended, "outcome": a.outcome,
                      "reason": a.reason, "exit_codes": a.exit_codes, "first_step": a.first_step,
                      "last_step": a.last_step} for a in result.attempts],
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def write_report(path: Path, report: dict[str, Any]) -> None:
    from planner.run.rundir import write_json_atomic

    write_json_atomic(path, report)
