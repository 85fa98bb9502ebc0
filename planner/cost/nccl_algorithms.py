"""The algorithms and protocols NCCL runs, as latency/bandwidth parameters per group shape.

Each candidate (algorithm x protocol) reduces to four numbers, and its time for a buffer of
S bytes is

    t(S) = CALL_OVERHEAD + latency + spb * max(S, ramp) + fill * spb * min(S, fill_cap)

- ``latency``: steps x per-step latency (NCCL's tuning model: base + nSteps x hwLat);
- ``spb``: seconds per byte of the buffer at full speed: wire bytes per buffer byte (ring
  all-reduce 2(n-1)/n) over the bottleneck bandwidth, links from the topology graph times the
  protocol's efficiency;
- ``ramp``: below this size NCCL runs fewer channels (enqueue.cc lowers the channel count
  until each has enough bytes of the whole buffer), so the time stays flat while bandwidth
  grows with size;
- ``fill``: pipelines whose first and last chunk do not overlap (NVLS push-then-multicast)
  expose a fraction of the transfer until the chunk size saturates at ``fill_cap``.

NCCL picks the fastest candidate; so do we (the user may switch NVLS off, as NCCL_NVLS_ENABLE=0).

Calibration (global constants, fitted once to reference/
nccl_allreduce_busbw_measured.csv: the A100 node fixes the ring protocols, the H200 node the
NVLS constants; no per-row factors; benchmarks/bench_collectives.py prints the fit):
- CALL_OVERHEAD_S: both nodes show ~40 us at 32 KiB (1.31 and 1.44 GB/s busbw), the
  launch-and-sync floor of one collective call in nccl-tests / torch.
- per-step latencies are multiples of the profile's link latency (2 us NVLink): LL 0.25x and
  LL128 0.9x land on NCCL's own NVLink ring hwLat (0.47-0.6 and 1.9 us, src/graph/tuning.cc);
  Simple adds a store-and-forward slice per step (NCCL: "the latency of a 256kB chunk").
- bandwidth efficiencies: Simple 0.80 of the NVLink rate (A100 234.9/300 = 78%, H200 ring
  367.6/450 = 82%, p2p_and_summary_bandwidth_measured.csv); LL128 and LL fit the A100 curve
  from 1 MiB up and below 1 MiB; network links reach 0.95 of the NIC rate (4x B200 nodes:
  381.8 GB/s busbw over 8 x 50 GB/s NICs).
- NVLS: 482.3 GB/s busbw at 16 GiB = 0.61 of the 450 GB/s link in each direction (NVLS moves
  S, not 2(n-1)/n S, per GPU); the measured curve approaches it slowly (fill).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape
from planner.hardware.routing import alltoall_s_per_peer_byte, ring_routes

MiB = 2**20
CALL_OVERHEAD_S = 35e-6
NET_EFFICIENCY = 0.95
P2P_EFFICIENCY = 0.87  # p2pBandwidthLatencyTest: A100 274/300 (91%), H100 376/450 (83%)
TREE_EFFICIENCY = 0.9  # NCCL's tree runs a little below ring bandwidth (tuning.cc treeCorrectionFactor)
NVLS_EFFICIENCY = 0.61
NVLS_FILL = 0.5
NVLS_FILL_CAP_BYTES = 32 * MiB
PAT_PER_RANK_S = 2.8e-6  # NCCL src/graph/tuning.cc: PAT's linear latency term per rank
# Posting one send/recv pair per all-to-all peer: inside the node, and across a network whose NICs
# state no measured cost (NIC.alltoall_peer_us; an assumption, no reference row).
ALLTOALL_PEER_S = 0.5e-6


@dataclass(frozen=True)
class Protocol:
    name: str
    step_latency_factor: float  # x the link latency of the slowest hop
    step_extra_s: float  # store-and-forward of one slice per step
    efficiency: float  # of the intra-node link rate
    # Channels saturate from this buffer size on: NCCL lowers the channel count while the
    # buffer is under channels x threads x threshold (enqueue.cc), a threshold that grows with
    # the ranks for ring LL only (tuning.cc threadThresholds), so a fixed size for the others.
    ramp_bytes: float
    ramp_scales_with_ranks: bool = False

    def net_efficiency(self) -> float:
        return NET_EFFICIENCY * self.efficiency / SIMPLE.efficiency


LL = Protocol("LL", 0.25, 0.0, 0.08, 0.0, True)
LL128 = Protocol("LL128", 0.9, 0.0, 0.533, 8 * 512 * 1024)  # fitted on the 8-GPU A100 node: 512 KiB per rank
SIMPLE = Protocol("Simple", 1.0, 9.8e-6, 0.80, 0.0)
PROTOCOLS = (LL, LL128, SIMPLE)


class Candidate(NamedTuple):
    """One algorithm x protocol. A named tuple, immutable as a frozen dataclass but built at a
    third of its cost: a search prices ~100 of them before its first answer."""

    algorithm: str
    protocol: str
    latency_s: float
    spb: float  # seconds per buffer byte
    ramp_bytes: float = 0.0
    fill: float = 0.0
    fill_cap_bytes: float = 0.0

    def time(self, nbytes: float) -> float:
        return (
            CALL_OVERHEAD_S
            + self.latency_s
            + self.spb * max(nbytes, self.ramp_bytes)
            + self.fill * self.spb * min(nbytes, self.fill_cap_bytes)
        )


@dataclass(frozen=True)
class Links:
    """Bandwidths and latencies one group shape sees, contention included (bytes/s, s)."""

    intra_ring_bw: float
    intra_p2p_bw: float
    inter_bw: float  # per rank, across nodes: NICs shared by the groups of a node, spine ratio
    intra_lat: float
    net_lat: float
    bottleneck: str
    a2a_peer: float = ALLTOALL_PEER_S  # seconds per all-to-all peer across the network (NIC.alltoall_peer_us)
    a2a_efficiency: float = NET_EFFICIENCY  # share of line rate an all-to-all keeps (NIC.alltoall_efficiency)


def links_for(cluster: Cluster, shape: GroupShape) -> Links:
    """The links ``shape`` sees on ``cluster``: the same for every op priced on it, so kept
    per (cluster, shape) (a search prices all-gathers, reduce-scatters and all-reduces of one
    DP group; Links is frozen)."""
    return _links_for(cluster, shape)


@functools.lru_cache(maxsize=4096)
def _links_for(cluster: Cluster, shape: GroupShape) -> Links:
    p = cluster.profile
    if shape.ranks_per_node > 1:
        routes = ring_routes(cluster.fabric_key, shape.local_groups(cluster.domain_gpus))
        ring, p2p, edge = routes.ring_bw, routes.p2p_bw, routes.bottleneck
    else:
        ring, p2p, edge = math.inf, math.inf, ""
    spine = p.fabric.oversubscription if shape.crosses_spine else 1.0
    inter = shape.ranks_per_node * cluster.nic_bw_per_gpu / spine if shape.crosses_nodes else math.inf
    if shape.crosses_nodes and inter * NET_EFFICIENCY < ring * SIMPLE.efficiency:
        edge = "network (NIC" + (f", spine {spine:g}:1)" if spine > 1 else ")")
    net_lat = cluster.net_latency_s(shape.crosses_spine, shape.pods > 1)
    nic = p.node.nics
    return Links(ring, p2p, inter, cluster.intra_latency_s, net_lat, edge,
                 ALLTOALL_PEER_S if nic.alltoall_peer_us is None else nic.alltoall_peer_us * 1e-6,
                 nic.alltoall_efficiency or NET_EFFICIENCY)


def _step(proto: Protocol, link_latency: float) -> float:
    return proto.step_latency_factor * link_latency + proto.step_extra_s


def _ring_bw(links: Links, proto: Protocol, eff_scale: float = 1.0) -> float:
    return min(links.intra_ring_bw * proto.efficiency, links.inter_bw * proto.net_efficiency()) * eff_scale


def candidates(cluster: Cluster, op: str, shape: GroupShape, nvls: bool) -> tuple[Candidate, ...]:
    """Every algorithm x protocol NCCL could run for ``op`` on ``shape``."""
    n, r, m = shape.size, shape.ranks_per_node, shape.nodes_spanned
    links = links_for(cluster, shape)
    slow_lat = links.net_lat if m > 1 else links.intra_lat
    out: list[Candidate] = []
    for proto in PROTOCOLS:
        step = _step(proto, slow_lat)
        ring_lat = _ring_latency(n, m, _step(proto, links.intra_lat), step)
        ramp = proto.ramp_bytes * (n if proto.ramp_scales_with_ranks else 1)
        if op == "allreduce":
            bw = _ring_bw(links, proto)
            out.append(Candidate("ring", proto.name, 2 * ring_lat, 2 * (n - 1) / n / bw, ramp))
            if m > 1:
                out.extend(_multinode_allreduce(links, proto, n, r, m, ramp))
        elif op in ("reducescatter", "allgather"):
            spb = (n - 1) / n / _ring_bw(links, proto)
            out.append(Candidate("ring", proto.name, ring_lat, spb, ramp))
            if m > 1 and r == 1 and proto is SIMPLE:
                out.append(Candidate("pat", proto.name, _pat_latency(n, m, step), spb / TREE_EFFICIENCY, ramp))
        elif op == "broadcast":
            out.append(Candidate("ring", proto.name, (n - 1) * step, 1.0 / _ring_bw(links, proto), ramp))
        elif op == "p2p":
            if m == 1:  # p2p copies reach a higher fraction of NVLink than rings (no reduction)
                bw = links.intra_p2p_bw * proto.efficiency * P2P_EFFICIENCY / SIMPLE.efficiency
            else:
                bw = links.inter_bw / r * proto.net_efficiency()
            out.append(Candidate("p2p", proto.name, step, 1.0 / bw))
    if op == "alltoall":
        out.append(_alltoall(links, _alltoall_intra(cluster, shape), n, r, m))
    if op == "allreduce" and nvls and cluster.nvls and r > 1:
        spb = 1.0 / (cluster.intra_bw * NVLS_EFFICIENCY)
        lat = 2 * links.intra_lat
        if m > 1:  # NVLS inside each node, a tree between nodes over each GPU's rail
            spb = max(spb, _nvls_tree_rail_bytes(m) / r / (links.inter_bw / r * NET_EFFICIENCY))
            lat += 2 * math.ceil(math.log2(m)) * _step(SIMPLE, links.net_lat)
        name = "nvls" if m == 1 else "nvls_tree"
        out.append(Candidate(name, "Simple", lat, spb, 0.0, NVLS_FILL, NVLS_FILL_CAP_BYTES))
    # dsplan calibrate's network factor (1.0: none), and a measured library's own rate for the op
    rate = cluster.profile.calibration.network * cluster.profile.node.intra.op_share.get(op, 1.0)
    return tuple(out) if rate == 1.0 else tuple(c._replace(spb=c.spb / rate) for c in out)


def _ring_latency(n: int, m: int, intra_step: float, net_step: float) -> float:
    """One pass of a ring over ``n`` ranks on ``m`` nodes: a chunk crosses n - m NVLink hops
    and m - 1 network hops (NCCL tuning.cc: (nsteps - nInterSteps) x intraLat + nInterSteps x
    interLat; an all-reduce makes two passes)."""
    return (n - m) * intra_step + (m - 1) * net_step if m > 1 else (n - 1) * intra_step


def _nvls_tree_rail_bytes(m: int) -> float:
    """Bytes each GPU's NIC sends per byte of its rail's share in NVLS-tree's inter-node tree:
    an inner node of a double binary tree forwards its share up and down again (2), the one
    link between two nodes carries it once (NCCL tuning.cc doubles NVLSTree's bwInter for
    nNodes <= 2 only)."""
    return 1.0 if m <= 2 else 2.0


def _pat_latency(n: int, m: int, net_step: float) -> float:
    """PAT (NCCL 2.23+, Simple only, one GPU per node: tuning.cc ncclPatEnable): log-latency
    steps between nodes at a third of a ring's network step, plus the linear part NCCL still
    charges per rank (tuning.cc: log2i(nNodes) x interLat / 3.5 + nRanks x 2.8 us)."""
    return math.ceil(math.log2(m)) * net_step / 3.5 + n * PAT_PER_RANK_S


def _multinode_allreduce(links: Links, proto: Protocol, n: int, r: int, m: int, ramp: float) -> list[Candidate]:
    """Double binary tree across nodes, and hierarchical (intra RS, inter AR per rail, intra AG)."""
    intra_step, net_step = _step(proto, links.intra_lat), _step(proto, links.net_lat)
    tree_lat = 2 * (math.ceil(math.log2(m)) * net_step + (r - 1) * intra_step)
    tree = Candidate("tree", proto.name, tree_lat, 2 * (n - 1) / n / _ring_bw(links, proto, TREE_EFFICIENCY), ramp)
    if r == 1:
        return [tree]
    rail_bw = links.inter_bw / r * proto.net_efficiency()
    intra_bw = links.intra_ring_bw * proto.efficiency
    spb = 2 * (r - 1) / r / intra_bw + 2 * (m - 1) / m / r / rail_bw
    lat = 2 * (r - 1) * intra_step + 2 * (m - 1) * net_step
    return [tree, Candidate("hierarchical", proto.name, lat, spb, ramp)]


def _alltoall_intra(cluster: Cluster, shape: GroupShape) -> float:
    """Seconds per byte to each peer inside a node (routed for all-to-alls only: other ops never ask)."""
    if shape.ranks_per_node == 1:
        return 0.0
    return alltoall_s_per_peer_byte(cluster.fabric_key, shape.local_groups(cluster.domain_gpus))


def _alltoall(links: Links, intra_s_per_peer_byte: float, n: int, r: int, m: int) -> Candidate:
    """Every rank sends S/n to each peer at once: intra-node pairs over the node fabric, the rest over
    NICs. Across nodes each message waits for its receiver to post the buffer (the net transport's
    clear-to-send: one network traversal before the data's), and each network peer costs a message
    (``links.a2a_peer``) at the share of line rate the NICs keep under all-to-all incast."""
    intra = intra_s_per_peer_byte / n / SIMPLE.efficiency
    inter = (n - r) / n / (links.inter_bw / r * links.a2a_efficiency) if m > 1 else 0.0
    lat = ((2 if m > 1 else 1) * _step(SIMPLE, links.net_lat if m > 1 else links.intra_lat)
           + (r - 1) * ALLTOALL_PEER_S + (n - r) * links.a2a_peer)
    return Candidate("direct", "Simple", lat, max(intra, inter))
