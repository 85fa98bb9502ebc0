"""Layer-partition balancers: split an ordered list of layer costs into contiguous stages.

A pipeline runs at the pace of its slowest stage (1F1B: step ~ (m + p - 1) x bottleneck), so
the balancers minimise the bottleneck. Two are offered because users meet both in practice:

- ``greedy``: walk the layers, close a stage when adding the next layer would pass the
  per-stage target (total / stages), keeping at least one layer per stage. This is what
  hand-written partitions and DeepSpeed's ``partition_method="parameters"`` approximate.
- ``optimal``: the contiguous partition with the smallest bottleneck, subject to every
  stage fitting in memory. Exact: the optimal bottleneck is one of the O(n^2) segment sums,
  so we binary-search those with an exact feasibility test (a greedy max-pack, exact also
  with per-stage memory such as 1F1B's in-flight micro-batches); with memory, the split is
  the same pack walked back from the last layer (longest last stages).

Costs are plain floats (seconds of forward+backward per micro-batch); memory is described
by ``StageMemory`` (additive per layer, with per-stage multipliers), so both functions are
pure and cheap enough to call once per (tp, micro-batch, recompute, pp) group of a search.
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


@dataclass(frozen=True)
class Partition:
    """Layers per stage (``counts``) and the resulting stage costs."""

    counts: tuple[int, ...]
    stage_costs: tuple[float, ...]
    fits: bool = True  # False when no partition satisfies the memory limit (optimal only)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """Half-open [start, end) layer ranges of each stage."""
        out, start = [], 0
        for c in self.counts:
            out.append((start, start + c))
            start += c
        return out


def _check(costs: Sequence[float], stages: int) -> None:
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if len(costs) < stages:
        raise ValueError(f"{len(costs)} layers cannot fill {stages} stages (at least one layer each)")


def _stage_costs(costs: Sequence[float], counts: Sequence[int]) -> tuple[float, ...]:
    out, start = [], 0
    for c in counts:
        out.append(float(sum(costs[start:start + c])))
        start += c
    return tuple(out)


def greedy_partition(costs: Sequence[float], stages: int) -> Partition:
    """Close a stage when the next layer would pass the per-stage target; one layer per stage
    minimum. The target is what is left over the stages left (total/stages for the first), so
    a stage closed early does not push the shortfall onto the last one: with a fixed
    total/stages, 126 equal layers on 32 stages gave 31 stages of 3 and a last one of 33."""
    _check(costs, stages)
    n = len(costs)
    remaining = float(sum(costs))
    target = remaining / stages
    bar = target * (1 + 1e-12)
    counts: list[int] = []
    acc, count, closed = 0.0, 0, 0
    for i, c in enumerate(costs):
        # Close before layer i (with stages - closed stages left, the open one included) if it
        # would pass the target, or if the layers left (n - i, i included) are only just
        # enough to give every remaining stage one.
        if count and stages - closed > 1 and (acc + c > bar or n - i == stages - closed - 1):
            counts.append(count)
            closed += 1
            remaining -= acc
            target = remaining / (stages - closed)
            bar = target * (1 + 1e-12)
            acc, count = 0.0, 0
        acc += c
        count += 1
    counts.append(count)
    return Partition(tuple(counts), _stage_costs(costs, counts))


def optimal_partition(costs: Sequence[float], stages: int, memory: StageMemory | None = None,
                      upper: float | None = None, lower: float | None = None) -> Partition:
    """The contiguous partition minimising the slowest stage, every stage within memory.

    When no partition fits in memory, the time-optimal partition is returned with
    ``fits=False`` so the caller can report how far it is from fitting. ``upper``: a known
    achievable bottleneck (e.g. greedy's), which narrows the time-only search; ``lower``: a
    bottleneck no partition beats (e.g. the time-only optimum when memory is limited).
    """
    _check(costs, stages)
    if memory is None:
        counts = _fast_time_only(costs, stages, upper)
        return Partition(counts, _stage_costs(costs, counts))
    key = tuple(float(c) for c in costs)
    _, prefix, _, total = _cost_profile(key)
    all_sums = _all_sums(key)
    mem = _memory_rows(memory, stages, len(costs))
    floor = max(float(np.max(costs)), total / stages, lower or 0.0)
    values = all_sums[np.searchsorted(all_sums, floor * (1 - 1e-12), side="left"):].tolist()
    result = _search(prefix, values, stages, mem)
    if result is None:
        counts = _search(prefix, values, stages, None)
        assert counts is not None  # without memory the whole sum always works
        return Partition(counts, _stage_costs(costs, counts), fits=False)
    return Partition(result, _stage_costs(costs, result))


def fits_within(costs: Sequence[float], stages: int, memory: StageMemory, limit: float) -> bool:
    """Whether some split has every stage within memory and a bottleneck of at most ``limit``:
    one greedy max-pack (exact, see ``_pack_ends``), far cheaper than finding the best split.
    The search asks it first when only a split below ``limit`` could still matter."""
    _check(costs, stages)
    prefix = _cost_profile(tuple(float(c) for c in costs))[1]
    return _pack_ends(prefix, limit, stages, _memory_rows(memory, stages, len(costs))) is not None


def _memory_rows(memory: StageMemory, stages: int, n: int) -> "_MemoryRows":
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
def _cost_profile(costs: tuple[float, ...]) -> tuple[np.ndarray, list[float], float, float]:
    """(prefix sums as an array and a list, largest cost, total) of one cost vector, which a
    search splits over many stage counts (pp x virtual stages)."""
    arr = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float))))
    return arr, arr.tolist(), float(np.max(arr[1:] - arr[:-1])), float(arr[-1])


@functools.lru_cache(maxsize=4096)
def _all_sums(costs: tuple[float, ...]) -> np.ndarray:
    """Every distinct segment sum of one cost vector, sorted: the bottlenecks a split can have
    (O(n^2), so computed once per vector and only when memory limits the split)."""
    arr = _cost_profile(costs)[0]
    return np.unique((arr[None, :] - arr[:, None])[_upper(len(arr))], return_counts=True)[0]


def _sums_within(arr: np.ndarray, lower: float, top: float) -> list[float]:
    """The distinct segment sums of prefix sums ``arr`` in [lower, top], sorted: the same values
    as the slice of ``_all_sums``, without sorting the O(n^2) sums outside the window."""
    d = arr[None, :] - arr[:, None]
    return sorted(set(d[(d >= lower) & (d <= top) & _upper(len(arr))].tolist()))  # a few dozen: no np.unique


def _fast_time_only(costs: Sequence[float], stages: int, upper: float | None = None) -> tuple[int, ...]:
    """Time-only optimum: binary search of the segment sums with a greedy max-pack test.

    Without per-stage memory, packing each stage as far as the limit allows (leaving one layer
    for each later stage) reaches at least as far as any valid partition, so the test is exact;
    bisect on a Python list keeps it cheap (the search calls this thousands of times).
    """
    arr, prefix, largest, total = _cost_profile(tuple(map(float, costs)))
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
    schedule runs 3.5% slower than the pipeline formula (planner/search/schedule_check.py)
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


def _pack_ends(prefix: list[float], limit: float, stages: int,
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


def _search(prefix: list[float], values: list[float], stages: int,
            mem: "_MemoryRows | None") -> tuple[int, ...] | None:
    """The split at the smallest feasible bottleneck among ``values`` (sorted), else None."""
    if _pack_ends(prefix, values[-1], stages, mem) is None:
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
            return _pack_ends(prefix, limit, stages, mem) is not None
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
    """``_pack_ends(prefix, limit, stages, None) is not None``, the same steps without the list
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

    Exact for the same reason as ``_pack_ends``, mirrored: each stage's earliest start is
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


def balance(costs: Sequence[float], stages: int, method: str = "optimal",
            memory: StageMemory | None = None) -> Partition:
    """Dispatch on the ``--balancer`` name."""
    if method == "greedy":
        return greedy_partition(costs, stages)
    if method == "optimal":
        return optimal_partition(costs, stages, memory)
    raise ValueError(f"unknown balancer {method!r}; use greedy or optimal")
