"""Cluster graph, fat-tree sizing, rank placement and intra-node routing."""

from __future__ import annotations

import time

import networkx as nx
import pytest

from planner.errors import UserError
from planner.hardware.cluster import Cluster, fat_tree, nic_gpus
from planner.hardware.load import load_profile
from planner.hardware.placement import GroupShape, Placement, contiguous_shape
from planner.hardware.routing import intra_routes


@pytest.fixture(scope="module")
def a100():
    return load_profile("dgx-a100-80g")


def test_graph_of_two_dgx_nodes(a100):
    cluster = Cluster.build(a100, 2)
    g = cluster.graph
    roles = nx.get_node_attributes(g, "role")
    assert sum(r == "gpu" for r in roles.values()) == 16
    assert sum(r == "nic" for r in roles.values()) == 16
    assert sum(r == "nvswitch" for r in roles.values()) == 2
    # rail-optimized: NIC j of every node on leaf j
    assert set(g["n0.nic3"]) & set(g["n1.nic3"]) == {"leaf0.r3"}
    for _, _, data in g.edges(data=True):
        assert data["bw"] > 0 and data["latency"] >= 0 and data["kind"]
    assert g.edges["n0.gpu0", "n0.nvswitch"]["bw"] == 300e9
    assert g.edges["n0.nic0", "leaf0.r0"]["bw"] == 25e9
    counts = {}
    for _, _, kind in g.edges(data="kind"):
        counts[kind] = counts.get(kind, 0) + 1
    assert counts == cluster.link_counts() == {"nvlink": 16, "pcie": 16, "network": 16}
    assert nx.is_connected(g)


def test_fat_tree_sizing_and_spine(a100):
    ft = fat_tree(a100, 64)  # radix 40, 1:1 -> 20 down / 20 up; 4 blocks of 20 nodes, 8 rails
    assert (ft.downlinks_per_leaf, ft.uplinks_per_leaf, ft.nodes_per_leaf) == (20, 20, 20)
    assert ft.leaves == 32 and ft.spines == 16
    g = Cluster.build(a100, 64).graph
    assert sum(1 for _, r in g.nodes(data="role") if r == "spine") == 16
    assert nx.is_connected(g)
    slim = a100.model_copy(update={"fabric": a100.fabric.model_copy(update={"oversubscription": 3.0})})
    assert fat_tree(slim, 64).downlinks_per_leaf == 30
    assert Cluster.build(slim, 64).network_bisection_bw() == pytest.approx(32 * 8 * 25e9 / 3)


def test_summary_numbers(a100):
    s = Cluster.build(a100, 4).summary()
    assert s["gpus"] == 32 and s["nic_bw_per_gpu_GBps"] == 25.0
    assert s["bisection_bw_GBps"] == pytest.approx(2 * 8 * 25)  # two nodes' NICs each way
    assert s["intra_node_bisection_GBps"] == pytest.approx(4 * 300)
    mi300 = Cluster.build(load_profile("mi300x"), 1).summary()
    assert mi300["intra_node_bisection_GBps"] == pytest.approx(16 * 64)  # 4x4 xGMI links cross the cut
    pcie = Cluster.build(load_profile("a100-pcie"), 1).summary()
    assert pcie["intra_node_bisection_GBps"] == pytest.approx(63.0)  # the socket link
    assert pcie["links_by_type"]["socket"] == 1


def test_large_cluster_is_cheap_until_drawn(a100):
    start = time.perf_counter()
    cluster = Cluster.build(a100, 2048)
    summary = cluster.summary()
    shape = Placement(cluster, {"tp": 8, "dp": 256, "pp": 8}).group("dp")
    assert time.perf_counter() - start < 0.5
    assert cluster._graph is None
    assert summary["gpus"] == 16384 and summary["spine_switches"] > 0
    assert shape.leaf_blocks > 1 and shape.crosses_spine


def test_nodes_must_be_positive(a100):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UserError, match="^nodes: need a whole number >= 1"):
            Cluster.build(a100, bad)


def test_nic_affinity():
    pcie = load_profile("a100-pcie")
    assert nic_gpus(pcie, 1) == [2, 3]
    g = Cluster.build(pcie, 1).node_graph
    assert set(g["n0.nic1"]) == {"n0.pcie1"}
    assert set(g["n0.gpu2"]) == {"n0.pcie1"}


def test_placement_shapes(a100):
    cluster = Cluster.build(a100, 4)
    p = Placement(cluster, {"tp": 2, "dp": 8, "pp": 2})
    assert p.order == ("tp", "dp", "pp")
    assert p.ranks("tp", 1) == [2, 3]
    assert p.ranks("dp") == [0, 2, 4, 6, 8, 10, 12, 14]
    assert p.ranks("pp") == [0, 16]
    assert p.group("tp") == GroupShape(2, 1, 2, 1, 4)
    assert p.group("dp") == GroupShape(8, 2, 4, 2, 2)
    assert p.group("pp") == GroupShape(2, 16, 1, 2, 8)
    assert hash(p.group("dp")) == hash(GroupShape(8, 2, 4, 2, 2))
    assert p.group("dp").local_groups(8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    custom = Placement(cluster, {"tp": 8, "ep": 1, "dp": 4, "pp": 1}, order=("dp", "tp", "ep", "pp"))
    assert custom.group("dp") == GroupShape(4, 1, 4, 1, 2)
    assert custom.group("tp") == GroupShape(8, 4, 2, 4, 4)  # ranks 0, 4, ..., 28: two per node


def test_placement_errors(a100):
    cluster = Cluster.build(a100, 2)
    with pytest.raises(UserError, match="= 8 GPUs, but the cluster has 16"):
        Placement(cluster, {"tp": 8, "dp": 1})
    with pytest.raises(UserError, match="split unevenly"):
        Placement(Cluster.build(a100, 3), {"tp": 3, "dp": 8}).group("tp")
    with pytest.raises(UserError, match="exactly once"):
        Placement(cluster, {"tp": 8, "dp": 2}, order=("tp",))
    with pytest.raises(UserError, match="unknown parallel dimension"):
        Placement(cluster, {"tp": 8, "dp": 2}).group("ep")
    with pytest.raises(UserError, match="larger than the cluster"):
        contiguous_shape(cluster, 32)


def test_intra_routes_find_contention():
    pcie = Cluster.build(load_profile("a100-pcie"), 1)
    key = pcie.key[0]
    # four rings of two GPUs, each under its own switch: full PCIe speed
    local = intra_routes(key, ((0, 1), (2, 3), (4, 5), (6, 7)))
    assert local.ring_bw == pytest.approx(31.5e9)
    # four rings of two GPUs on opposite sockets: all cross the socket link (2 x 31.5 GB/s)
    far = intra_routes(key, ((0, 4), (1, 5), (2, 6), (3, 7)))
    assert far.ring_bw == pytest.approx(63e9 / 4)
    assert "cpu" in far.bottleneck
    mi300 = Cluster.build(load_profile("mi300x"), 1)
    full = intra_routes(mi300.key[0], (tuple(range(8)),))
    assert full.ring_bw == pytest.approx(7 * 64e9) and full.p2p_bw == pytest.approx(64e9)


def test_links_crossed_per_dimension(a100):
    p = Placement(Cluster.build(a100, 64), {"tp": 8, "dp": 32, "pp": 2})
    assert p.links("tp") == ("nvlink",)
    assert p.links("dp") == ("pcie", "network", "spine")  # 32 nodes, 20 per leaf block
    small = Placement(Cluster.build(a100, 2), {"tp": 4, "dp": 4})
    assert small.links("dp") == ("nvlink", "pcie", "network")
    pcie = Placement(Cluster.build(load_profile("a100-pcie"), 1), {"tp": 2, "dp": 4})
    assert pcie.links("dp") == ("pcie", "socket")
    assert pcie.links("tp") == ("pcie",)  # both GPUs of a pair sit under one PCIe switch


def _shape_by_every_group(cluster, placement, dim):
    """The group shape read off every group's ranks, one by one (what shape_of condenses)."""
    g, ft = cluster.gpus_per_node, cluster.fat_tree
    groups = [placement.ranks(dim, k) for k in range(cluster.num_gpus // placement.dims[dim])]
    nodes = [sorted({r // g for r in ranks}) for ranks in groups]
    assert len({len(n) for n in nodes}) == 1
    m = len(nodes[0])
    size = placement.dims[dim]
    assert all(sorted(r // g for r in ranks).count(n) * m == size for ranks, ns in zip(groups, nodes) for n in ns)
    leaf = max(len({n // ft.nodes_per_leaf for n in ns}) for ns in nodes)
    pods = max(len({n // ft.nodes_per_pod for n in ns}) for ns in nodes)
    return GroupShape(size, placement.stride(dim), size // m, m, g // (size // m), leaf, pods)


@pytest.mark.parametrize("profile,nodes,radix", [("dgx-a100-80g", 4, None), ("dgx-a100-80g", 96, None),
                                                 ("dgx-a100-80g", 96, 8), ("dgx-h100", 160, 12),
                                                 ("a100-pcie", 24, None), ("mi250x", 40, 16)])
def test_group_shapes_equal_every_group(profile, nodes, radix):
    """shape_of looks at one group per base residue modulo the pod period; on clusters that span
    several leaves and pods (small switches), every layout's shapes equal those read off every group."""
    from planner.hardware.placement import splits_evenly
    from planner.search.space import divisors

    prof = load_profile(profile)
    if radix:
        prof = prof.model_copy(update={"fabric": prof.fabric.model_copy(update={"switch_radix": radix})})
    cluster = Cluster.build(prof, nodes)
    assert radix is None or cluster.fat_tree.nodes_per_pod < nodes
    world, g = cluster.num_gpus, cluster.gpus_per_node
    checked = 0
    for tp in [d for d in divisors(g) if d <= g]:
        for pp in [d for d in divisors(world // tp)][::3]:
            dp = world // (tp * pp)
            for ep in [1, 2] if dp % 2 == 0 else [1]:
                p = Placement(cluster, {"tp": tp, "ep": ep, "dp": dp // ep, "pp": pp}, order=("tp", "ep", "dp", "pp"))
                for dim in p.order:
                    try:
                        want = _shape_by_every_group(cluster, p, dim)
                    except AssertionError:  # uneven split: shape_of must refuse it too
                        with pytest.raises(UserError, match="unevenly"):
                            p.group(dim)
                        assert not splits_evenly(g, p.stride(dim), p.dims[dim])
                        continue
                    assert p.group(dim) == want, (tp, ep, dp, pp, dim)
                    assert splits_evenly(g, p.stride(dim), p.dims[dim])
                    checked += 1
    assert checked > 20


def test_a_two_level_fabric_gains_a_core_layer_past_one_pod():
    """Radix-40 leaves split 20 down / 20 up; rail-optimized, a leaf block is 20 nodes and one
    spine layer reaches 40 leaf blocks: 800 nodes. Beyond that a core layer must exist (two
    more switch hops between pods)."""
    from planner.hardware.cluster import Cluster
    from planner.hardware.load import load_profile

    profile = load_profile("dgx-a100-80g")
    assert profile.fabric.levels == 2 and profile.fabric.switch_radix == 40
    small, pod, big = (Cluster.build(profile, n) for n in (64, 800, 2048))
    assert big.fat_tree.nodes_per_pod == 20 * 40 == 800
    assert (small.levels, pod.levels, big.levels) == (2, 2, 3)
    assert (pod.switch_hops(True, True), big.switch_hops(True, True), big.switch_hops(True, False)) == (3, 5, 3)
    assert big.summary()["levels"] == 3


@pytest.mark.parametrize("profile,nodes,radix", [("dgx-a100-80g", 2048, None), ("dgx-a100-80g", 96, 8),
                                                 ("dgx-h100", 160, 12), ("a100-pcie", 24, None), ("mi250x", 40, 16)])
def test_progression_shapes_equal_the_scan(profile, nodes, radix):
    """strided_shape's closed form (placement._progression_shape) equals shape_of over the
    representative bases, for every stride and size that divide the cluster."""
    from planner.hardware.placement import _progression_shape, representative_bases, shape_of
    from planner.search.space import divisors

    prof = load_profile(profile)
    if radix:
        prof = prof.model_copy(update={"fabric": prof.fabric.model_copy(update={"switch_radix": radix})})
    cluster = Cluster.build(prof, nodes)
    world = cluster.num_gpus
    checked = 0
    for stride in divisors(world):
        for size in divisors(world // stride):
            fast = _progression_shape(cluster, stride, size)
            if fast is None:
                continue
            assert fast == shape_of(cluster, representative_bases(cluster, stride, size), size, stride), (stride, size)
            checked += 1
    assert checked > 20
