"""NodeFabric: one node's topology as plain dicts, for the routing hot path.

The same vertices and edges as the networkx node graph (both are built by
planner.hardware.cluster._add_node), with the few operations routing needs. It exists so that
``dsplan suggest`` never imports networkx (~0.2 s of a sub-second budget).
"""

from __future__ import annotations

from typing import Iterable


class NodeFabric:
    """An undirected graph as insertion-ordered dicts, with the few operations the routing needs.

    It mirrors networkx's ``Graph`` where that matters for identical results: vertices and
    neighbours keep insertion order, both directions share one attribute dict, and
    ``shortest_path`` is the same bidirectional breadth-first search ``nx.shortest_path``
    runs on unweighted graphs, so ties between equally short routes break the same way.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}
        self.adj: dict[str, dict[str, dict]] = {}

    def add_node(self, name: str, **attrs) -> None:
        if name not in self.nodes:
            self.nodes[name], self.adj[name] = {}, {}
        self.nodes[name].update(attrs)

    def add_edge(self, u: str, v: str, **attrs) -> None:
        for name in (u, v):
            if name not in self.nodes:
                self.add_node(name)
        data = self.adj[u].get(v, {})
        data.update(attrs)
        self.adj[u][v] = self.adj[v][u] = data

    def has_edge(self, u: str, v: str) -> bool:
        return u in self.adj and v in self.adj[u]

    def edge(self, u: str, v: str) -> dict:
        return self.adj[u][v]

    def edges(self) -> Iterable[tuple[str, str, dict]]:
        """Each edge once, in networkx's order (by first endpoint, then neighbour order)."""
        seen: set[str] = set()
        for u, nbrs in self.adj.items():
            for v, data in nbrs.items():
                if v not in seen:
                    yield u, v, data
            seen.add(u)

    def with_role(self, *roles: str) -> list[str]:
        return [v for v, attrs in self.nodes.items() if attrs.get("role") in roles]

    def shortest_path(self, source: str, target: str) -> list[str]:
        """Fewest-hop route; grows the smaller frontier of two searches until they meet."""
        if source == target:
            return [source]
        fwd: dict[str, str | None] = {source: None}
        back: dict[str, str | None] = {target: None}
        fwd_level, back_level = [source], [target]
        meet = None
        while meet is None and fwd_level and back_level:
            forward = len(fwd_level) <= len(back_level)
            level, here, there = (fwd_level, fwd, back) if forward else (back_level, back, fwd)
            grown: list[str] = []
            for v in level:
                for w in self.adj[v]:
                    if w not in here:
                        here[w] = v
                        grown.append(w)
                    if w in there:
                        meet = w
                        break
                if meet is not None:
                    break
            if forward:
                fwd_level = grown
            else:
                back_level = grown
        if meet is None:
            raise ValueError(f"no path between {source} and {target}")
        head: list[str] = []
        w: str | None = meet
        while w is not None:
            head.append(w)
            w = fwd[w]
        head.reverse()
        w = back[meet]
        while w is not None:
            head.append(w)
            w = back[w]
        return head
