"""Why the published-run targets conflict: the two global factors swept along Table 1's fit.

dsplan fits two global efficiency factors (planner/cost/efficiency.py: GEMM_SUSTAINED, the share
of MAMF a training step's GEMMs keep, and HBM_EFFICIENCY, the share of datasheet bandwidth its
memory-bound kernels keep) on Narayanan et al. 2021 Table 1 (bench_megatron_table1.py). This
benchmark walks the GEMM share across its published range and, for each value, refits the HBM
share on Table 1 alone (least mean |error|), then prices every run of bench_published_runs.py
with that pair. It prints, per pair, Table 1's mean |error| and each source's mean and worst.

It also prints the same 530B layer (h 20,480, 128 heads, TP 8, PP 35, full recompute, fp16 A100)
as two publications timed it, in seconds per sample in the pipeline's steady state: Korthikanti
et al. 2022 (Megatron-LM, interleaved over 3 chunks, 280 micro-batches of one sample: the
iteration over m + (p - 1) / v slots) and Smith et al. 2022 (MT-NLG, Megatron-DeepSpeed, 1F1B,
1920 samples over 8/10/12 pipelines in micro-batches of 2: the least-squares slope of iteration
time over samples per pipeline, whose intercept holds the bubble and what is paid once a step).

Usage: python benchmarks/bench_global_factors.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_megatron_table1 as table1  # noqa: E402
import bench_published_runs as published  # noqa: E402

from planner.cost import efficiency  # noqa: E402

GEMM_SHARES = np.round(np.arange(0.74, 0.921, 0.02), 2)  # around 0.80-0.85 of MAMF (efficiency.py)
HBM_SHARES = np.round(np.arange(0.50, 1.001, 0.01), 2)
SOURCES = ("Korthikanti 2022 T5", "MT-NLG 2022", "Llama 3 2024 T4", "MosaicML llm-foundry", "MosaicML nodes")


def _with_factors(gemm: float, hbm: float, fn):
    """``fn()`` priced with the two global factors set to ``gemm`` and ``hbm``."""
    saved = efficiency.GEMM_SUSTAINED, efficiency.HBM_EFFICIENCY
    efficiency.GEMM_SUSTAINED, efficiency.HBM_EFFICIENCY = gemm, hbm
    try:
        return fn()
    finally:
        efficiency.GEMM_SUSTAINED, efficiency.HBM_EFFICIENCY = saved


def table1_error(gemm: float, hbm: float) -> float:
    """Mean |error| over Table 1 with these factors."""
    rows = table1.rows()
    return _with_factors(gemm, hbm, lambda: statistics.mean(abs(table1.predict(r)["error"]) for r in rows))


def fitted_line(gemm_shares=GEMM_SHARES, hbm_shares=HBM_SHARES) -> list[dict]:
    """For each GEMM share, the HBM share Table 1 fits best, and the published runs priced with both."""
    out = []
    for gemm in gemm_shares:
        errors = [table1_error(float(gemm), float(h)) for h in hbm_shares]
        hbm = float(hbm_shares[int(np.argmin(errors))])
        groups = published._groups(_with_factors(float(gemm), hbm, published.all_rows))
        out.append({"gemm": float(gemm), "hbm": hbm, "table1": min(errors)} | {
            name: {"mean": statistics.mean(abs(r["error"]) for r in groups[name]),
                   "worst": max(abs(r["error"]) for r in groups[name])} for name in ("all runs", *SOURCES)})
    return out


def sample_times(rows: list[dict] | None = None) -> dict:
    """The 530B layer's seconds per sample in both publications, published and predicted."""
    rows = published.korthikanti() + published.mtnlg() if rows is None else rows
    name, _h, _a, _layers, pp, gb, mb, v, _selective_s, _full_s = published.KORTHIKANTI[2]
    k = next(r for r in rows if r["case"] == f"{name} full recompute")
    slots = (gb // mb + (pp - 1) / v) * mb
    mt = [r for r in rows if r["source"] == "MT-NLG 2022"]
    out = {"korthikanti": {"published": k["published_step_s"] / slots, "predicted": k["predicted_step_s"] / slots}}
    for key in ("published", "predicted"):
        slope, intercept = np.polyfit(published.MTNLG_SAMPLES, [r[f"{key}_step_s"] for r in mt], 1)
        out.setdefault("mtnlg", {})[key] = float(slope)
        out["mtnlg"][f"{key}_intercept"] = float(intercept)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the line and the per-sample times as JSON")
    args = parser.parse_args(argv)
    line, per_sample = fitted_line(), sample_times()
    if args.json:
        print(json.dumps({"line": line, "samples": per_sample}, indent=2))
        return 0
    shipped = (efficiency.GEMM_SUSTAINED, efficiency.HBM_EFFICIENCY)
    print(f"shipped: GEMM share {shipped[0]:.2f}, HBM share {shipped[1]:.2f}, Table 1 mean |error| "
          f"{table1_error(*shipped):.1%}\n")
    print(f"{'GEMM':>5} {'HBM':>5} {'Table 1':>8} {'all runs':>9} " + " ".join(f"{s[:18]:>18}" for s in SOURCES))
    for p in line:
        cells = " ".join(f"{p[s]['mean']:>8.1%} / {p[s]['worst']:>6.1%} " for s in SOURCES)
        print(f"{p['gemm']:>5.2f} {p['hbm']:>5.2f} {p['table1']:>8.1%} {p['all runs']['mean']:>9.1%} {cells}")
    print("(each source: mean / worst |error|)\n")
    k, m = per_sample["korthikanti"], per_sample["mtnlg"]
    print("530B layer, TP 8 x PP 35, full recompute, A100: seconds per sample")
    print(f"  Korthikanti 2022 (Megatron-LM, mb 1):   published {k['published']:.3f}, dsplan {k['predicted']:.3f}")
    print(f"  MT-NLG 2022 (Megatron-DeepSpeed, mb {published.mtnlg_micro_batch()}): published {m['published']:.3f} + "
          f"{m['published_intercept']:.1f} s per step, dsplan {m['predicted']:.3f} + {m['predicted_intercept']:.1f} s")
    print(f"  MT-NLG's published time per sample is {m['published'] / k['published'] - 1:+.0%} on Korthikanti's, "
          f"dsplan's {m['predicted'] / k['predicted'] - 1:+.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
