"""Cluster: a hardware profile times a node count, as a topology graph.

The graph (networkx) holds GPUs, the intra-node fabric (one NVSwitch hub, NVLink/xGMI mesh
links, or the PCIe switch tree with its CPU sockets), NICs with their GPU affinity, and the
leaf/spine fat-tree between nodes. Edges carry ``bw`` (bytes/s per direction), ``latency``
(seconds) and ``kind``. Every node of a cluster is identical, so the collective model only
ever routes inside *one* node's graph (``node_graph``, a few dozen vertices, cached per
profile); the full graph is built lazily, for drawing and inspection only: 2048 nodes x 8
GPUs would be ~40k vertices and the planner builds a Cluster on every ``suggest`` run.

The routing hot path reads ``NodeFabric``, the same node graph as plain dicts, so ``suggest``
never imports networkx (~0.2 s of a sub-second budget). Both are built by one function
(``_add_node``), so they cannot drift apart.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from planner import limits
from planner.errors import UserError, arg
from planner.hardware.node_fabric import NodeFabric
from planner.hardware.profile import HardwareProfile

if TYPE_CHECKING:  # networkx costs ~0.2 s to import: only where a graph is built
    import networkx as nx

_INTRA_LINK_KIND = {
    "nvswitch": "nvlink", "nvlink_mesh": "nvlink", "xgmi_mesh": "xgmi", "infinity_fabric": "xgmi", "pcie": "pcie",
}
# A dual-socket host: the socket interconnect (UPI / Infinity Fabric) is taken as two PCIe
# x16 links wide. Assumption: the profile schema has no field for it; it only matters for
# PCIe-only nodes whose rings cross sockets.
SOCKET_LINK_PCIE_WIDTHS = 2.0


@dataclass(frozen=True)
class FatTree:
    """Sizing of the leaf/spine network for a node count (per the profile's radix and ratio)."""

    downlinks_per_leaf: int  # ports facing NICs
    uplinks_per_leaf: int  # ports facing spines (downlinks / oversubscription)
    nodes_per_leaf: int  # nodes whose NICs (one rail of them when rail-optimized) share a leaf
    leaves: int
    spines: int
    nodes_per_pod: int  # nodes reachable through one spine layer (3-level fabrics add a core hop beyond)

    def block(self, node: int) -> int:
        """Leaf block of a node: nodes in one block reach each other without crossing a spine."""
        return node // self.nodes_per_leaf


def fat_tree(profile: HardwareProfile, nodes: int) -> FatTree:
    """Size a two-level fat-tree: a leaf splits its radix into down and up ports by the ratio."""
    fab, nics = profile.fabric, profile.node.nics.count
    down = max(1, int(fab.switch_radix * fab.oversubscription / (1.0 + fab.oversubscription)))
    up = max(1, fab.switch_radix - down)
    per_leaf = down if fab.rail_optimized else max(1, down // nics)
    if nodes <= 1:
        return FatTree(down, up, per_leaf, 0, 0, per_leaf * fab.switch_radix)
    blocks = math.ceil(nodes / per_leaf)
    leaves = blocks * (nics if fab.rail_optimized else 1)
    spines = 0 if blocks == 1 else math.ceil(leaves * up / fab.switch_radix)
    return FatTree(down, up, per_leaf, leaves, spines, per_leaf * fab.switch_radix)


class Cluster:
    """``nodes`` identical machines of one profile. Hashable by (profile, nodes)."""

    def __init__(self, profile: HardwareProfile, nodes: int) -> None:
        self.rack_nodes = profile.node.nvlink_domain_nodes  # the physical domain; the job's may be fewer
        profile = profile.for_job(nodes)
        self.profile = profile
        self.nodes = nodes
        self.gpus_per_node = profile.node.gpus
        self.num_gpus = nodes * self.gpus_per_node
        # The collective model's "node": the NVLink domain (nodes sharing an NVLink switch
        # fabric, as many of each as the job takes: HardwareProfile.for_job); one node where
        # the profile has no multi-node domain.
        self.domain_nodes = profile.node.nvlink_domain_nodes
        self.domain_gpus = profile.nvlink_domain_gpus
        self.fat_tree = fat_tree(profile, nodes)
        self.key = (profile.model_dump_json(), nodes)
        _PROFILES.setdefault(self.key[0], profile)
        # What the routing reads: one domain's graph, the node's where the domain is one node.
        domain = domain_profile(profile)
        self.fabric_key = self.key[0] if domain is profile else domain.model_dump_json()
        _PROFILES.setdefault(self.fabric_key, domain)
        self._graph: nx.Graph | None = None

    @classmethod
    def build(cls, profile: HardwareProfile, nodes: int) -> "Cluster":
        """``nodes`` of ``profile``, checked: a whole number, and at most limits.MAX_GPUS GPUs in all."""
        nodes = limits.count("nodes", nodes)
        gpus = nodes * profile.node.gpus
        if gpus > limits.MAX_GPUS:
            most = limits.MAX_GPUS // profile.node.gpus
            raise UserError(f"{arg('nodes')} {nodes:,} x {profile.node.gpus} GPUs per node = {gpus:,} GPUs is above "
                            f"the largest supported {limits.MAX_GPUS:,} ({limits.BOUNDS['gpus'].why}); "
                            f"give at most {most:,} nodes of {profile.name}")
        return cls(profile, nodes)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.key == other.key

    def __repr__(self) -> str:
        return f"Cluster({self.profile.name!r}, nodes={self.nodes}, gpus={self.num_gpus})"

    # --- per-link facts in SI units -------------------------------------------------------
    @property
    def intra_bw(self) -> float:
        """Bytes/s per direction per GPU into the intra-node fabric."""
        return self.profile.node.intra.bw_GBps * 1e9

    @property
    def intra_latency_s(self) -> float:
        return self.profile.node.intra.latency_us * 1e-6

    @property
    def nvlink_gpus(self) -> int:
        """GPUs a process group reaches over NVLink alone: one domain's, or the cluster's when smaller."""
        return min(self.domain_gpus, self.num_gpus)

    @property
    def nic_bw(self) -> float:
        return self.profile.node.nics.bw_bytes_per_s

    @property
    def nic_bw_per_gpu(self) -> float:
        return self.profile.nic_bw_per_gpu

    @property
    def nvls(self) -> bool:
        return self.profile.node.intra.kind == "nvswitch" and self.profile.node.intra.nvls

    @property
    def levels(self) -> int:
        """Switch levels of the fabric: the profile's, plus a core layer where the nodes
        outgrow one leaf/spine pod (a 2-level fabric of radix 40 reaches 800 rail-optimized
        nodes; 2,048 nodes cannot be wired without one)."""
        lv = self.profile.fabric.levels
        return 3 if (lv == 2 and self.nodes > self.fat_tree.nodes_per_pod) else lv

    def switch_hops(self, spans_blocks: bool, spans_pods: bool = False) -> int:
        """Switches a message crosses between two nodes: leaf; leaf-spine-leaf; via core."""
        if spans_pods and self.levels >= 3:
            return 5
        return 3 if spans_blocks else 1

    def net_latency_s(self, spans_blocks: bool, spans_pods: bool = False) -> float:
        """One network step: NIC + proxy at both ends, plus the switch hops between."""
        p = self.profile
        return p.node.nics.latency_us * 1e-6 + self.switch_hops(spans_blocks, spans_pods) * p.fabric.latency_us * 1e-6

    # --- graphs ---------------------------------------------------------------------------
    @property
    def node_graph(self) -> nx.Graph:
        """One node's graph (GPUs, intra fabric, NICs); shared by every Cluster of the profile."""
        return _node_graph(self.profile.model_dump_json())

    @property
    def node_fabric(self) -> "NodeFabric":
        """``node_graph`` as plain dicts (no networkx import); what the routing reads."""
        return node_fabric(self.profile.model_dump_json())

    @property
    def graph(self) -> nx.Graph:
        """The whole cluster, built on first use (for drawing and inspection, not the hot path)."""
        if self._graph is None:
            self._graph = build_graph(self.profile, self.nodes, self.fat_tree)
        return self._graph

    # --- summary --------------------------------------------------------------------------
    def link_counts(self) -> dict[str, int]:
        """Edges of the graph by kind, counted without building it."""
        per_node = _edge_kinds(self.node_fabric)
        counts = {kind: n * self.nodes for kind, n in per_node.items()}
        if self.nodes > 1:
            counts["network"] = self.nodes * self.profile.node.nics.count
            ft = self.fat_tree
            if ft.spines:
                counts["spine"] = ft.leaves * min(ft.uplinks_per_leaf, ft.spines)
        return counts

    def intra_bisection_bw(self) -> float:
        """Bytes/s per direction across the worst half/half cut of the GPUs of one node."""
        g = self.node_graph
        gpus = [f"n0.gpu{i}" for i in range(self.gpus_per_node)]
        half = set(gpus[: len(gpus) // 2])
        if len(gpus) < 2:
            return 0.0
        return _cut_bw(g, half, set(gpus) - half)

    def network_bisection_bw(self) -> float:
        """Bytes/s per direction between two halves of the nodes (0 for one node)."""
        if self.nodes < 2:
            return 0.0
        half_nics = (self.nodes // 2) * self.profile.node.nics.count * self.nic_bw
        crosses_spine = self.nodes > self.fat_tree.nodes_per_leaf
        return half_nics / (self.profile.fabric.oversubscription if crosses_spine else 1.0)

    def summary(self) -> dict:
        p, ft = self.profile, self.fat_tree
        return {
            "hardware": p.name,
            "nodes": self.nodes,
            "gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "intra_node_fabric": p.node.intra.kind,
            "intra_bw_per_gpu_GBps": p.node.intra.bw_GBps,
            "nvls": self.nvls,
            "nvlink_domain_nodes": self.rack_nodes,
            "nvlink_domain_gpus": self.rack_nodes * self.gpus_per_node,
            "segment_nodes": self.domain_nodes,
            "nvlink_domains": -(-self.nodes // self.domain_nodes),
            "nics_per_node": p.node.nics.count,
            "nic_GBps": self.nic_bw / 1e9,
            "nic_bw_per_gpu_GBps": self.nic_bw_per_gpu / 1e9,
            "links_by_type": self.link_counts(),
            "intra_node_bisection_GBps": self.intra_bisection_bw() / 1e9,
            "bisection_bw_GBps": self.network_bisection_bw() / 1e9,
            "oversubscription": p.fabric.oversubscription,
            "fabric": p.fabric.kind,
            "rail_optimized": p.fabric.rail_optimized,
            "leaf_switches": ft.leaves,
            "spine_switches": ft.spines,
            "nodes_per_leaf": ft.nodes_per_leaf,
            "levels": self.levels,
            "nodes_per_pod": ft.nodes_per_pod,
        }


# --- graph construction -------------------------------------------------------------------


def _cut_bw(g: nx.Graph, a: set[str], b: set[str]) -> float:
    """Max flow between two GPU sets with every edge's per-direction bandwidth as capacity."""
    import networkx as nx

    d = _capacity_digraph(g)
    for n in a:
        d.add_edge("src", n, capacity=float("inf"))
    for n in b:
        d.add_edge(n, "dst", capacity=float("inf"))
    return float(nx.maximum_flow_value(d, "src", "dst"))


def _capacity_digraph(g: nx.Graph) -> nx.DiGraph:
    import networkx as nx

    d = nx.DiGraph()
    for u, v, data in g.edges(data=True):
        d.add_edge(u, v, capacity=data["bw"])
        d.add_edge(v, u, capacity=data["bw"])
    return d


def _edge_kinds(g: NodeFabric) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, _, data in g.edges():
        counts[data["kind"]] = counts.get(data["kind"], 0) + 1
    return counts


# Each cluster's (frozen) profile by its JSON, the key the routing caches use: node_fabric then
# reads the profile it was built from rather than validating the JSON again.
_PROFILES: dict[str, HardwareProfile] = {}


def domain_profile(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with one NVLink domain as its node: the domain's GPUs on one switch, each
    with its own node's NICs (what the collective model routes); ``profile`` itself when the
    domain is one node. Not validated again: every field is the profile's, scaled."""
    node, domain = profile.node, profile.node.nvlink_domain_nodes
    if domain == 1:
        return profile
    nics = node.nics.model_copy(update={"count": node.nics.count * domain})
    whole = node.model_copy(update={"gpus": node.gpus * domain, "nics": nics, "nvlink_domain_nodes": 1})
    return profile.model_copy(update={"node": whole})


@functools.lru_cache(maxsize=32)
def node_fabric(profile_json: str) -> NodeFabric:
    """One node's graph (GPUs ``n0.gpuI``, fabric, NICs) as plain data; cached per profile."""
    g = NodeFabric()
    profile = _PROFILES.get(profile_json) or HardwareProfile.model_validate_json(profile_json)
    _add_node(g, profile, 0)
    return g


@functools.lru_cache(maxsize=32)
def _node_graph(profile_json: str) -> nx.Graph:
    import networkx as nx

    profile = HardwareProfile.model_validate_json(profile_json)
    g = nx.Graph()
    _add_node(g, profile, 0)
    return g


def nic_gpus(profile: HardwareProfile, nic: int) -> list[int]:
    """Local GPUs that share a PCIe switch with NIC ``nic`` (its GPUDirect affinity)."""
    gpus, count = profile.node.gpus, profile.node.nics.count
    if count <= gpus:
        per = gpus // count
        return list(range(nic * per, (nic + 1) * per))
    return [nic // (count // gpus)]


def _add_node(g: "nx.Graph | NodeFabric", profile: HardwareProfile, n: int) -> None:
    node, intra = profile.node, profile.node.intra
    lat, bw = intra.latency_us * 1e-6, intra.bw_GBps * 1e9
    kind = _INTRA_LINK_KIND[intra.kind]
    gpus = [f"n{n}.gpu{i}" for i in range(node.gpus)]
    for i, name in enumerate(gpus):
        g.add_node(name, role="gpu", node=n, local=i)
    pcie_bw, nic_bw = node.pcie_GBps * 1e9, node.nics.bw_bytes_per_s
    if intra.kind == "pcie":
        per_switch = intra.gpus_per_pcie_switch or 2
        switches = math.ceil(node.gpus / per_switch)
        sockets = 2 if switches >= 2 else 1
        for s in range(switches):
            sw, cpu = f"n{n}.pcie{s}", f"n{n}.cpu{s * sockets // switches}"
            g.add_node(sw, role="pcie_switch", node=n)
            g.add_node(cpu, role="cpu", node=n)
            g.add_edge(sw, cpu, bw=pcie_bw, latency=lat / 2, kind="pcie")
        for i, name in enumerate(gpus):
            g.add_edge(name, f"n{n}.pcie{i // per_switch}", bw=bw, latency=lat / 2, kind="pcie")
        if sockets == 2:
            g.add_edge(f"n{n}.cpu0", f"n{n}.cpu1", bw=SOCKET_LINK_PCIE_WIDTHS * pcie_bw, latency=lat / 2, kind="socket")
        for j in range(node.nics.count):
            sw = f"n{n}.pcie{nic_gpus(profile, j)[0] // per_switch}"
            g.add_node(f"n{n}.nic{j}", role="nic", node=n)
            g.add_edge(f"n{n}.nic{j}", sw, bw=min(nic_bw, pcie_bw), latency=0.0, kind="pcie")
        return
    if intra.kind == "nvswitch":
        # The nodes of one multi-node NVLink domain share its switch fabric (NVL72's switch trays).
        domain = node.nvlink_domain_nodes
        hub = f"n{n}.nvswitch" if domain == 1 else f"nvl{n // domain}.nvswitch"
        g.add_node(hub, role="nvswitch", node=n if domain == 1 else n // domain * domain)
        for name in gpus:
            g.add_edge(name, hub, bw=bw, latency=lat / 2, kind=kind)
    else:  # point-to-point mesh: a circulant graph of links_per_gpu links per GPU
        links = min(intra.links_per_gpu or node.gpus - 1, node.gpus - 1)
        for i in range(node.gpus):
            for off in _mesh_offsets(node.gpus, links):
                j = (i + off) % node.gpus
                if not g.has_edge(gpus[i], gpus[j]):
                    g.add_edge(gpus[i], gpus[j], bw=bw / links, latency=lat, kind=kind)
    for j in range(node.nics.count):
        g.add_node(f"n{n}.nic{j}", role="nic", node=n)
        for i in nic_gpus(profile, j):
            g.add_edge(f"n{n}.nic{j}", gpus[i], bw=min(nic_bw, pcie_bw), latency=0.0, kind="pcie")


def _mesh_offsets(gpus: int, links: int) -> Iterable[int]:
    """Neighbour offsets of a circulant mesh: +-1, +-2, ... and the opposite GPU for odd counts."""
    offsets = list(range(1, links // 2 + 1))
    if links % 2:
        offsets.append(gpus // 2)
    return offsets


def build_graph(profile: HardwareProfile, nodes: int, ft: FatTree | None = None) -> nx.Graph:
    """The full cluster graph: every node plus the leaf/spine network."""
    import networkx as nx

    ft = ft or fat_tree(profile, nodes)
    g = nx.Graph()
    for n in range(nodes):
        _add_node(g, profile, n)
    if nodes < 2:
        return g
    fab, nics = profile.fabric, profile.node.nics
    hop = fab.latency_us * 1e-6
    for n in range(nodes):
        for j in range(nics.count):
            leaf = f"leaf{ft.block(n)}.r{j}" if fab.rail_optimized else f"leaf{ft.block(n)}"
            g.add_node(leaf, role="leaf")
            g.add_edge(f"n{n}.nic{j}", leaf, bw=nics.bw_bytes_per_s, latency=hop, kind="network")
    if ft.spines:
        leaves = [v for v, role in g.nodes(data="role") if role == "leaf"]
        fanout = min(ft.uplinks_per_leaf, ft.spines)
        bundle = ft.uplinks_per_leaf * nics.bw_bytes_per_s / fanout
        for i, leaf in enumerate(sorted(leaves)):
            for k in range(fanout):
                spine = f"spine{(i * fanout + k) % ft.spines}"
                g.add_node(spine, role="spine")
                g.add_edge(leaf, spine, bw=bundle, latency=hop, kind="spine")
    return g
