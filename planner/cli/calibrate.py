"""``dsplan calibrate``: fit the cost model's global factors to measured runs, write calibration.yaml.

Thin: read the runs (planner/run/train_logs.py), load the model and hardware profile each plan
names, fit (planner/calibrate.py), print each run before and after, write the file atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from planner.cli.output import console, json_option, print_json
from planner.cli.outputs import OutputPath
from planner.errors import UserError

if TYPE_CHECKING:
    from planner.calibrate import FitResult, Run
    from planner.hardware.profile import Calibration
    from planner.run.train_logs import MeasuredRun


@click.command("calibrate", context_settings={"max_content_width": 100},
               short_help="Fit the cost model's factors to measured runs; write calibration.yaml.")
@click.argument("reports", nargs=-1, metavar="[REPORT.json|RUN_DIR]...")
@click.option("--log", "logs", nargs=2, multiple=True, metavar="PLAN.json LOG",
              help="A Megatron-LM or DeepSpeed training log and the plan.json of the run that wrote it "
                   "(repeatable). Megatron-LM: its 'elapsed time per iteration (ms)' lines; DeepSpeed: the "
                   "throughput timer's CurrSamplesPerSec lines (steps_per_print), or the pipeline engine's "
                   "'iter time (s)'.")
@click.option("--profile", "profiles", multiple=True, metavar="FILE",
              help="The `dsplan profile` file a run's plan was priced with (--profile of estimate/suggest/"
                   "generate), one per model (repeatable): runs are re-priced with the same measured blocks.")
@click.option("--out", required=True, type=OutputPath("file"), help="The calibration.yaml to write.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@json_option
def calibrate_command(reports: tuple[str, ...], logs: tuple[tuple[str, str], ...], profiles: tuple[str, ...],
                      out: str, force: bool, as_json: bool) -> None:
    """Fit the cost model's global factors (GEMM rate, HBM-bound work, network bandwidth, and the
    share of the backward that hides data-parallel traffic) to measured runs of one system, and
    write them to a calibration.yaml that `estimate`, `suggest` and `generate` apply with
    `--calibration FILE`.

    \b
    Each run is a report.json of `dsplan run` (or its run directory), or a training log with its
    plan (--log PLAN.json LOG). The step time is the median of the logged steps after the first.
    The fit minimises the squared log error of the predicted step times, with a small pull of
    every factor toward 1.0, so a factor the runs cannot tell (no memory-bound time, no exposed
    traffic) stays 1.0. It prints each run's error (measured / predicted - 1) before and after.
    Calibrate on runs at the plan's full size: a `dsplan run --local` report of a scaled model
    is refused.

    \b
    Examples:
      dsplan calibrate runs/llama8b-1n runs/llama8b-2n --out calibration.yaml
      dsplan calibrate --log plan.json megatron.log --log plan2.json ds.log --out cal.yaml --json
      dsplan estimate --model llama-3-8b --nodes 2 --tp 2 --calibration calibration.yaml
    """
    from planner.atomic import replace_atomically
    from planner.calibrate import fit

    target = Path(out).expanduser()
    if target.exists() and not force:
        raise UserError(f"--out {out}: the file exists; pass --force to replace it, or choose another --out")
    measured = _read_runs(reports, logs)
    blocks = _layer_profiles(profiles)
    result = fit([_run(m, blocks) for m in measured])
    rows = [{**row.to_json(), "kind": m.kind, "source": m.source, "steps": m.steps}
            for row, m in zip(result.runs, measured)]
    text = calibration_text(result.system, result.calibration, [_yaml_row(r) for r in rows])
    replace_atomically(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    if as_json:
        print_json({"system": result.system, "calibration": result.calibration.model_dump(),
                    "identified": result.identified, "runs": rows, "out": str(target)})
        return
    _render(result, rows, str(target))


def _read_runs(reports: tuple[str, ...], logs: tuple[tuple[str, str], ...]) -> list["MeasuredRun"]:
    """Every run given, each with a name of its own (a repeated one gets -2, -3, ...)."""
    import dataclasses

    from planner.run.train_logs import read_log, read_report

    if not reports and not logs:
        raise UserError("give the runs to calibrate on: report.json files (or run directories) of `dsplan run`, "
                        "or --log PLAN.json LOG")
    runs = [read_report(r) for r in reports] + [read_log(plan, log) for plan, log in logs]
    seen: dict[str, int] = {}
    out = []
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
        out.append(run if seen[run.name] == 1 else dataclasses.replace(run, name=f"{run.name}-{seen[run.name]}"))
    return out


def _layer_profiles(paths: tuple[str, ...]) -> dict[str, Any]:
    """The --profile files by the model each measured (one per model)."""
    from planner.cost.measured_blocks import load_layer_profile

    out: dict[str, Any] = {}
    for path in paths:
        prof = load_layer_profile(path, "--profile")
        if prof.model in out:
            raise UserError(f"--profile {path}: a second profile of {prof.model}; give one per model")
        out[prof.model] = prof
    return out


def _run(measured: "MeasuredRun", blocks: dict[str, Any]) -> "Run":
    """The fit's plain data: the plan's model and hardware profile loaded (paths relative to the
    run directory resolve there), and the measured blocks its plan was priced with."""
    from planner.calibrate import Run
    from planner.hardware.load import load_profile
    from planner.limits import path_kind
    from planner.run.rundir import resolve_model

    plan, base = measured.plan, measured.base_dir
    hardware = plan.hardware
    if base is not None and not Path(hardware).is_absolute() and path_kind(base / hardware) == "file":
        hardware = str(base / hardware)
    model = resolve_model(plan.model, base if base is not None else Path("."))
    priced_with = (plan.model_extra or {}).get("layer_profile")
    if priced_with and model.name not in blocks:
        raise UserError(f"{measured.source}: its plan was priced with a dsplan profile of {model.name} "
                        f"({priced_with.get('device')}); pass that file with --profile so the fit prices it alike")
    return Run(measured.name, plan, model, load_profile(hardware), measured.step_time_s, blocks.get(model.name))


def _yaml_row(row: dict[str, Any]) -> dict[str, Any]:
    """A run as calibration.yaml lists it: seconds to 6 significant digits, errors to 0.01%."""
    return {"name": row["name"], "source": row["source"], "measured_s": float(f"{row['measured_s']:.6g}"),
            "predicted_before_s": float(f"{row['predicted_before_s']:.6g}"),
            "predicted_after_s": float(f"{row['predicted_after_s']:.6g}"),
            "error_before": round(row["error_before"], 4) + 0.0, "error_after": round(row["error_after"], 4) + 0.0}


def calibration_text(system: str, calibration: "Calibration", runs: list[dict[str, Any]]) -> str:
    """The calibration.yaml written: a header comment, system, calibration, runs (informational)."""
    import yaml

    body = {"system": system,
            "calibration": {k: getattr(calibration, k) for k in ("gemm", "hbm", "network", "overlap")}
            | {"fitted_on": list(calibration.fitted_on)},
            "runs": runs}
    header = (f"# dsplan calibrate: the cost model's global factors for {system}, fitted to the measured runs\n"
              "# under runs (errors: measured / predicted - 1, before and after the fit). Apply with\n"
              "# `dsplan estimate|suggest|generate ... --calibration THIS_FILE`, or copy the calibration\n"
              "# section into the hardware profile (hardware_profiles/README.md).\n")
    return header + yaml.safe_dump(body, sort_keys=False, width=100)


def _render(result: "FitResult", rows: list[dict[str, Any]], out: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    from planner.calibrate import FACTORS, describe_factor
    from planner.cli.output import human_time

    table = Table(title=f"Step time on {escape(result.system)}: measured and predicted", title_justify="left")
    for col in ("run", "from", "measured", "before", "error before", "after", "error after"):
        table.add_column(col, justify="left" if col in ("run", "from") else "right")
    for row in rows:
        table.add_row(escape(row["name"]), row["kind"], human_time(row["measured_s"]),
                      human_time(row["predicted_before_s"]), f"{row['error_before']:+.1%}",
                      human_time(row["predicted_after_s"]), f"{row['error_after']:+.1%}")
    console.print(table)
    cal = result.calibration
    for name in FACTORS:
        moved = "" if result.identified.get(name) else "  (no run's step time depends on it: not fitted)"
        console.print(f"  {name:8} {getattr(cal, name):7.4f}  {describe_factor(name)}{moved}")
    console.print(f"wrote {escape(out)}; apply it with `dsplan estimate|suggest|generate ... --calibration "
                  f"{escape(out)}`", soft_wrap=True)


commands = [calibrate_command]
