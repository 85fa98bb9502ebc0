"""Rank placement: map parallel degrees (TP, EP, DP, PP, ...) onto the GPUs of a cluster.

Ranks are numbered with the first dimension of ``order`` innermost (stride 1), as Megatron and
DeepSpeed do (TP innermost, then EP/DP, then PP); rank r runs on GPU r, and GPU r sits on node
r // gpus_per_node. A process group of one dimension is then "size ranks, ``stride`` apart",
and everything the collective model needs about it fits in a small hashable ``GroupShape``.

A shape's "node" is the NVLink domain (``Cluster.domain_gpus``): the node itself on every
profile but those whose NVLink switch fabric spans several nodes (GB200 NVL72: 18 trays of 4
GPUs), where GPU r sits in domain r // domain_gpus and the last domain may be partial.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from planner.errors import UserError, arg, whole_number
from planner.hardware.cluster import Cluster

DEFAULT_ORDER = ("tp", "ep", "dp", "pp")


class GroupShape(NamedTuple):
    """What one process group looks like on the machine (the same for every group of a dim).

    size: ranks in the group; stride: rank distance between consecutive members;
    ranks_per_node: members on each node (NVLink domain) the group touches, the fewest on any
    where a multi-node domain splits groups unevenly; nodes_spanned: nodes (domains) it touches;
    groups_per_node: groups of this dimension with members on one node, all communicating at
    once and so sharing that node's NICs; leaf_blocks: leaf blocks (fat-tree) it touches;
    pods: spine pods it touches (3-level fabrics).

    A named tuple: immutable and hashable, the key of the collective model's caches.
    """

    size: int
    stride: int
    ranks_per_node: int
    nodes_spanned: int
    groups_per_node: int
    leaf_blocks: int = 1
    pods: int = 1

    @property
    def local_stride(self) -> int:
        """Distance between members on one node (0 when the group has one rank per node)."""
        return self.stride if self.ranks_per_node > 1 else 0

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes_spanned > 1

    @property
    def crosses_spine(self) -> bool:
        return self.leaf_blocks > 1

    def local_groups(self, gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
        """Local GPU indices of every group of this shape on one node (for link contention)."""
        return _local_groups(gpus_per_node, self.stride, self.ranks_per_node)


@functools.lru_cache(maxsize=1024)
def _local_groups(gpus_per_node: int, stride: int, r: int) -> tuple[tuple[int, ...], ...]:
    """``GroupShape.local_groups``: the same for every shape of one stride and ranks per node,
    so built once for the many shapes (sizes across nodes, ops) a search prices. Groups that
    would run past the node's last GPU are left out (a multi-node NVLink domain whose size the
    group's span does not divide; on a node every span divides it)."""
    if r == 1:
        return tuple((i,) for i in range(gpus_per_node))
    span = stride * r
    groups = []
    for block in range(0, gpus_per_node, span):
        for off in range(stride):
            group = tuple(block + off + j * stride for j in range(r))
            if group[-1] < gpus_per_node:
                groups.append(group)
    return tuple(groups)


class Placement:
    """Degrees per dimension, laid out innermost-first over ``cluster``'s GPUs."""

    def __init__(self, cluster: Cluster, dims: dict[str, int], order: tuple[str, ...] | None = None) -> None:
        order = tuple(order) if order is not None else tuple(d for d in DEFAULT_ORDER if d in dims) + tuple(
            d for d in dims if d not in DEFAULT_ORDER
        )
        if sorted(order) != sorted(dims):
            raise UserError(f"placement order {list(order)} must name each dimension of {sorted(dims)} exactly once")
        for name, degree in dims.items():
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise UserError(f"parallel degree {name}={degree!r}: must be a whole number >= 1")
        total = math.prod(dims.values())
        if total != cluster.num_gpus:
            shown = " x ".join(f"{d}={dims[d]}" for d in order)
            raise UserError(
                f"parallel degrees {shown} = {total} GPUs, but the cluster has {cluster.num_gpus} "
                f"({cluster.nodes} nodes x {cluster.gpus_per_node}); make the product equal the GPU count"
            )
        self.cluster = cluster
        self.dims = dict(dims)
        self.order = order
        self._shapes: dict[str, GroupShape] = {}

    def stride(self, dim: str) -> int:
        return math.prod(self.dims[d] for d in self.order[: self.order.index(dim)])

    def ranks(self, dim: str, index: int = 0) -> list[int]:
        """Ranks of the ``index``-th group of ``dim`` (groups numbered by their lowest rank)."""
        return [int(r) for r in self._group_matrix(dim)[index]]

    def group(self, dim: str) -> GroupShape:
        if dim not in self.dims:
            raise UserError(f"unknown parallel dimension {dim!r}; this placement has {list(self.order)}")
        if dim not in self._shapes:
            self._shapes[dim] = strided_shape(self.cluster, self.stride(dim), self.dims[dim], dim)
        return self._shapes[dim]

    def links(self, dim: str) -> tuple[str, ...]:
        """Kinds of link the groups of ``dim`` cross, innermost first (e.g. nvlink, pcie, network, spine)."""
        return links_crossed(self.cluster, self.group(dim))

    def _group_matrix(self, dim: str) -> np.ndarray:
        """All groups of ``dim`` as rows of ranks: (num_gpus / size, size)."""
        sizes = [self.dims[d] for d in reversed(self.order)]  # outermost first, C order
        ranks = np.arange(self.cluster.num_gpus).reshape(sizes)
        axis = len(sizes) - 1 - self.order.index(dim)
        return np.moveaxis(ranks, axis, -1).reshape(-1, self.dims[dim])


@functools.lru_cache(maxsize=1024)
def pipeline_hops(cluster: Cluster, stride: int, pp: int) -> tuple[tuple[bool, ...], GroupShape | None]:
    """Which pipeline hops leave their node, and the shape that prices the ones that do not.

    Pipeline rank r of a group sits at rank base + r * stride; its activations go to rank
    (r + 1) mod pp (the wrap-around is the interleaved schedule's last chunk feeding the next
    virtual stage). With ``stride`` a divisor of the node, consecutive ranks share a node until
    the node ends, so a pp group spanning nodes crosses a network link on some hops only: with
    tp x dp = 2 on 8-GPU nodes, one hop in four. Every group of the dimension looks alike (the
    base is below the stride), so group 0 answers for all. Returns (for each rank r, whether the
    hop r -> r + 1 crosses nodes; a two-rank in-node shape for the other hops, or None when
    every hop crosses or none does). "Node" is the NVLink domain (see the module docstring)."""
    g = cluster.domain_gpus
    node = [(r * stride) // g for r in range(pp)]
    crosses = tuple(node[r] != node[(r + 1) % pp] for r in range(pp))
    if all(crosses) or not any(crosses) or (g % (2 * stride) and cluster.domain_nodes == 1):
        return crosses, None
    return crosses, GroupShape(2, stride, 2, 1, g // 2)


@functools.lru_cache(maxsize=4096)
def strided_shape(cluster: Cluster, stride: int, size: int, what: str = "group") -> GroupShape:
    """The shape of every group of ``size`` ranks ``stride`` apart (one dimension of a layout).

    It depends on the stride and size alone, whatever the other degrees are, so a search that
    lays out hundreds of (tp, ep, dp, pp) combinations computes each shape once.

    Groups that sit inside one node (a single rank, or a whole group in every node-sized
    block, or a cluster no larger than one node) are read off directly: on 16,384 GPUs they
    would otherwise scan thousands of bases. "Node" is the NVLink domain (module docstring)."""
    g = cluster.domain_gpus
    if size == 1 or g % (stride * size) == 0 or cluster.num_gpus <= g:
        return GroupShape(size, stride, size, 1, g // size)
    if cluster.domain_nodes > 1:
        return _domain_shape(cluster, stride, size)
    return _progression_shape(cluster, stride, size) or shape_of(
        cluster, representative_bases(cluster, stride, size), size, stride, what)


def _domain_shape(cluster: Cluster, stride: int, size: int) -> GroupShape:
    """The shape that prices every group of a dimension on a multi-node NVLink domain.

    Domains of 72 GPUs split groups of 16 or 64, and a partial last domain splits others, so
    groups of one dimension can differ: some inside a domain, some across two with 8 and 56
    members. Every group communicates at once and the step waits for the slowest, so the shape
    is the worst group's: the most domains any group touches, and the fewest members any
    group that crosses holds in one domain (its NICs carry the crossing traffic, and its
    members send the largest share of an all-to-all out of their domain). Groups split evenly
    read as the exact shape. Leaves and pods are counted over the groups' nodes, whose NICs
    reach the network (none where every group sits in one domain). Every group is scanned:
    one array of the cluster's ranks."""
    g, dg, ft = cluster.gpus_per_node, cluster.domain_gpus, cluster.fat_tree
    block = stride * size
    bases = (np.arange(cluster.num_gpus // block)[:, None] * block + np.arange(stride)).ravel()
    ranks = bases[:, None] + stride * np.arange(size)
    domains = ranks // dg
    spanned = _distinct_per_row(domains)
    m = int(spanned.max())
    if m == 1:
        return GroupShape(size, stride, size, 1, dg // size)
    r = _fewest_per_run(domains[spanned > 1])
    nodes = ranks // g
    leaves = int(_distinct_per_row(nodes // ft.nodes_per_leaf).max())
    pods = int(_distinct_per_row(nodes // ft.nodes_per_pod).max())
    return GroupShape(size, stride, r, m, dg // r, leaves, pods)


def _fewest_per_run(a: np.ndarray) -> int:
    """The shortest run of equal values in any row of ``a`` (rows sorted)."""
    starts = np.ones(a.shape, dtype=bool)
    starts[:, 1:] = np.diff(a, axis=1) != 0
    first = np.flatnonzero(starts)
    return int(np.diff(np.append(first, a.size)).min())


def _progression_shape(cluster: Cluster, stride: int, size: int) -> GroupShape | None:
    """``shape_of`` in closed form for the layouts whose groups touch nodes in an arithmetic
    progression (None for the others): on 16,384 GPUs the scan builds [groups x size] node
    matrices, a few hundred microseconds a shape. With B = stride x size / g nodes per block
    of groups and K blocks, the groups' first nodes are

    - stride a multiple of the node (one rank per node, members step = stride / g nodes
      apart): a + o B for a < step, o < K;
    - stride a divisor of the node and the block whole nodes (g / stride ranks on each of
      m consecutive nodes, step 1; the base's inner offset is below the stride, so it never
      moves a member to another node): o B for o < K.

    Every group then holds the same number of ranks on each node it touches (none is
    uneven); ``_touched`` counts the leaves and pods. tests/test_cluster.py checks it
    against shape_of."""
    g = cluster.gpus_per_node
    if stride % g == 0:
        per_node, step = 1, stride // g
    elif g % stride == 0 and (stride * size) % g == 0:
        per_node, step = g // stride, 1
    else:
        return None
    m = size // per_node
    blocks, block_nodes = cluster.num_gpus // (stride * size), stride * size // g
    ft = cluster.fat_tree
    leaves, pods = (_touched(per, m, step, block_nodes, blocks, step if per_node == 1 else 1)
                    for per in (ft.nodes_per_leaf, ft.nodes_per_pod))
    return GroupShape(size, stride, per_node, m, g // per_node, leaves, pods)


def _touched(per: int, m: int, step: int, block_nodes: int, blocks: int, run: int) -> int:
    """The most runs of ``per`` nodes (leaves, pods) any group touches, its nodes being
    n, n + step, ..., n + (m - 1) step for first nodes n in o x block_nodes + [0, run), o <
    blocks.

    With step >= per every node is in its own run. Otherwise the last node is (m - 1) step
    = q per + s past the first, so a group touches q + 1 runs, one more when its first node
    sits at s or less before a run's end (n mod per >= per - s). The largest n mod per over
    a range of ``run`` consecutive starts from o x block_nodes is min(per - 1, (o x
    block_nodes) mod per + run - 1), greatest where (o x block_nodes) mod per is: per -
    gcd(block_nodes, per) once o covers every residue."""
    if step >= per:
        return m
    q, s = divmod((m - 1) * step, per)
    if s == 0:
        return q + 1
    d = math.gcd(block_nodes, per)
    top = per - d if blocks >= per // d else max(o * block_nodes % per for o in range(blocks))
    return q + 1 + (min(per - 1, top + run - 1) >= per - s)


def representative_bases(cluster: Cluster, stride: int, size: int) -> np.ndarray:
    """Lowest ranks of groups that between them look like every group of a dimension.

    The groups are {base + j * stride : j < size} with base = inner + outer * stride * size
    (inner < stride: the dims inside this one; outer: the dims outside). Two kinds of group look
    alike, so only one of each is needed (on 16,384 GPUs: tens of rows, not thousands):
    - bases a whole number of pods apart (leaf and pod boundaries repeat with that period):
      the nodes, leaves and pods are those of the other group, shifted;
    - when the stride is a whole number of nodes, inner offsets within one node: every member
      sits on the same node as the matching member of the node-aligned group.
    tests/test_cluster.py checks the shapes against every group's ranks."""
    g, ft = cluster.gpus_per_node, cluster.fat_tree
    period = g * math.lcm(ft.nodes_per_leaf, ft.nodes_per_pod)
    block = stride * size
    outer = np.arange(min(cluster.num_gpus // block, period // math.gcd(block, period))) * block
    inner = np.arange(0, stride, g) if stride % g == 0 else np.arange(stride)
    return (outer[:, None] + inner).ravel()


def shape_of(cluster: Cluster, bases: np.ndarray, size: int, stride: int, what: str = "group") -> GroupShape:
    """Summarise the groups {base + j * stride : j < size} as one GroupShape; groups that split
    unevenly over nodes are refused. ``bases`` may be every group's or representative_bases."""
    g = cluster.gpus_per_node
    ft = cluster.fat_tree
    # Ranks grow along each row, and node, leaf and pod numbers are monotone in the rank.
    nodes = (np.asarray(bases, dtype=np.int64)[:, None] + stride * np.arange(size)) // g
    m, r = _node_split(nodes, size, stride, g, what)
    blocks = int(_distinct_per_row(nodes // ft.nodes_per_leaf).max())
    pods = int(_distinct_per_row(nodes // ft.nodes_per_pod).max())
    return GroupShape(size, stride, r, m, g // r, blocks, pods)


def _node_split(nodes: np.ndarray, size: int, stride: int, g: int, what: str) -> tuple[int, int]:
    """(nodes each group touches, its ranks on each) from rows of the groups' node numbers;
    UserError when groups touch different numbers of nodes or hold unequal shares of them
    (the collective model prices one shape per dimension)."""
    spanned = _distinct_per_row(nodes)
    if spanned.min() != spanned.max() or size % int(spanned[0]):
        raise UserError(
            f"{what} groups of {size} ranks (stride {stride}) split unevenly across nodes of "
            f"{g} GPUs; choose a size that divides {g} or is a multiple of it"
        )
    m = int(spanned[0])
    r = size // m
    if m > 1:
        per_node = nodes.reshape(len(nodes), m, r)
        if not np.all(per_node == per_node[:, :, :1]):
            raise UserError(
                f"{what} groups of {size} ranks split unevenly across nodes (not {r} ranks on each of {m} nodes); "
                f"choose a size that divides {g} or is a multiple of it"
            )
    return m, r


@functools.lru_cache(maxsize=4096)
def splits_evenly(gpus_per_node: int, stride: int, size: int) -> bool:
    """Whether every group of ``size`` ranks ``stride`` apart holds the same number of ranks on
    each node it touches, whatever the cluster's size: what ``shape_of`` requires, checked on
    one group per base residue modulo a node (a search filters layouts with it).

    Bases are inner offsets below the stride plus multiples of stride x size; the node
    pattern depends on a base modulo the GPUs per node only (a whole node further shifts
    every member by one node)."""
    g = gpus_per_node
    block = stride * size
    if size == 1 or stride % g == 0:  # one rank per node
        return True
    if g % stride == 0 and (g % block == 0 or block % g == 0):
        # Node boundaries fall on multiples of the stride, and a group fills whole nodes
        # (g/stride ranks on each) or sits inside one.
        return True
    residues = sorted({(i + k * stride * size) % g for i in range(min(stride, g)) for k in range(g)})
    nodes = (np.array(residues, dtype=np.int64)[:, None] + stride * np.arange(size)) // g
    try:
        _node_split(nodes, size, stride, g, "group")
    except UserError:
        return False
    return True


def links_crossed(cluster: Cluster, shape: GroupShape) -> tuple[str, ...]:
    """Link kinds a group's traffic crosses: the node fabric, then NIC, leaf and spine."""
    from planner.hardware.routing import path_kinds

    kinds: list[str] = []
    if shape.ranks_per_node > 1:
        kinds += path_kinds(cluster.fabric_key, shape.local_groups(cluster.domain_gpus)[0])
    if shape.crosses_nodes:
        kinds += ["pcie", "network"] if "pcie" not in kinds else ["network"]
        if shape.crosses_spine:
            kinds.append("spine")
    return tuple(kinds)


def _distinct_per_row(a: np.ndarray) -> np.ndarray:
    """Distinct values in each row of ``a``, whose rows are sorted."""
    return 1 + np.count_nonzero(np.diff(a, axis=1), axis=1)


def contiguous_shape(cluster: Cluster, size: int) -> GroupShape:
    """The shape of ``size`` consecutive ranks (a TP-like group: the input ``group_size``), for
    one-off queries."""
    size, what = whole_number("group_size", size), arg("group_size")
    if size > cluster.num_gpus:
        raise UserError(
            f"{what} {size} is larger than the cluster ({cluster.num_gpus} GPUs on {cluster.nodes} "
            f"nodes); use a smaller group or more {arg('nodes')}"
        )
    if cluster.num_gpus % size:
        raise UserError(
            f"{what} {size} does not divide the cluster's {cluster.num_gpus} GPUs into whole groups; "
            f"use a divisor of {cluster.num_gpus}"
        )
    return strided_shape(cluster, 1, size, what)
