"""Predicted vs measured NCCL bus bandwidth, one node and several, and the speed of the cost queries.

    python benchmarks/bench_collectives.py            # markdown table + timing
    python benchmarks/bench_collectives.py --csv      # the table as CSV

Measured rows, one node: reference/nccl_allreduce_busbw_measured.csv (8x A100 node, nccl-tests;
8x H200 node with NVLS on, and at 16 GiB with NCCL_NVLS_ENABLE=0; one 8x B200 node, priced
with and without NVLS since the source does not say which ran). The B200 rows came after the
constants were fixed on A100/H200: they test the model, they did not fit it.

Several nodes, the whole job as one group: the same file's 4x P6-B200 all-reduce (EFA v4), and
reference/nccl_multinode_busbw_measured.csv (4x p5en, EFA v3; 2x H100 over InfiniBand; 2-32x p5,
EFA v2, all-reduce and all-to-all). A run the source says NCCL was forced onto one algorithm is
priced on that algorithm only; the P6-B200 rows are also priced with the Simple protocol only,
as the aws-ofi-nccl plugin sets NCCL_PROTO=simple where EFA does not order 128-byte writes
(src/platform-aws.cpp), since the source does not say which protocols ran. No constant was
fitted on these rows (NET_EFFICIENCY came from the P6-B200 16 GiB point, see nccl_algorithms).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from planner.cost.collectives import (
    bus_factor,
    collective_seconds,
    collective_time,
    collective_time_array,
    collective_time_for_size,
)
from planner.cost.nccl_algorithms import Candidate, candidates
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import Placement, contiguous_shape
from planner.units import parse_size

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "nccl_allreduce_busbw_measured.csv"
MULTINODE = REFERENCE.with_name("nccl_multinode_busbw_measured.csv")


def simple_only(c: Candidate) -> bool:
    """NCCL_PROTO=simple: what aws-ofi-nccl sets where EFA does not order 128-byte writes."""
    return c.protocol == "Simple"


def ring_only(c: Candidate) -> bool:
    """NCCL_ALGO=allreduce:ring."""
    return c.algorithm == "ring"


def nvls_tree_only(c: Candidate) -> bool:
    """NCCL_ALGO=allreduce:nvlstree."""
    return c.algorithm == "nvls_tree"


class System(NamedTuple):
    """One measured system as priced: its profile and node count, the CSV rows it matches
    (a substring of "system", the op, the "nccl_algo" the source forced), and the NCCL
    candidates the run could use (None: every one, as NCCL chooses)."""

    label: str
    profile: str
    key: str
    nodes: int = 1
    nvls: bool | None = None
    op: str = "allreduce"
    algo: str = "default"
    keep: Callable[[Candidate], bool] | None = None
    path: Path = REFERENCE


SYSTEMS = (
    System("8x A100 (ring)", "dgx-a100-80g", "A100 node"),
    System("8x H200 (NVLS)", "hgx-h200", "NVLS/SHARP on"),
    System("8x H200 (NVLS off)", "hgx-h200", "NCCL_NVLS_ENABLE=0", nvls=False),
    # The source does not say which algorithm NCCL ran on this AWS node: both are priced.
    System("8x B200 (NVLS)", "dgx-b200", "1x P6-B200 node"),
    System("8x B200 (ring)", "dgx-b200", "1x P6-B200 node", nvls=False),
)
_P6 = dict(profile="aws-p6-b200", key="4x P6-B200", nodes=4)
_P5EN = dict(profile="aws-p5en", key="4x p5en", nodes=4, path=MULTINODE)
MULTINODE_SYSTEMS = (
    System("4x8 B200 EFA (P6)", **_P6),
    # The source does not say which protocols NCCL had: NCCL_PROTO=simple priced too.
    System("4x8 B200 EFA (P6, Simple)", keep=simple_only, **_P6),
    System("4x8 B200 EFA (P6, Simple, NVLS off)", nvls=False, keep=simple_only, **_P6),
    System("4x8 H200 EFA (p5en)", **_P5EN),
    System("4x8 H200 EFA (p5en, ring)", algo="ring", keep=ring_only, **_P5EN),
    System("4x8 H200 EFA (p5en, NVLSTree)", algo="nvlstree", keep=nvls_tree_only, **_P5EN),
    System("2x8 H100 IB (Together)", "dgx-h100", "Together AI", nodes=2, path=MULTINODE),
    *(System(f"{m}x8 H100 EFA (p5) {op}", "aws-p5", f"{m}x p5.48xlarge", nodes=m, op=op, path=MULTINODE)
      for op in ("allreduce", "alltoall") for m in (2, 4, 8, 16, 32)),
)


def _measured_rows(system: System) -> list[dict]:
    """The rows of ``system``'s CSV it prices: out-of-place nccl-tests results (or the
    benchmark's single figure), of its op and forced algorithm."""
    rows = list(csv.DictReader(system.path.open()))
    return [r for r in rows if system.key in r["system"] and int(r.get("nodes") or system.nodes) == system.nodes
            and r.get("op", "all_reduce").replace("_", "") == system.op
            and r.get("nccl_algo", "default") == system.algo and r.get("placement", "") in ("", "out-of-place")]


def _predicted(cluster: Cluster, system: System, nbytes: float) -> tuple[float, str]:
    """Predicted busbw (GB/s) and algorithm of the whole job as one group: NCCL's choice, or
    the fastest candidate the run could use."""
    n = cluster.num_gpus
    if system.keep is None:
        cost = collective_time_for_size(cluster, system.op, n, nbytes, nvls=system.nvls)
        return cost.busbw_GBps, cost.algorithm
    nvls = cluster.nvls if system.nvls is None else system.nvls
    allowed = [c for c in candidates(cluster, system.op, contiguous_shape(cluster, n), nvls) if system.keep(c)]
    best = min(allowed, key=lambda c: c.time(nbytes))
    return nbytes / best.time(nbytes) / 1e9 * bus_factor(system.op, n), f"{best.algorithm}/{best.protocol}"


def comparison(systems: tuple[System, ...] = SYSTEMS) -> list[dict]:
    """One row per measured point: size, measured and predicted busbw, ratio, algorithm."""
    out = []
    for system in systems:
        cluster = Cluster.build(load_profile(system.profile), system.nodes)
        for row in _measured_rows(system):
            nbytes = parse_size(row["payload"])
            predicted, algorithm = _predicted(cluster, system, nbytes)
            measured = float(row["busbw_GBps"])
            out.append({
                "system": system.label, "payload": row["payload"], "bytes": nbytes, "measured_busbw_GBps": measured,
                "predicted_busbw_GBps": round(predicted, 2), "ratio": round(predicted / measured, 3),
                "algorithm": algorithm,
            })
    return out


def worst_errors(rows: list[dict], smallest: int = 2**20) -> dict[str, tuple[float, str]]:
    """Per system, the largest |predicted/measured - 1| from ``smallest`` bytes up, and its size."""
    worst: dict[str, tuple[float, str]] = {}
    for r in rows:
        error = abs(r["ratio"] - 1)
        if r["bytes"] >= smallest and error > worst.get(r["system"], (-1.0, ""))[0]:
            worst[r["system"]] = (error, r["payload"])
    return worst


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
    rows = comparison(SYSTEMS + MULTINODE_SYSTEMS)
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
    for system, (error, payload) in worst_errors(rows).items():
        print(f"{system}: worst error from 1 MiB up {error:.1%} ({payload})")
    for key, value in timing().items():
        print(f"{key}: {value:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
