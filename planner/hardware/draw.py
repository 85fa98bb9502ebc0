"""Draw a cluster: Graphviz dot text, or a PNG through matplotlib (an optional extra).

Small clusters are drawn in full (every GPU, switch and NIC). Past ``FULL_DRAW_MAX_NODES``
nodes the picture would be unreadable, so each node becomes one box (its GPUs and fabric in
the label) and the network shows its leaf and spine switches. Files are written atomically.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from planner.atomic import replace_atomically, write_bytes_atomically
from planner.errors import UserError, arg
from planner.hardware.cluster import Cluster

FULL_DRAW_MAX_NODES = 4
_COLORS = {"gpu": "#76b900", "nvswitch": "#1f77b4", "pcie_switch": "#9467bd", "cpu": "#8c564b",
           "nic": "#ff7f0e", "leaf": "#d62728", "spine": "#7f7f7f", "node": "#2ca02c"}


def drawing_graph(cluster: Cluster) -> nx.Graph:
    """The graph to draw: the full graph when small, else one vertex per node plus switches."""
    if cluster.nodes <= FULL_DRAW_MAX_NODES:
        return cluster.graph
    p, ft = cluster.profile, cluster.fat_tree
    g = nx.Graph()
    label = (f"{p.node.gpus}x {p.gpu.name}\\n{p.node.intra.kind} {p.node.intra.bw_GBps:g} GB/s\\n"
             f"{p.node.nics.count}x {p.node.nics.speed_gbit:g} Gb/s NIC")
    blocks = range(ft.block(cluster.nodes - 1) + 1)
    for b in blocks:
        first, last = b * ft.nodes_per_leaf, min(cluster.nodes, (b + 1) * ft.nodes_per_leaf) - 1
        nodes = f"nodes{first}-{last}"
        g.add_node(nodes, role="node", label=f"nodes {first}..{last}\\n{label}")
        leaf = f"leaf{b}"
        rails = p.node.nics.count if p.fabric.rail_optimized else 1
        g.add_node(leaf, role="leaf", label=f"leaf block {b}\\n{rails} leaf switch(es)")
        g.add_edge(nodes, leaf, kind="network", bw=(last - first + 1) * p.node.nics.count * cluster.nic_bw)
    if ft.spines:
        g.add_node("spines", role="spine", label=f"{ft.spines} spine switches\\n{p.fabric.oversubscription:g}:1")
        for b in blocks:
            g.add_edge(f"leaf{b}", "spines", kind="spine", bw=0.0)
    return g


def to_dot(cluster: Cluster) -> str:
    g = drawing_graph(cluster)
    p = cluster.profile
    lines = [f'graph "{p.name} x{cluster.nodes}" {{', "  graph [overlap=false, splines=true];",
             '  node [style=filled, fontname="Helvetica", fontsize=10];']
    for v, data in g.nodes(data=True):
        role = data.get("role", "gpu")
        label = data.get("label", v)
        lines.append(f'  "{v}" [label="{label}", fillcolor="{_COLORS.get(role, "#cccccc")}", '
                     f'shape={"box" if role != "gpu" else "ellipse"}];')
    for u, v, data in g.edges(data=True):
        bw = data.get("bw", 0.0)
        label = f' [label="{data.get("kind", "")} {bw / 1e9:g} GB/s"]' if bw else f' [label="{data.get("kind", "")}"]'
        lines.append(f'  "{u}" -- "{v}"{label};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(cluster: Cluster, path: str | Path) -> Path:
    return _atomic_write(Path(path), to_dot(cluster).encode())


def write_png(cluster: Cluster, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(f"{arg('draw')} needs matplotlib: pip install 'dsplan[plot]' (or use {arg('dot')} for a "
                        "Graphviz file)") from None
    g = drawing_graph(cluster)
    pos = _layout(g)
    fig, ax = plt.subplots(figsize=(12, 8))
    colors = [_COLORS.get(role or "gpu", "#cccccc") for _, role in g.nodes(data="role")]
    nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.4)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colors, node_size=300 if g.number_of_nodes() < 80 else 60)
    if g.number_of_nodes() <= 80:
        labels = {v: str(data.get("label", v)).replace("\\n", "\n") for v, data in g.nodes(data=True)}
        nx.draw_networkx_labels(g, pos, labels=labels, ax=ax, font_size=7)
    ax.set_title(f"{cluster.profile.name}: {cluster.nodes} node(s), {cluster.num_gpus} GPUs")
    ax.axis("off")
    path = Path(path)
    try:
        replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


def _layout(g: nx.Graph) -> dict:
    """Layers top to bottom: spines, leaves, NICs, switches/CPUs, GPUs (or node boxes)."""
    layer = {"spine": 0, "leaf": 1, "nic": 2, "node": 2, "cpu": 3, "nvswitch": 3, "pcie_switch": 4, "gpu": 5}
    rows: dict[int, list] = {}
    for v, role in g.nodes(data="role"):  # insertion order keeps each node's parts together
        rows.setdefault(layer.get(role or "gpu", 5), []).append(v)
    pos = {}
    for y, members in rows.items():
        for i, v in enumerate(members):
            pos[v] = ((i + 0.5) / len(members), -float(y))
    return pos


def _atomic_write(path: Path, data: bytes) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{path}: directory {parent} does not exist")
    return write_bytes_atomically(path, data)
