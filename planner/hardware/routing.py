"""Bottleneck links inside one node, found by routing a group's traffic over the node graph.

Every group of one parallel dimension communicates at the same time, so all groups on a node
are routed together: a PCIe uplink or a socket link carried by four rings gives each a quarter
of its bandwidth. Results are cached per (profile, local groups); the graph is a few dozen
vertices, so this runs once per group shape, never per query. It reads the plain-data
``NodeFabric`` rather than the networkx graph: importing networkx alone would cost ``dsplan
suggest`` a fifth of its one-second budget.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.hardware.cluster import NodeFabric, node_fabric

Flows = dict[tuple[str, str], float]


@dataclass(frozen=True)
class IntraRoutes:
    """Per-rank bandwidths (bytes/s) of one group shape inside a node, contention included."""

    ring_bw: float  # what each rank of a ring gets, per direction (bus bandwidth ceiling)
    p2p_bw: float  # one rank sending to its next member while all others do the same
    alltoall_s_per_peer_byte: float  # all-to-all, intra-node part: seconds per byte sent to each peer
    bottleneck: str  # the edge that limits the ring, as "u->v"


def intra_routes(profile_json: str, groups: tuple[tuple[int, ...], ...]) -> IntraRoutes:
    """Route the rings, neighbour sends and all-to-alls of ``groups`` (local GPU indices)."""
    return _intra_routes(profile_json, groups)


@functools.lru_cache(maxsize=4096)
def _intra_routes(profile_json: str, groups: tuple[tuple[int, ...], ...]) -> IntraRoutes:
    g = node_fabric(profile_json)
    paths = _paths(profile_json)
    mesh = not g.with_role("nvswitch", "pcie_switch")
    size = len(groups[0])
    if size < 2:
        return IntraRoutes(float("inf"), float("inf"), 0.0, "")
    ring: Flows = {}
    a2a: Flows = {}
    for members in groups:
        names = [f"n0.gpu{i}" for i in members]
        for k, src in enumerate(names):
            _add_path(ring, paths[src][names[(k + 1) % size]], 1.0)
            for dst in names:
                if dst != src:
                    _add_path(a2a, paths[src][dst], 1.0)
    ring_bw, edge = _bottleneck(g, ring)
    p2p_bw = ring_bw
    if mesh:
        # Point-to-point meshes: NCCL/RCCL run one ring per link permutation, so a rank's ring
        # bandwidth is the sum of its direct links to the other members; a single send uses one.
        src = f"n0.gpu{groups[0][0]}"
        peers = {f"n0.gpu{i}" for i in groups[0][1:]}
        direct = [g.edge(src, p)["bw"] for p in peers if g.has_edge(src, p)]
        ring_bw = max(ring_bw, sum(direct)) if direct else ring_bw
        nxt = f"n0.gpu{groups[0][1]}"
        p2p_bw = g.edge(src, nxt)["bw"] if g.has_edge(src, nxt) else p2p_bw
    a2a_spb = max(load / g.edge(u, v)["bw"] for (u, v), load in a2a.items())
    return IntraRoutes(ring_bw, p2p_bw, a2a_spb, edge)


def path_kinds(profile_json: str, members: tuple[int, ...]) -> list[str]:
    """Edge kinds on the routes between the members of one local group (e.g. ["pcie", "socket"])."""
    g, paths = node_fabric(profile_json), _paths(profile_json)
    names = [f"n0.gpu{i}" for i in members]
    kinds = {g.edge(u, v)["kind"] for a in names for b in names if a != b for u, v in zip(paths[a][b], paths[a][b][1:])}
    order = ("nvlink", "xgmi", "pcie", "socket")
    return sorted(kinds, key=lambda k: order.index(k) if k in order else len(order))


@functools.lru_cache(maxsize=32)
def _paths(profile_json: str) -> dict[str, dict[str, list[str]]]:
    g = node_fabric(profile_json)
    gpus = g.with_role("gpu")
    return {s: {d: g.shortest_path(s, d) for d in gpus} for s in gpus}


def _add_path(flows: Flows, path: list[str], amount: float) -> None:
    for u, v in zip(path, path[1:]):
        flows[(u, v)] = flows.get((u, v), 0.0) + amount


def _bottleneck(g: NodeFabric, flows: Flows) -> tuple[float, str]:
    best, where = float("inf"), ""
    for (u, v), count in flows.items():
        share = g.edge(u, v)["bw"] / count
        if share < best:
            best, where = share, f"{u}->{v}"
    return best, where
