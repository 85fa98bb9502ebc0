"""Predicted vs measured NCCL all-reduce bus bandwidth, and the speed of the cost queries.

    python benchmarks/bench_collectives.py            # markdown table + timing
    python benchmarks/bench_collectives.py --csv      # the table as CSV

Measured rows: reference/nccl_allreduce_busbw_measured.csv (8x A100 node, nccl-tests;
8x H200 node with NVLS on, and at 16 GiB with NCCL_NVLS_ENABLE=0; one 8x B200 node, priced
with and without NVLS since the source does not say which ran). The B200 rows came after the
constants were fixed on A100/H200: they test the model, they did not fit it.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

from planner.cost.collectives import (
    collective_seconds,
    collective_time,
    collective_time_array,
    collective_time_for_size,
)
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import Placement
from planner.units import parse_size

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "nccl_allreduce_busbw_measured.csv"
# (label, profile, nvls override, substring of the CSV "system" column)
SYSTEMS = (
    ("8x A100 (ring)", "dgx-a100-80g", None, "A100 node"),
    ("8x H200 (NVLS)", "hgx-h200", None, "NVLS/SHARP on"),
    ("8x H200 (NVLS off)", "hgx-h200", False, "NCCL_NVLS_ENABLE=0"),
    # The source does not say which algorithm NCCL ran on this AWS node: both are priced.
    ("8x B200 (NVLS)", "dgx-b200", None, "1x P6-B200 node"),
    ("8x B200 (ring)", "dgx-b200", False, "1x P6-B200 node"),
)


def comparison(path: Path = REFERENCE) -> list[dict]:
    """One row per measured point: size, measured and predicted busbw, ratio, algorithm."""
    rows = list(csv.DictReader(path.open()))
    out = []
    for label, profile, nvls, key in SYSTEMS:
        cluster = Cluster.build(load_profile(profile), 1)
        for row in rows:
            if key not in row["system"]:
                continue
            nbytes = parse_size(row["payload"])
            cost = collective_time_for_size(cluster, "allreduce", 8, nbytes, nvls=nvls)
            measured = float(row["busbw_GBps"])
            out.append({
                "system": label, "payload": row["payload"], "bytes": nbytes, "measured_busbw_GBps": measured,
                "predicted_busbw_GBps": round(cost.busbw_GBps, 2), "ratio": round(cost.busbw_GBps / measured, 3),
                "algorithm": cost.algorithm,
            })
    return out


def timing() -> dict:
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2048)
    t0 = time.perf_counter()
    Cluster.build(load_profile("dgx-a100-80g"), 2048).summary()
    build = time.perf_counter() - t0
    shape = Placement(cluster, {"tp": 8, "dp": 512, "pp": 4}).group("dp")
    collective_time(cluster, "allreduce", shape, 1e9)
    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        collective_time(cluster, "allreduce", shape, 1e6 + i)
    per_query = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        collective_seconds(cluster, "allreduce", shape, 1e6 + i)
    per_seconds = (time.perf_counter() - t0) / n
    sizes = np.logspace(3, 10, 10_000)
    t0 = time.perf_counter()
    collective_time_array(cluster, "allreduce", shape, sizes)
    per_array_elem = (time.perf_counter() - t0) / sizes.size
    return {"build_and_summary_2048_nodes_s": build, "collective_time_us": per_query * 1e6,
            "collective_seconds_us": per_seconds * 1e6, "array_per_size_us": per_array_elem * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", action="store_true", help="print the comparison as CSV")
    args = parser.parse_args(argv)
    rows = comparison()
    if args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return 0
    print("| system | payload | measured busbw GB/s | predicted GB/s | predicted/measured | algorithm |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['system']} | {r['payload']} | {r['measured_busbw_GBps']:.2f} | {r['predicted_busbw_GBps']:.2f} "
              f"| {r['ratio']:.2f} | {r['algorithm']} |")
    print()
    for system in dict.fromkeys(r["system"] for r in rows):
        big = [r for r in rows if r["system"] == system and r["bytes"] >= 2**20]
        worst = max(big, key=lambda r: abs(r["ratio"] - 1))
        print(f"{system}: worst error from 1 MiB up {abs(worst['ratio'] - 1):.1%} ({worst['payload']})")
    for key, value in timing().items():
        print(f"{key}: {value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
