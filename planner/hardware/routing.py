"""Bottleneck links inside one node, found by routing a group's traffic over the node graph.

Every group of one parallel dimension communicates at the same time, so all groups on a node
are routed together: a PCIe uplink or a socket link carried by four rings gives each a quarter
of its bandwidth. Results are cached per (profile, local groups); the graph is a few dozen
vertices, so this runs once per group shape, never per query. It reads the plain-data
``NodeFabric`` rather than the networkx graph: importing networkx alone would cost ``dsplan
suggest`` a fifth of its one-second budget.

Rings (every collective) and all-to-alls (MoE only) are routed separately, and each route
between two GPUs is found when first asked for: a dense model's search routes a few ring
neighbours, not every pair of GPUs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.hardware.cluster import NodeFabric, node_fabric

Edge = tuple[str, str]
Flows = dict[Edge, float]


@dataclass(frozen=True)
class IntraRoutes:
    """Per-rank bandwidths (bytes/s) of one group shape inside a node, contention included."""

    ring_bw: float  # what each rank of a ring gets, per direction (bus bandwidth ceiling)
    p2p_bw: float  # one rank sending to its next member while all others do the same
    alltoall_s_per_peer_byte: float  # all-to-all, intra-node part: seconds per byte sent to each peer
    bottleneck: str  # the edge that limits the ring, as "u->v"


@dataclass(frozen=True)
class RingRoutes:
    """``IntraRoutes`` without the all-to-all: what every collective but all-to-all reads."""

    ring_bw: float
    p2p_bw: float
    bottleneck: str


def intra_routes(profile_json: str, groups: tuple[tuple[int, ...], ...]) -> IntraRoutes:
    """Route the rings, neighbour sends and all-to-alls of ``groups`` (local GPU indices)."""
    ring = ring_routes(profile_json, groups)
    return IntraRoutes(ring.ring_bw, ring.p2p_bw, alltoall_s_per_peer_byte(profile_json, groups), ring.bottleneck)


@functools.lru_cache(maxsize=4096)
def ring_routes(profile_json: str, groups: tuple[tuple[int, ...], ...]) -> RingRoutes:
    """Route the rings and neighbour sends of ``groups`` (local GPU indices)."""
    size = len(groups[0])
    if size < 2:
        return RingRoutes(float("inf"), float("inf"), "")
    g = node_fabric(profile_json)
    ring: Flows = {}
    for members in groups:
        for k, src in enumerate(members):
            _add_path(ring, _route(profile_json, src, members[(k + 1) % size]))
    ring_bw, edge = _bottleneck(g, ring)
    p2p_bw = ring_bw
    if not g.with_role("nvswitch", "pcie_switch"):
        # Point-to-point meshes: NCCL/RCCL run one ring per link permutation, so a rank's ring
        # bandwidth is the sum of its direct links to the other members; a single send uses one.
        src = f"n0.gpu{groups[0][0]}"
        peers = {f"n0.gpu{i}" for i in groups[0][1:]}
        direct = [g.edge(src, p)["bw"] for p in peers if g.has_edge(src, p)]
        ring_bw = max(ring_bw, sum(direct)) if direct else ring_bw
        nxt = f"n0.gpu{groups[0][1]}"
        p2p_bw = g.edge(src, nxt)["bw"] if g.has_edge(src, nxt) else p2p_bw
    return RingRoutes(ring_bw, p2p_bw, edge)


@functools.lru_cache(maxsize=4096)
def alltoall_s_per_peer_byte(profile_json: str, groups: tuple[tuple[int, ...], ...]) -> float:
    """All-to-all of ``groups``, intra-node part: seconds per byte each rank sends to each peer."""
    if len(groups[0]) < 2:
        return 0.0
    g = node_fabric(profile_json)
    a2a: Flows = {}
    for members in groups:
        for src in members:
            for dst in members:
                if dst != src:
                    _add_path(a2a, _route(profile_json, src, dst))
    return max(load / g.edge(u, v)["bw"] for (u, v), load in a2a.items())


def path_kinds(profile_json: str, members: tuple[int, ...]) -> list[str]:
    """Edge kinds on the routes between the members of one local group (e.g. ["pcie", "socket"])."""
    g = node_fabric(profile_json)
    kinds = {g.edge(u, v)["kind"] for a in members for b in members if a != b for u, v in _route(profile_json, a, b)}
    order = ("nvlink", "xgmi", "pcie", "socket")
    return sorted(kinds, key=lambda k: order.index(k) if k in order else len(order))


@functools.lru_cache(maxsize=4096)
def _route(profile_json: str, src: int, dst: int) -> tuple[Edge, ...]:
    """The edges of the shortest path from local GPU ``src`` to ``dst``, found on first use."""
    path = node_fabric(profile_json).shortest_path(f"n0.gpu{src}", f"n0.gpu{dst}")
    return tuple(zip(path, path[1:]))


def _add_path(flows: Flows, edges: tuple[Edge, ...]) -> None:
    for e in edges:
        flows[e] = flows.get(e, 0.0) + 1.0


def _bottleneck(g: NodeFabric, flows: Flows) -> tuple[float, str]:
    best, where = float("inf"), ""
    for (u, v), count in flows.items():
        share = g.edge(u, v)["bw"] / count
        if share < best:
            best, where = share, f"{u}->{v}"
    return best, where
