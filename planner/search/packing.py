"""Packs: the feasibility test and the bottleneck search behind the optimal balancer.

A split of layer costs into contiguous stages meets a bottleneck limit iff the greedy max-pack
does (each stage as long as the limit, and its memory, allow, leaving one layer for each later
stage): an exchange argument, exact also with per-stage memory such as 1F1B's in-flight
micro-batches. The optimal bottleneck is one of the O(n^2) segment sums, so the best split is
the first sum, in order, whose pack succeeds; ``best_pack`` brackets it with max-pack probes
and bisects the bracket. With memory, the split is the same pack walked back from the last
layer (longest last stages).
"""

from __future__ import annotations

import functools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class StageMemory:
    """Bytes a stage needs: ``base[s] + sum(state[i]) + inflight[s] * sum(act[i])``.

    ``state`` is per-layer memory that does not depend on the schedule (weights, gradients,
    optimizer states after sharding); ``act`` the activation bytes one in-flight micro-batch
    leaves per layer; ``inflight[s]`` how many micro-batches stage s holds at its peak
    (1F1B: p - s); ``base[s]`` fixed costs (buffers, CUDA context, the first stage's
    embedding or the last stage's head when they are not layers of their own).
    """

    state: Sequence[float]
    act: Sequence[float]
    inflight: Sequence[float]
    base: Sequence[float]
    capacity: float

    def stage_bytes(self, stage: int, start: int, end: int) -> float:
        st = float(sum(self.state[start:end]))
        ac = float(sum(self.act[start:end]))
        return float(self.base[stage]) + st + float(self.inflight[stage]) * ac


def memory_rows(memory: StageMemory, stages: int, n: int) -> "_MemoryRows":
    """Per stage: prefix sums of its bytes per layer, and the room left after its fixed bytes."""
    if len(memory.inflight) < stages:
        raise ValueError("memory.inflight needs one entry per stage")
    return _MemoryRows(memory, n)


class _MemoryRows:
    """``rows[s]``: (prefix sums of stage s's bytes per layer as a list, its room), built when
    first asked and shared by stages with the same in-flight count (an interleaved rank's v
    chunks, 1F1B's ranks past the micro-batch count): a pack that fails early, as most of a
    search's do, builds a few rows, not all of them."""

    def __init__(self, memory: StageMemory, n: int) -> None:
        self._memory = memory
        self._state = np.asarray(memory.state, dtype=float)
        self._act = np.asarray(memory.act, dtype=float)
        self._n = n
        self._rows: dict[float, list[float]] = {}

    def __getitem__(self, s: int) -> tuple[list[float], float]:
        memory = self._memory
        k = float(memory.inflight[s])
        row = self._rows.get(k)
        if row is None:
            weights = np.zeros(self._n + 1)
            np.cumsum(self._state + k * self._act, out=weights[1:])
            row = self._rows[k] = weights.tolist()
        return row, memory.capacity - float(memory.base[s])


@functools.lru_cache(maxsize=64)
def _upper(n: int) -> np.ndarray:
    """[n x n] mask of the pairs i < j."""
    return np.triu(np.ones((n, n), dtype=bool), k=1)


@functools.lru_cache(maxsize=4096)
def cost_profile(costs: tuple[float, ...]) -> tuple[np.ndarray, list[float], float, float]:
    """(prefix sums as an array and a list, largest cost, total) of one cost vector, which a
    search splits over many stage counts (pp x virtual stages)."""
    arr = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float))))
    return arr, arr.tolist(), float(np.max(arr[1:] - arr[:-1])), float(arr[-1])


@functools.lru_cache(maxsize=4096)
def all_sums(costs: tuple[float, ...]) -> np.ndarray:
    """Every distinct segment sum of one cost vector, sorted: the bottlenecks a split can have
    (O(n^2), so computed once per vector and only when memory limits the split)."""
    arr = cost_profile(costs)[0]
    return np.unique((arr[None, :] - arr[:, None])[_upper(len(arr))], return_counts=True)[0]


def _sums_within(arr: np.ndarray, lower: float, top: float) -> list[float]:
    """The distinct segment sums of prefix sums ``arr`` in [lower, top], sorted: the same values
    as the slice of ``all_sums``, without sorting the O(n^2) sums outside the window."""
    d = arr[None, :] - arr[:, None]
    return sorted(set(d[(d >= lower) & (d <= top) & _upper(len(arr))].tolist()))  # a few dozen: no np.unique


def fast_time_only(costs: Sequence[float], stages: int, upper: float | None = None) -> tuple[int, ...]:
    """Time-only optimum: binary search of the segment sums with a greedy max-pack test.

    Without per-stage memory, packing each stage as far as the limit allows (leaving one layer
    for each later stage) reaches at least as far as any valid partition, so the test is exact;
    bisect on a Python list keeps it cheap (the search calls this thousands of times).
    """
    arr, prefix, largest, total = cost_profile(tuple(map(float, costs)))
    # The optimum lies between max(max cost, mean per stage) and any achievable bottleneck.
    lower = max(largest, total / stages) * (1 - 1e-12)
    top = total if upper is None else upper * (1 + 1e-12)
    sums = _bracketed_sums(arr, prefix, lower, top, stages) if len(prefix) > _BRACKET_MIN_UNITS else None
    if sums is None:
        sums = _sums_within(arr, lower, top)
    ends = _even_ends(prefix, sums[_first_feasible(prefix, sums, stages, None)], stages)
    return tuple(e - s for s, e in zip([0] + ends[:-1], ends))


_PROBES = 3  # pack walks before giving up on a bracket
_BRACKET_MIN_UNITS = 100  # below, the whole table of sums is the cheaper way (vl2, deepseek-v3: ~60 units)


def _bracketed_sums(arr: np.ndarray, prefix: list[float], lower: float, top: float,
                    stages: int) -> list[float] | None:
    """The segment sums in [lower, top] that can still be the optimum, or None when no small
    bracket is found: every sum up to a limit the pack fails at is infeasible, so only those
    from that limit to a feasible sum matter, and the same first feasible sum is found in them.

    Exact whatever the probes are (feasibility is monotone in the limit); they only decide
    how narrow the bracket is. Each is the smallest sum that lets some stage of the failed
    pack reach one layer further (below it the pack is the same, so it fails too): on
    llama-3.1-405b the first probe is already the optimum, and the O(n^2) table is never built."""
    if not lower > 0:
        return None
    low = lower
    for _ in range(_PROBES):
        probe = _next_limit(prefix, low, stages)
        if probe is None or probe > top:
            return None
        if _time_pack_fits(prefix, probe, stages):
            return _sums_between(arr, low, probe)
        low = probe
    return None


def _next_limit(prefix: list[float], limit: float, stages: int) -> float | None:
    """The smallest segment sum that extends a stage of the max-pack at ``limit`` (the same
    walk as ``_time_pack_fits``), or None when the pack fits at ``limit``."""
    n = len(prefix) - 1
    eps = 1e-12 * max(1.0, abs(limit))
    start, best = 0, float("inf")
    for s in range(stages - 1):
        base = prefix[start]
        end = bisect_right(prefix, base + limit + eps, start) - 1
        cap = n - (stages - s - 1)
        if end > cap:
            end = cap
        if end <= start:
            return min(best, prefix[start + 1] - base)
        if end < cap:
            best = min(best, prefix[end + 1] - base)
        start = end
    rest = prefix[n] - prefix[start]
    return min(best, rest) if rest > limit + eps else None


def _sums_between(arr: np.ndarray, low: float, high: float) -> list[float]:
    """``_sums_within(arr, low, high)`` for ``low > 0`` from the pairs whose end lies near the
    window (at most ``width`` per start, located with one sorted search per bound), not from
    all O(n^2) pairs."""
    slack = 1e-14 * (float(arr[-1]) + high)  # far more than the rounding of arr[i] + bound
    firsts = np.searchsorted(arr, arr + (low - slack), side="left")
    width = int((np.searchsorted(arr, arr + (high + slack), side="right") - firsts).max())
    ends = np.minimum(firsts[:, None] + np.arange(width), len(arr) - 1)
    d = arr[ends] - arr[:, None]
    return sorted(set(d[(d >= low) & (d <= high)].tolist()))


def _even_ends(prefix: list[float], limit: float, stages: int) -> list[int]:
    """Stage ends of the most even split whose every stage is within a feasible ``limit``:
    stage k ends as near the equal share (k + 1) x total / stages as the limit allows.

    Many splits share the optimal bottleneck; the max-pack that proves it feasible fills the
    first stages to the limit and leaves crumbs at the end (llama-3-70b's 83 blocks in 20
    chunks: fifteen of five decoders, then four of one or two), which Megatron's interleaved
    schedule runs 3.5% slower than the pipeline formula (planner/cost/schedule_check.py)
    and which piles layers on the first 1F1B stages, the ones holding the most micro-batches.
    Feasible because stage k may end anywhere from the earliest end any split within the
    limit has (the back-pack's, which leaves the later stages enough) to the furthest the
    limit reaches from where stage k - 1 ended, an interval that is never empty."""
    n, total = len(prefix) - 1, prefix[-1]
    eps = 1e-12 * max(1.0, abs(limit))
    earliest = list(accumulate(_pack_back(prefix, limit, stages, None)))  # earliest end of each stage
    ends, start = [], 0
    for k in range(stages - 1):
        reach = min(bisect_right(prefix, prefix[start] + limit + eps) - 1, n - (stages - k - 1))
        share = total * (k + 1) / stages
        near = bisect_left(prefix, share)
        if near > 0 and share - prefix[near - 1] <= prefix[min(near, n)] - share:
            near -= 1
        end = min(max(near, earliest[k], start + 1), reach)
        ends.append(end)
        start = end
    ends.append(n)
    return ends


def pack_ends(prefix: list[float], limit: float, stages: int,
               mem: "_MemoryRows | None") -> list[int] | None:
    """Stage ends of the greedy max-pack at ``limit`` (None when it fails): each stage as far
    as time (and its memory) allow, leaving one layer for each later stage.

    Every stage's furthest end is non-decreasing in its start (costs and bytes are
    non-negative), so the stage ends of this pack are never behind those of any valid
    partition: if any partition meets ``limit``, this one does. Per-stage memory limits
    (1F1B's in-flight micro-batches) keep that property."""
    n = len(prefix) - 1
    eps = 1e-12 * max(1.0, abs(limit))
    ends, start = [], 0
    for s in range(stages):
        last = s == stages - 1
        end = n if last else min(bisect_right(prefix, prefix[start] + limit + eps) - 1, n - (stages - s - 1))
        if last and prefix[n] - prefix[start] > limit + eps:
            return None
        if mem is not None:
            weights, cap = mem[s]
            meps = 1e-12 * max(1.0, abs(cap))
            if last:
                if weights[n] - weights[start] > cap + meps:
                    return None
            else:
                end = min(end, bisect_right(weights, weights[start] + cap + meps) - 1)
        if end <= start:
            return None
        ends.append(end)
        start = end
    return ends


def best_pack(prefix: list[float], values: list[float], stages: int,
            mem: "_MemoryRows | None") -> tuple[int, ...] | None:
    """The split at the smallest feasible bottleneck among ``values`` (sorted), else None."""
    if pack_ends(prefix, values[-1], stages, mem) is None:
        return None
    return _pack_back(prefix, values[_first_feasible(prefix, values, stages, mem)], stages, mem)


def _first_feasible(prefix: list[float], values: list[float], stages: int,
                    mem: "_MemoryRows | None") -> int:
    """Index of the smallest feasible limit in ``values`` (sorted; the last one feasible).

    Gallops up from the smallest (the optimum usually sits a few sums above the lower
    bound, and a memory limit moves it only a little further), then bisects the bracket."""
    if mem is None:
        def fits(limit: float) -> bool:
            return _time_pack_fits(prefix, limit, stages)
    else:
        def fits(limit: float) -> bool:
            return pack_ends(prefix, limit, stages, mem) is not None
    lo, hi, probe, stride = 0, len(values) - 1, 0, 1
    while probe < hi:
        if fits(values[probe]):
            hi = probe
            break
        lo = probe + 1
        probe, stride = min(lo + stride, hi), stride * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _time_pack_fits(prefix: list[float], limit: float, stages: int) -> bool:
    """``pack_ends(prefix, limit, stages, None) is not None``, the same steps without the list
    of ends: the time-only search probes a few limits per split, each a walk over the stages.
    Each stage's furthest end is searched from its start on (it never lies before: a limit
    below zero fails at the first stage either way)."""
    n = len(prefix) - 1
    eps = 1e-12 * max(1.0, abs(limit))
    start = 0
    for s in range(stages - 1):
        end = bisect_right(prefix, prefix[start] + limit + eps, start) - 1
        cap = n - (stages - s - 1)
        if end > cap:
            end = cap
        if end <= start:
            return False
        start = end
    return not prefix[n] - prefix[start] > limit + eps and n > start


def _pack_back(prefix: list[float], limit: float, stages: int,
               mem: "_MemoryRows | None") -> tuple[int, ...]:
    """The split at a feasible ``limit`` with the longest last stages: walking back from the
    last layer, each stage starts as early as time and its memory allow, leaving one layer
    for each earlier stage. Long last stages keep the early stages (which hold the most
    in-flight micro-batches under 1F1B) as light as the bottleneck allows.

    Exact for the same reason as ``pack_ends``, mirrored: each stage's earliest start is
    non-decreasing in its end, so this walk is never ahead of any valid split and the first
    stage, what is left, fits whenever some split meets ``limit``."""
    eps = 1e-12 * max(1.0, abs(limit))
    end, counts = len(prefix) - 1, []
    for s in range(stages - 1, 0, -1):
        if mem is None:
            # prefix is non-decreasing, so the starts that fit are a suffix of [s, end): one
            # bisect on the list itself, without a key function per probe.
            start = max(bisect_left(prefix, prefix[end] - limit - eps, s, end), s)
        else:
            weights, cap = mem[s]
            meps = 1e-12 * max(1.0, abs(cap))

            def fits(i: int) -> bool:
                return prefix[end] <= prefix[i] + limit + eps and weights[end] <= weights[i] + cap + meps
            start = bisect_left(range(s, end), True, key=fits) + s  # the first start in [s, end) that fits
        assert start < end, "limit is not feasible"
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))
