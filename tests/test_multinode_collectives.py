"""Collectives across nodes against published measurements (benchmarks/bench_collectives.py):
the errors the benchmark prints stay where they were measured, and the NVLS-tree rule that
took the large-payload EFA rows from 1.3x to within 3% holds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from planner.cost.nccl_algorithms import candidates
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import contiguous_shape

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_collectives.py"
GiB = 2**30

# Worst |predicted / measured - 1| from 1 MiB up, as bench_collectives.py printed it when the
# rows were added (docs/accuracy.md, Collectives), and the number of rows priced. A bound is
# the measured error plus half a point: a model change that moves any of them fails here, and
# docs/accuracy.md is then re-run and this table updated with it, never widened alone.
WORST = {
    "4x8 B200 EFA (P6)": (1.657, 20),
    "4x8 B200 EFA (P6, Simple)": (0.562, 20),
    "4x8 B200 EFA (P6, Simple, NVLS off)": (0.201, 20),
    "4x8 H200 EFA (p5en)": (0.006, 2),
    "4x8 H200 EFA (p5en, ring)": (0.054, 1),
    "4x8 H200 EFA (p5en, NVLSTree)": (0.170, 1),
    "2x8 H100 IB (Together)": (0.153, 5),
    "2x8 H100 EFA (p5) allreduce": (0.147, 9),
    "4x8 H100 EFA (p5) allreduce": (0.207, 9),
    "8x8 H100 EFA (p5) allreduce": (0.268, 9),
    "16x8 H100 EFA (p5) allreduce": (0.576, 9),
    "32x8 H100 EFA (p5) allreduce": (0.757, 9),
    "2x8 H100 EFA (p5) alltoall": (0.078, 7),
    "4x8 H100 EFA (p5) alltoall": (0.085, 7),
    "8x8 H100 EFA (p5) alltoall": (0.135, 7),
    "16x8 H100 EFA (p5) alltoall": (0.192, 7),
    "32x8 H100 EFA (p5) alltoall": (0.215, 7),
}
MARGIN = 0.005


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_collectives", BENCH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("bench_collectives", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(bench) -> list[dict]:
    return bench.comparison(bench.MULTINODE_SYSTEMS)


def test_every_multinode_system_is_priced_on_its_rows(rows):
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["system"]] = counts.get(r["system"], 0) + 1
    assert counts == {system: n for system, (_, n) in WORST.items()}


@pytest.mark.parametrize("system", sorted(WORST))
def test_worst_error_from_1MiB_stays_where_it_was_measured(bench, rows, system):
    error, payload = bench.worst_errors(rows)[system]
    assert abs(error - WORST[system][0]) <= MARGIN, (system, error, payload)


def test_large_payloads_across_efa_nodes_are_within_5_percent(rows):
    """Where the NICs bound the collective (>= 512 MiB on 4 P6-B200 and p5en nodes, 4 GiB up on
    4 and 8 p5 nodes) the model is within 5%; none of these rows fitted a constant but the P6
    16 GiB point, which set NET_EFFICIENCY."""
    checked = 0
    for r in rows:
        big = (r["system"] in ("4x8 B200 EFA (P6)", "4x8 H200 EFA (p5en)") and r["bytes"] >= 512 * 2**20) or (
            r["system"] in ("4x8 H100 EFA (p5) allreduce", "8x8 H100 EFA (p5) allreduce") and r["bytes"] >= 4 * GiB)
        if big:
            assert abs(r["ratio"] - 1) <= 0.05, r
            checked += 1
    assert checked == 6 + 2 + 4


def test_simple_protocol_without_nvls_follows_the_p6_curve_from_256KiB(rows):
    """The residual's suspected cause: priced with Simple only and no NVLS the P6-B200 curve is
    met within 20% from 256 KiB up; with every protocol it is 1.4-2.7x too fast below 32 MiB."""
    simple = [r for r in rows if r["system"] == "4x8 B200 EFA (P6, Simple, NVLS off)" and r["bytes"] >= 256 * 2**10]
    assert len(simple) == 17 and all(0.85 <= r["ratio"] <= 1.21 for r in simple)
    default = [r for r in rows if r["system"] == "4x8 B200 EFA (P6)" and 2**20 <= r["bytes"] <= 32 * 2**20]
    assert len(default) == 6 and all(1.4 <= r["ratio"] <= 2.7 for r in default)


def _nvls_tree_over_ring(nodes: int) -> float:
    """NVLS-tree's bandwidth over the ring's (Simple) on ``nodes`` p5en nodes, latency aside."""
    cluster = Cluster.build(load_profile("aws-p5en"), nodes)
    cands = candidates(cluster, "allreduce", contiguous_shape(cluster, 8 * nodes), True)
    seconds_per_byte = {c.algorithm: c.spb for c in cands if c.protocol == "Simple"}
    return seconds_per_byte["ring"] / seconds_per_byte["nvls_tree"]


def test_nvls_tree_gains_on_two_nodes_only():
    """NVLS-tree's inter-node tree sends a rail's share once on two nodes and twice beyond
    (tuning.cc doubles NVLSTree's bwInter for nNodes <= 2): measured on 4 p5en nodes it was
    15% slower than the ring NCCL chose (310 vs 365 GB/s), on 2 H100 nodes 467 GB/s, above
    any ring's NIC bound."""
    assert _nvls_tree_over_ring(2) > 1.25
    assert 0.95 < _nvls_tree_over_ring(4) < 1.1
    assert 0.95 < _nvls_tree_over_ring(16) < 1.1
