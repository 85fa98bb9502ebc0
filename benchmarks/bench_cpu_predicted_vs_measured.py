"""Predicted against measured on this machine's CPUs: plans priced on a cpu-local hardware
profile and layer profile that a fresh ``dsplan profile`` wrote, then run for real with
``dsplan run --local``.

Every number is measured each time the script runs (nothing recorded): per model, one
``dsplan profile --device cpu --hardware-out`` (the blocks, and this machine as a hardware
profile); per layout, ``dsplan estimate --profile`` on 2 ranks of that hardware profile,
``dsplan generate``, ``dsplan run --local`` (DeepSpeed on the CPU accelerator, gloo, the real
model at the planned sequence and fp32). The table is each layout's predicted step, its measured step (the
median after the first step, report.json) and the relative error; with ``--calibrate-on``, the
runs named there are fitted by ``dsplan calibrate`` and the others priced again with the fit.

Layouts (2 ranks): dp (ZeRO-0), zero2, zero3 (micro-batch 1, global batch 2), pp2 (2 pipeline
stages, 4 micro-batches), tp2 (DeepSpeed AutoTP).

Usage: python benchmarks/bench_cpu_predicted_vs_measured.py [--models gpt3-125m] [--seq-len 128]
           [--layouts dp,zero2,zero3,pp2,tp2] [--steps 5] [--calibrate-on dp,zero3] [--work DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DSPLAN = [sys.executable, "-m", "planner"]
LAYOUTS = {
    "dp": ["--zero", "0", "--global-batch", "2"],
    "zero2": ["--zero", "2", "--global-batch", "2"],
    "zero3": ["--zero", "3", "--global-batch", "2"],
    "pp2": ["--pp", "2", "--global-batch", "4"],
    "tp2": ["--tp", "2", "--global-batch", "2"],
}


def dsplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([*DSPLAN, *args], cwd=cwd, capture_output=True, text=True, timeout=3600)
    if done.returncode not in (0, 3):
        raise RuntimeError(f"dsplan {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def profile(model: str, seq_len: int, work: Path) -> Path:
    """``dsplan profile`` of ``model``'s blocks, and this machine's hardware profile from the same
    measurements (GEMM rate, memory copies and gloo collectives over 2 ranks) beside it."""
    out = work / f"{model}.profile.json"
    dsplan("profile", "--model", model, "--device", "cpu", "--seq-len", str(seq_len), "--out", str(out),
           "--hardware-out", str(hardware_of(out)), "--force", cwd=work)
    return out


def hardware_of(prof: Path) -> Path:
    """The hardware profile ``profile`` wrote beside ``prof``."""
    return prof.with_name(prof.name.replace(".profile.json", ".cpu-local.yaml"))


def plan_and_run(model: str, layout: str, seq_len: int, steps: int, prof: Path, work: Path,
                 calibration: Path | None = None) -> dict[str, Any]:
    """One layout: its plan on cpu-local with the profile, the run, and report.json's numbers."""
    name = f"{model}-{layout}"
    extra = ["--calibration", str(calibration)] if calibration else []
    est = dsplan("estimate", "--model", model, "--hardware", str(hardware_of(prof)), "--gpus-per-node", "2",
                 "--seq-len", str(seq_len), "--micro-batch", "1", "--precision", "fp32", "--profile", str(prof),
                 *LAYOUTS[layout], *extra, "--allow-oom", "--json", cwd=work)
    plan_path = work / f"{name}.plan.json"
    plan_path.write_text(est.stdout)
    run_dir = work / name
    dsplan("generate", "--plan", str(plan_path), "--hardware", str(hardware_of(prof)), "--out", str(run_dir),
           "--steps", str(steps),
           "--checkpoint-every", "0", "--force", cwd=work)
    dsplan("run", str(run_dir), "--local", "--steps", str(steps), cwd=work)
    report = json.loads((run_dir / "report.json").read_text())
    predicted, measured = report["predicted"]["step_time_s"], report["measured"]["step_time_s"]
    return {"model": model, "layout": layout, "seq_len": seq_len, "predicted_s": predicted, "measured_s": measured,
            "error": (predicted - measured) / measured, "report": str(run_dir / "report.json"),
            "plan_time": json.loads(est.stdout)["time"]}


def recalibrated(rows: list[dict[str, Any]], fit_on: list[str], work: Path) -> dict[str, float]:
    """``dsplan calibrate`` on the runs of the layouts ``fit_on``; each other run priced again."""
    chosen = [r["report"] for r in rows if r["layout"] in fit_on]
    cal = work / "calibration.yaml"
    profiles = [str(work / f"{m}.profile.json") for m in sorted({r["model"] for r in rows})]
    dsplan("calibrate", *chosen, *[a for p in profiles for a in ("--profile", p)], "--out", str(cal), "--force",
           cwd=work)
    out = {}
    for r in rows:
        plan = json.loads(Path(r["report"]).parent.joinpath("plan.json").read_text())
        prof = work / f"{r['model']}.profile.json"
        est = dsplan("estimate", "--model", r["model"], "--hardware", str(hardware_of(prof)), "--gpus-per-node", "2",
                     "--seq-len", str(r["seq_len"]), "--micro-batch", "1", "--precision", "fp32",
                     "--profile", str(prof), *LAYOUTS[r["layout"]],
                     "--calibration", str(cal), "--allow-oom", "--json", cwd=work)
        out[f"{r['model']}-{r['layout']}"] = json.loads(est.stdout)["step_time_s"] / r["measured_s"] - 1.0
        assert plan["model"] == r["model"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt3-125m")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--calibrate-on", default="", help="layouts whose runs dsplan calibrate fits (e.g. dp,zero3)")
    ap.add_argument("--work", default=None, help="directory for profiles, plans and run directories")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="dsplan-cpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models.split(","):
        prof = profile(model, args.seq_len, work)
        for layout in args.layouts.split(","):
            rows.append(plan_and_run(model, layout, args.seq_len, args.steps, prof, work))
    after = recalibrated(rows, args.calibrate_on.split(","), work) if args.calibrate_on else {}
    if args.json:
        print(json.dumps({"rows": rows, "after_calibration": after}, indent=2))
        return 0
    print(f"{'model':12} {'layout':7} {'predicted':>10} {'measured':>10} {'error':>8}"
          + (f" {'calibrated':>11}" if after else ""))
    for r in rows:
        key = f"{r['model']}-{r['layout']}"
        print(f"{r['model']:12} {r['layout']:7} {r['predicted_s']:9.2f}s {r['measured_s']:9.2f}s {r['error']:+8.1%}"
              + (f" {after[key]:+11.1%}" if key in after else ""))
    print(f"work directory: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
