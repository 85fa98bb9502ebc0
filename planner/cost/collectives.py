"""Collective communication time over the cluster topology, in nccl-tests conventions.

``nbytes`` is the buffer size as nccl-tests reports it: the full buffer per rank for
all-reduce and broadcast, the whole gathered / scattered buffer for all-gather and
reduce-scatter, the send buffer for all-to-all, the message for p2p. Bus bandwidth follows
nccl-tests' PERFORMANCE.md: all-reduce algbw x 2(n-1)/n; all-gather, reduce-scatter and
all-to-all algbw x (n-1)/n; broadcast and p2p algbw.

Hot path: the planner asks hundreds of thousands of times. The topology work (routing,
bottlenecks, candidate algorithms) is cached per (cluster, op, shape, nvls); a query after
that is a handful of multiply-adds, and ``collective_time_array`` does many sizes at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.cost.nccl_algorithms import CALL_OVERHEAD_S, Candidate, candidates, links_for
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, contiguous_shape

OPS = ("allreduce", "reducescatter", "allgather", "alltoall", "p2p", "broadcast")
_ALIASES = {
    "all_reduce": "allreduce", "all-reduce": "allreduce", "reduce_scatter": "reducescatter",
    "reduce-scatter": "reducescatter", "all_gather": "allgather", "all-gather": "allgather",
    "all_to_all": "alltoall", "all-to-all": "alltoall", "sendrecv": "p2p", "send_recv": "p2p",
}


@dataclass(frozen=True)
class CollectiveCost:
    op: str
    group_size: int
    nbytes: float
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    algorithm: str  # e.g. "ring/Simple", "nvls/Simple", "tree/LL128"
    latency_s: float  # the size-independent part (call overhead + steps)
    bottleneck: str  # the link that limits bandwidth

    def as_dict(self) -> dict:
        return {
            "op": self.op, "group_size": self.group_size, "bytes": self.nbytes, "time_s": self.time_s,
            "algbw_GBps": self.algbw_GBps, "busbw_GBps": self.busbw_GBps, "algorithm": self.algorithm,
            "latency_s": self.latency_s, "bottleneck": self.bottleneck,
        }


def normalize_op(op: str) -> str:
    key = str(op).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in OPS:
        raise UserError(f"unknown collective {op!r}; use one of {', '.join(OPS)}")
    return key


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw, as nccl-tests defines it."""
    if n <= 1:
        return 0.0
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("reducescatter", "allgather", "alltoall"):
        return (n - 1) / n
    return 1.0


@functools.lru_cache(maxsize=65536)
def _plan(cluster: Cluster, op: str, shape: GroupShape, nvls: bool) -> tuple[tuple[Candidate, ...], tuple, str]:
    """Candidates, their numbers as plain tuples (fast to evaluate), and the bottleneck name.

    Computed once per (cluster, op, shape, nvls); every later query is arithmetic only.
    """
    cands = candidates(cluster, op, shape, nvls)
    terms = tuple(
        (CALL_OVERHEAD_S + c.latency_s, c.spb, c.ramp_bytes, c.fill * c.spb, c.fill_cap_bytes) for c in cands
    )
    return cands, terms, links_for(cluster, shape).bottleneck


def collective_time(
    cluster: Cluster, op: str, shape: GroupShape, nbytes: float, nvls: bool | None = None
) -> CollectiveCost:
    """Predicted time of one collective; ``nvls=False`` forces NVLS off (NCCL_NVLS_ENABLE=0)."""
    if op not in OPS:
        op = normalize_op(op)
    n = shape.size
    if n <= 1 or nbytes <= 0:
        return CollectiveCost(op, n, nbytes, 0.0, 0.0, 0.0, "none", 0.0, "")
    cands, terms, bottleneck = _plan(cluster, op, shape, cluster.nvls if nvls is None else bool(nvls))
    t, best = float("inf"), 0
    for i, (lat, spb, ramp, fill_spb, cap) in enumerate(terms):
        ti = lat + spb * (nbytes if nbytes > ramp else ramp) + fill_spb * (nbytes if nbytes < cap else cap)
        if ti < t:
            t, best = ti, i
    c = cands[best]
    algbw = nbytes / t / 1e9
    return CollectiveCost(
        op, n, nbytes, t, algbw, algbw * bus_factor(op, n), f"{c.algorithm}/{c.protocol}", terms[best][0], bottleneck
    )


def collective_seconds(cluster: Cluster, op: str, shape: GroupShape, nbytes: float, nvls: bool | None = None) -> float:
    """Just the time in seconds: the leanest call for the search's inner loop."""
    if op not in OPS:
        op = normalize_op(op)
    if shape.size <= 1 or nbytes <= 0:
        return 0.0
    _, terms, _ = _plan(cluster, op, shape, cluster.nvls if nvls is None else bool(nvls))
    return min(
        lat + spb * (nbytes if nbytes > ramp else ramp) + fill_spb * (nbytes if nbytes < cap else cap)
        for lat, spb, ramp, fill_spb, cap in terms
    )


def collective_time_array(
    cluster: Cluster, op: str, shape: GroupShape, nbytes: np.ndarray, nvls: bool | None = None
) -> np.ndarray:
    """Seconds for many buffer sizes at once (the fastest candidate per size)."""
    if op not in OPS:
        op = normalize_op(op)
    s = np.asarray(nbytes, dtype=float)
    if shape.size <= 1:
        return np.zeros_like(s)
    lat, spb, ramp, fill_spb, cap = _term_arrays(cluster, op, shape, cluster.nvls if nvls is None else bool(nvls))
    flat = s.reshape(1, -1)
    times = lat + spb * np.maximum(flat, ramp) + fill_spb * np.minimum(flat, cap)
    return np.where(s > 0, times.min(axis=0).reshape(s.shape), 0.0)


def collective_times_keyed(cluster: Cluster, pairs: list[tuple[str, GroupShape]], which: np.ndarray,
                           sizes: np.ndarray) -> np.ndarray:
    """``collective_time_array`` of each size with the (op, shape) ``pairs[which]`` (-1: nothing,
    zero seconds), every pair in one pass. Made for a few candidates over many sizes: the
    candidates lead, so the fastest is an elementwise minimum of a handful of arrays. The same
    terms, elementwise, so equal to one call per pair."""
    nvls = cluster.nvls
    columns = [_term_rows(cluster, op, shape, nvls) if shape.size > 1 else _NO_TERMS for op, shape in pairs]
    width = max([n for n, _, _ in columns] + [1])
    fill = any(f for _, f, _ in columns)  # NVLS's pipeline fill; zero seconds for every other candidate
    # [pair, term, candidate], the last pair (-1) costing nothing; the fill terms only if some pair has one.
    rows = np.concatenate([r for _, _, r in columns] + [_NO_TERMS[2]]).reshape(len(pairs) + 1, _MAX_CANDIDATES, 5)
    terms = rows.transpose(0, 2, 1)[:, :5 if fill else 3, :width]
    live = sizes > 0
    if sizes.size < _COMPRESS_MIN:
        full = which if which.shape == sizes.shape else np.broadcast_to(which, sizes.shape)
        return np.where(live, _fastest(np.take(terms.transpose(1, 2, 0), full, axis=2), sizes), 0.0)
    return _fastest_live(terms, which, sizes, live)


# Sizes from which collective_times_keyed prices only the positive sizes: most of a large
# request is zero bytes (no experts, no tied weights).
_COMPRESS_MIN = 1024


def _fastest_live(terms: np.ndarray, which: np.ndarray, sizes: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``collective_times_keyed`` over the ``live`` sizes only, as flat arrays; zero elsewhere.
    The pairs' rows are taken whole (one copy each) and turned candidate-major in one copy."""
    full = np.empty(sizes.shape, dtype=np.int64)
    full[...] = which
    out = np.zeros(sizes.shape)
    out[live] = _fastest(np.take(terms, full[live], axis=0).transpose(1, 2, 0).copy(), sizes[live])
    return out


def _fastest(terms: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The fastest candidate's seconds per size; ``terms`` is [term, candidate, *sizes.shape]."""
    lat, spb, ramp, *fill = terms
    times = lat + spb * np.maximum(sizes, ramp)
    if fill:
        times += fill[0] * np.minimum(sizes, fill[1])
    return np.minimum.reduce(times, axis=0)


def collective_times_numbered(cluster: Cluster, key_of: Callable[[int], tuple[str, GroupShape]], which: np.ndarray,
                              sizes: np.ndarray) -> np.ndarray:
    """``collective_times_keyed`` with the (op, shape) pairs named by numbers: ``key_of(k)`` is
    asked only for the numbers ``which`` holds (-1: nothing, zero seconds), so a caller can
    number every pair it might price and build only the group shapes it needs."""
    used = sorted(set(which.ravel().tolist()) - {-1})
    pair = np.searchsorted(np.array(used, dtype=np.int64), which)
    pair[which < 0] = -1
    return collective_times_keyed(cluster, [key_of(k) for k in used], pair, sizes)


# The most candidates one (op, shape) has: 3 protocols x (ring, tree, hierarchical), and NVLS
# (more would fail the reshape in collective_times_keyed).
_MAX_CANDIDATES = 10
_PADDING = np.array((math.inf, 0.0, 0.0, 0.0, 0.0) * _MAX_CANDIDATES)  # candidates that never win: infinite latency
_NO_TERMS = (0, False, np.zeros(5 * _MAX_CANDIDATES))  # zero seconds: a single rank, or nothing to send


@functools.lru_cache(maxsize=65536)
def _term_rows(cluster: Cluster, op: str, shape: GroupShape, nvls: bool) -> tuple[int, bool, np.ndarray]:
    """``_plan``'s terms as ``collective_times_keyed`` stacks them: _MAX_CANDIDATES rows of 5,
    padded, flat; with the candidate count and whether any has a pipeline fill. Built once per
    pair, not on every call."""
    terms = _plan(cluster, op, shape, nvls)[1]
    rows = _PADDING.copy()
    rows[:5 * len(terms)] = sum(terms, ())
    return len(terms), any(fill_spb for _, _, _, fill_spb, _ in terms), rows


@functools.lru_cache(maxsize=65536)
def _term_arrays(cluster: Cluster, op: str, shape: GroupShape, nvls: bool) -> tuple[np.ndarray, ...]:
    """``_plan``'s terms as [candidates x 1] columns: one broadcast per array of sizes."""
    terms = np.array(_plan(cluster, op, shape, nvls)[1], dtype=float)  # [candidates x 5]
    return tuple(terms[:, k:k + 1] for k in range(5))


def collective_time_for_size(
    cluster: Cluster, op: str, group_size: int, nbytes: float, nvls: bool | None = None
) -> CollectiveCost:
    """A group of ``group_size`` consecutive ranks (TP-like placement), for one-off questions."""
    op = normalize_op(op)
    return collective_time(cluster, op, contiguous_shape(cluster, group_size), nbytes, nvls)
