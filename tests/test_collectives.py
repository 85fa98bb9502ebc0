"""Collective cost model: accuracy against measured NCCL all-reduce, conventions, contention, speed."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from planner.cost import nccl_algorithms
from planner.cost.collectives import (
    _plan,
    bus_factor,
    collective_seconds,
    collective_time,
    collective_time_array,
    collective_time_for_size,
)
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import Placement, contiguous_shape
from planner.units import parse_size

# (profile, nvls override, substring of the CSV "system" column)
MEASURED = {
    "a100": ("dgx-a100-80g", None, "A100 node"),
    "h200_nvls": ("hgx-h200", None, "NVLS/SHARP on"),
    "h200_ring": ("hgx-h200", False, "NCCL_NVLS_ENABLE=0"),
}


def _measured(reference_dir, key):
    profile, nvls, needle = MEASURED[key]
    rows = csv.DictReader((reference_dir / "nccl_allreduce_busbw_measured.csv").open())
    points = [(parse_size(r["payload"]), float(r["busbw_GBps"])) for r in rows if needle in r["system"]]
    assert points, f"no measured rows for {needle}"
    return Cluster.build(load_profile(profile), 1), nvls, sorted(points)


@pytest.mark.parametrize("key", sorted(MEASURED))
def test_allreduce_busbw_within_15_percent_from_1MiB(reference_dir, key):
    cluster, nvls, points = _measured(reference_dir, key)
    checked = 0
    for nbytes, measured in points:
        if nbytes < 2**20:
            continue
        predicted = collective_time_for_size(cluster, "allreduce", 8, nbytes, nvls=nvls).busbw_GBps
        assert abs(predicted / measured - 1) <= 0.15, (key, nbytes, predicted, measured)
        checked += 1
    assert checked == (1 if key == "h200_ring" else 15)


@pytest.mark.parametrize("key", ["a100", "h200_nvls"])
def test_small_messages_follow_the_measured_shape(reference_dir, key):
    """Below 1 MiB busbw falls steeply (latency-bound); prediction stays within 2x and monotone."""
    cluster, nvls, points = _measured(reference_dir, key)
    small = [(n, m) for n, m in points if n < 2**20]
    assert len(small) == 5
    predicted = [collective_time_for_size(cluster, "allreduce", 8, n, nvls=nvls).busbw_GBps for n, _ in small]
    for (n, measured), p in zip(small, predicted):
        assert 0.5 <= p / measured <= 2.0, (n, p, measured)
    assert all(b > a for a, b in zip(predicted, predicted[1:]))
    # latency-bound: doubling the size almost doubles busbw at 32-64 KiB
    assert predicted[1] / predicted[0] > 1.8


def test_nvls_beats_link_bandwidth_and_can_be_switched_off():
    cluster = Cluster.build(load_profile("hgx-h200"), 1)
    on = collective_time_for_size(cluster, "allreduce", 8, 16 * 2**30)
    off = collective_time_for_size(cluster, "allreduce", 8, 16 * 2**30, nvls=False)
    assert on.algorithm == "nvls/Simple" and on.busbw_GBps > 450
    assert off.algorithm.startswith("ring/") and off.busbw_GBps < 450
    a100 = Cluster.build(load_profile("dgx-a100-80g"), 1)
    assert "nvls" not in collective_time_for_size(a100, "allreduce", 8, 2**30).algorithm


def test_protocol_switches_with_size():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    algos = [collective_time_for_size(cluster, "allreduce", 8, 2**k).algorithm for k in (15, 22, 30)]
    assert algos == ["ring/LL", "ring/LL128", "ring/Simple"]


def test_bus_bandwidth_conventions():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    for op, factor in (("allreduce", 2 * 15 / 16), ("allgather", 15 / 16), ("reducescatter", 15 / 16),
                       ("alltoall", 15 / 16), ("broadcast", 1.0), ("p2p", 1.0)):
        c = collective_time_for_size(cluster, op, 16, 2**28)
        assert c.busbw_GBps == pytest.approx(c.algbw_GBps * factor)
        assert c.algbw_GBps == pytest.approx(2**28 / c.time_s / 1e9)
        assert bus_factor(op, 16) == pytest.approx(factor)
    assert collective_time_for_size(cluster, "allreduce", 1, 2**20).time_s == 0.0


def test_across_nodes_the_nics_are_the_bottleneck():
    """Two DGX A100: 8 NICs x 25 GB/s per node; a large all-reduce runs at ~0.95 of that."""
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    c = collective_time_for_size(cluster, "allreduce", 16, 4 * 2**30)
    assert c.bottleneck.startswith("network")
    assert 0.85 * 200 < c.busbw_GBps <= 200


def test_groups_sharing_a_node_share_its_nics():
    """DP groups with one rank per node get one NIC each; a node-filling group gets all eight."""
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 8)
    placement = Placement(cluster, {"tp": 8, "dp": 8})
    dp = placement.group("dp")
    assert (dp.ranks_per_node, dp.groups_per_node, dp.nodes_spanned) == (1, 8, 8)
    per_rank = collective_time(cluster, "allreduce", dp, 2**30).busbw_GBps
    assert per_rank == pytest.approx(25 * nccl_algorithms.NET_EFFICIENCY, rel=0.05)
    whole = Placement(cluster, {"dp": 64})
    assert collective_time(cluster, "allreduce", whole.group("dp"), 2**30).busbw_GBps > 6 * per_rank


def test_oversubscribed_spine_slows_groups_that_cross_leaves():
    base = load_profile("dgx-a100-80g")
    slim = base.model_copy(update={"fabric": base.fabric.model_copy(update={"oversubscription": 2.0})})
    full, over = Cluster.build(base, 64), Cluster.build(slim, 64)
    t_full = collective_time_for_size(full, "allreduce", 512, 2**30)
    t_over = collective_time_for_size(over, "allreduce", 512, 2**30)
    assert contiguous_shape(over, 512).crosses_spine
    assert t_over.busbw_GBps == pytest.approx(t_full.busbw_GBps / 2, rel=0.1)
    # a group inside one leaf block does not notice the spine
    inside = collective_time_for_size(over, "allreduce", 16, 2**30).busbw_GBps
    assert inside == pytest.approx(collective_time_for_size(full, "allreduce", 16, 2**30).busbw_GBps)


def test_tree_wins_small_messages_at_scale_ring_wins_large():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 128)
    small = collective_time_for_size(cluster, "allreduce", 1024, 2**16)
    assert small.algorithm.startswith("tree")
    two = Cluster.build(load_profile("dgx-a100-80g"), 2)
    assert collective_time_for_size(two, "allreduce", 16, 4 * 2**30).algorithm == "ring/Simple"


def test_pcie_node_rings_share_switch_uplinks():
    """a100-pcie: 2 GPUs per PCIe switch; two groups that both cross switches halve an uplink."""
    cluster = Cluster.build(load_profile("a100-pcie"), 1)
    pair = Placement(cluster, {"tp": 2, "dp": 4})
    local_pair = collective_time(cluster, "allreduce", pair.group("tp"), 2**28)
    strided = collective_time(cluster, "allreduce", pair.group("dp"), 2**28)
    assert "pcie" in strided.bottleneck and "cpu" in strided.bottleneck
    assert local_pair.busbw_GBps == pytest.approx(31.5 * nccl_algorithms.SIMPLE.efficiency, rel=0.05)
    assert strided.busbw_GBps < 0.6 * local_pair.busbw_GBps


def test_alltoall_and_p2p_across_nodes_use_the_nic():
    cluster = Cluster.build(load_profile("hgx-h200"), 4)
    a2a = collective_time_for_size(cluster, "alltoall", 32, 2**30)
    # 24/32 of each rank's data leaves the node at 50 GB/s x 0.95 (InfiniBand: no measured
    # all-to-all efficiency, NET_EFFICIENCY)
    assert a2a.algbw_GBps == pytest.approx(50 * 0.95 * 32 / 24, rel=0.05)
    pp = Placement(cluster, {"tp": 8, "pp": 4}).group("pp")
    p2p = collective_time(cluster, "p2p", pp, 2**28)
    assert p2p.busbw_GBps == pytest.approx(50 * 0.95, rel=0.05)


def test_an_all_to_all_pays_per_network_peer_and_a_clear_to_send():
    """Across nodes each peer costs a message (EFA: the profile's fitted 3.5 us; InfiniBand, with no
    measured all-to-all: 0.5 us) and each message waits one network step for its receiver's buffer:
    at a size where bandwidth is negligible the time grows by that per rank added outside the node."""
    def grows(profile: str) -> float:
        t = {nodes: collective_time_for_size(Cluster.build(load_profile(profile), nodes), "alltoall", 8 * nodes,
                                             1024).time_s for nodes in (2, 4)}
        return (t[4] - t[2]) / 16
    assert load_profile("aws-p5").node.nics.alltoall_peer_us == 3.5
    assert grows("aws-p5") == pytest.approx(3.5e-6, rel=0.02)
    assert grows("dgx-h100") == pytest.approx(0.5e-6, rel=0.02)
    two = collective_time_for_size(Cluster.build(load_profile("aws-p5"), 2), "alltoall", 16, 1024).time_s
    one = collective_time_for_size(Cluster.build(load_profile("aws-p5"), 1), "alltoall", 8, 1024).time_s
    assert two - one > 2 * 80e-6  # two network steps (80 us each on p5: aws-ofi-nccl's latency)


def test_array_matches_scalar_and_queries_are_cached():
    cluster = Cluster.build(load_profile("hgx-h200"), 16)
    shape = Placement(cluster, {"tp": 8, "dp": 16}).group("dp")
    sizes = np.logspace(2, 10, 40)
    for op in ("allreduce", "allgather", "alltoall"):
        arr = collective_time_array(cluster, op, shape, sizes)
        scalar = [collective_time(cluster, op, shape, s).time_s for s in sizes]
        assert np.allclose(arr, scalar)
        assert np.allclose(arr, [collective_seconds(cluster, op, shape, s) for s in sizes])
    assert np.all(np.diff(collective_time_array(cluster, "allreduce", shape, sizes)) > 0)
    # the topology work runs once per (cluster, op, shape); later sizes are arithmetic only
    shape2 = Placement(cluster, {"tp": 4, "dp": 32}).group("dp")
    before = _plan.cache_info()
    for s in range(1, 2000):
        collective_time(cluster, "reducescatter", shape2, s * 1000)
    after = _plan.cache_info()
    assert after.misses - before.misses == 1
    assert after.hits - before.hits == 1998


def test_bad_input():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    with pytest.raises(UserError, match="unknown collective"):
        collective_time_for_size(cluster, "allsum", 8, 2**20)
    with pytest.raises(UserError, match="larger than the cluster"):
        collective_time_for_size(cluster, "allreduce", 16, 2**20)
    with pytest.raises(UserError, match="does not divide"):
        collective_time_for_size(cluster, "allreduce", 3, 2**20)


@pytest.mark.parametrize("profile,nodes", [("dgx-a100-80g", 64), ("hgx-h200", 4)])
def test_times_keyed_equal_one_call_per_key(profile, nodes):
    """collective_times_keyed (every (op, shape) pair in one pass, the candidates leading) gives
    bit for bit what collective_time_array gives per pair, including zero sizes, one-rank
    groups and sizes with nothing to price (-1)."""
    from planner.cost.collectives import collective_times_keyed
    from planner.hardware.placement import strided_shape

    cluster = Cluster.build(load_profile(profile), nodes)
    shapes = [strided_shape(cluster, stride, size)
              for stride, size in ((1, 1), (1, 8), (2, 4), (8, 4), (1, 32), (16, 2))]
    pairs = [(op, shape) for op in ("allreduce", "reducescatter", "allgather", "p2p", "alltoall") for shape in shapes]
    rng = np.random.default_rng(1)
    which = rng.integers(-1, len(pairs), size=(3, 200))
    sizes = rng.choice([0.0, 1.0, 4096.0, 3e5, 7.7e6, 2.5e9], size=(3, 200)) * rng.uniform(0.5, 2.0, size=(3, 200))
    got = collective_times_keyed(cluster, pairs, which, sizes)
    for q in range(3):
        for row in range(200):
            k = which[q, row]
            want = 0.0 if k < 0 else collective_time_array(cluster, *pairs[k], sizes[q, row:row + 1])[0]
            assert got[q, row] == want, (pairs[k] if k >= 0 else None, sizes[q, row])


def test_multinode_ring_latency_counts_nvlink_and_network_hops_apart():
    """NCCL's ring latency (tuning.cc): n - m NVLink hops and m - 1 network hops per pass, so a
    small all-gather over 1,536 ranks on 192 nodes costs far more than over 192 ranks on as many
    nodes, and less than 1,535 network steps."""
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    wide = collective_time_for_size(cluster, "allgather", 1536, 2**20)
    assert wide.algorithm.startswith("ring")
    links = nccl_algorithms.links_for(cluster, contiguous_shape(cluster, 1536))
    for proto in nccl_algorithms.PROTOCOLS:
        intra, net = nccl_algorithms._step(proto, links.intra_lat), nccl_algorithms._step(proto, links.net_lat)
        assert nccl_algorithms._ring_latency(1536, 192, intra, net) == pytest.approx(1344 * intra + 191 * net)
        assert nccl_algorithms._ring_latency(8, 1, intra, net) == pytest.approx(7 * intra)
    assert wide.time_s > 10 * collective_time_for_size(cluster, "allgather", 8, 2**20).time_s


def test_pat_only_with_one_gpu_per_node():
    """NCCL enables PAT only when every rank is on its own node (tuning.cc ncclPatEnable)."""
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    shape = contiguous_shape(cluster, 1536)
    algos = {c.algorithm for c in nccl_algorithms.candidates(cluster, "allgather", shape, False)}
    assert algos == {"ring"}
    strided = Placement(cluster, {"tp": 8, "dp": 192}).group("dp")
    assert strided.ranks_per_node == 1
    pat = [c for c in nccl_algorithms.candidates(cluster, "allgather", strided, False) if c.algorithm == "pat"]
    assert [c.protocol for c in pat] == ["Simple"]
    assert pat[0].latency_s >= 192 * nccl_algorithms.PAT_PER_RANK_S
