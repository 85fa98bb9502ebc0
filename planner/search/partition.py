"""Layer-partition balancers: split an ordered list of layer costs into contiguous stages.

A pipeline runs at the pace of its slowest stage (1F1B: step ~ (m + p - 1) x bottleneck), so
the balancers minimise the bottleneck. Two are offered because users meet both in practice:

- ``greedy``: walk the layers, close a stage when adding the next layer would pass the
  per-stage target (total / stages), keeping at least one layer per stage. This is what
  hand-written partitions and DeepSpeed's ``partition_method="parameters"`` approximate.
- ``optimal``: the contiguous partition with the smallest bottleneck, subject to every
  stage fitting in memory. Exact: the optimal bottleneck is one of the O(n^2) segment sums,
  so we binary-search those with an exact feasibility test (a greedy max-pack, exact also
  with per-stage memory such as 1F1B's in-flight micro-batches), then rebuild the split
  with a reachability sweep over stage ends.

Costs are plain floats (seconds of forward+backward per micro-batch); memory is described
by ``StageMemory`` (additive per layer, with per-stage multipliers), so both functions are
pure and cheap enough to call once per (tp, micro-batch, recompute, pp) group of a search.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
    """Close a stage when the next layer would pass total/stages; one layer per stage minimum."""
    _check(costs, stages)
    n = len(costs)
    target = float(sum(costs)) / stages
    counts: list[int] = []
    acc, count = 0.0, 0
    for i, c in enumerate(costs):
        left_after = n - i  # layers from i on, i included
        stages_left = stages - len(counts)  # including the open one
        if count > 0 and stages_left > 1:
            # Close before layer i if it would pass the target, or if the layers left are
            # only just enough to give every remaining stage one.
            if acc + c > target or left_after == stages_left - 1:
                counts.append(count)
                acc, count = 0.0, 0
        acc += c
        count += 1
    counts.append(count)
    return Partition(tuple(counts), _stage_costs(costs, counts))


def _far_ends(prefix: np.ndarray, limit: float) -> np.ndarray:
    """For each start i, the furthest end j with prefix[j] - prefix[i] <= limit."""
    # Relative slack so sums that equal the limit are not lost to rounding.
    eps = 1e-12 * max(1.0, abs(limit))
    return np.searchsorted(prefix, prefix + limit + eps, side="right") - 1


def _reachable(prefix: np.ndarray, limit: float, stages: int, memory: StageMemory | None,
               mem_prefixes: list[np.ndarray] | None) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """(reach, far): reach[s][j] is True when layers [0, j) fit exactly s stages (the last
    entry: all of them); far[s][i] is stage s's furthest end from start i."""
    n = len(prefix) - 1
    reach_prev = np.zeros(n + 1, dtype=bool)
    reach_prev[0] = True
    history = []
    idx = np.arange(n + 1)
    far_time = _far_ends(prefix, limit)
    for s in range(stages):
        far = far_time
        if memory is not None and mem_prefixes is not None:
            cap = memory.capacity - float(memory.base[s])
            meps = 1e-12 * max(1.0, abs(cap))
            w = mem_prefixes[s]
            far = np.minimum(far_time, np.searchsorted(w, w + cap + meps, side="right") - 1)
        starts = idx[reach_prev & (far > idx)]
        if starts.size == 0:
            return None
        # Ends reachable from start i: (i, far[i]]. j is in the union when some start before
        # it reaches at least j (a running maximum of the furthest ends).
        furthest = np.full(n + 1, -1, dtype=np.int64)
        furthest[starts + 1] = far[starts]
        reach = np.maximum.accumulate(furthest) >= idx
        # Leave at least one layer for each stage still to come.
        reach[n - (stages - s - 1) + 1:] = False
        history.append((reach_prev, far))
        reach_prev = reach
    if not reach_prev[n]:
        return None
    return [h[0] for h in history] + [reach_prev], [h[1] for h in history]


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
    if len(memory.inflight) < stages:
        raise ValueError("memory.inflight needs one entry per stage")
    prefix, _, _, _, all_sums = _cost_profile(tuple(float(c) for c in costs))
    state = np.asarray(memory.state, dtype=float)
    act = np.asarray(memory.act, dtype=float)
    inflight = np.asarray(memory.inflight[:stages], dtype=float)
    # Row s: prefix sums of stage s's bytes per layer (one cumsum over [stage x layer]).
    weights = np.zeros((stages, len(costs) + 1))
    np.cumsum(state[None, :] + inflight[:, None] * act[None, :], axis=1, out=weights[:, 1:])
    mem_prefixes = list(weights)
    floor = max(float(np.max(costs)), float(prefix[-1]) / stages, lower or 0.0)
    candidates = all_sums[np.searchsorted(all_sums, floor * (1 - 1e-12), side="left"):]
    result = _search(prefix, candidates, stages, memory, mem_prefixes)
    if result is None:
        counts = _search(prefix, candidates, stages, None, None)
        assert counts is not None  # without memory the whole sum always works
        return Partition(counts, _stage_costs(costs, counts), fits=False)
    return Partition(result, _stage_costs(costs, result))


@functools.lru_cache(maxsize=64)
def _upper(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


@functools.lru_cache(maxsize=4096)
def _cost_profile(costs: tuple[float, ...]) -> tuple[np.ndarray, list[float], float, float, np.ndarray]:
    """(prefix sums as an array and a list, largest cost, total, sorted unique segment sums)
    of one cost vector.

    A search splits the same per-layer costs over many stage counts (pp x virtual stages);
    the O(n^2) segment sums are computed once per vector, not once per stage count."""
    arr = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float))))
    sums = (arr[None, :] - arr[:, None])[_upper(len(arr))]
    return (arr, arr.tolist(), float(np.max(arr[1:] - arr[:-1])), float(arr[-1]),
            np.unique(sums, return_counts=True)[0])


def _fast_time_only(costs: Sequence[float], stages: int, upper: float | None = None) -> tuple[int, ...]:
    """Time-only optimum: binary search of the segment sums with a greedy max-pack test.

    Without per-stage memory, packing each stage as far as the limit allows (leaving one layer
    for each later stage) reaches at least as far as any valid partition, so the test is exact;
    bisect on a Python list keeps it cheap (the search calls this thousands of times).
    """
    _, prefix, largest, total, all_sums = _cost_profile(tuple(float(c) for c in costs))
    # The optimum lies between max(max cost, mean per stage) and any achievable bottleneck.
    lower = max(largest, total / stages) * (1 - 1e-12)
    top = total if upper is None else upper * (1 + 1e-12)
    sums = all_sums[np.searchsorted(all_sums, lower, side="left"):np.searchsorted(all_sums, top, side="right")].tolist()
    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _pack_ends(prefix, sums[mid], stages, None) is not None:
            hi = mid
        else:
            lo = mid + 1
    ends = _pack_ends(prefix, sums[lo], stages, None)
    assert ends is not None
    return tuple(e - s for s, e in zip([0] + ends[:-1], ends))


def _pack_ends(prefix: list[float], limit: float, stages: int,
               mem: list[tuple[list[float], float]] | None) -> list[int] | None:
    """Stage ends of the greedy max-pack at ``limit`` (None when it fails): each stage as far
    as time (and its memory) allow, leaving one layer for each later stage.

    Every stage's furthest end is non-decreasing in its start (costs and bytes are
    non-negative), so the stage ends of this pack are never behind those of any valid
    partition: if any partition meets ``limit``, this one does. Per-stage memory limits
    (1F1B's in-flight micro-batches) keep that property, so the test needs no reachability
    sweep; the sweep (``_reachable``) runs once, to rebuild a memory-limited split."""
    from bisect import bisect_right

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


def _search(prefix: np.ndarray, candidates: np.ndarray, stages: int, memory: StageMemory | None,
            mem_prefixes: list[np.ndarray] | None) -> tuple[int, ...] | None:
    """Binary search the smallest feasible candidate bottleneck; rebuild its partition."""
    plist = prefix.tolist()
    mem = None
    if memory is not None and mem_prefixes is not None:
        mem = [(mem_prefixes[s].tolist(), memory.capacity - float(memory.base[s])) for s in range(stages)]
    values = candidates.tolist()
    if _pack_ends(plist, values[-1], stages, mem) is None:
        return None
    # Gallop up from the smallest candidate (a memory limit usually moves the optimum only a
    # few sums above the time-only one), then bisect the bracket: the smallest feasible index.
    lo, hi, probe, stride = 0, len(values) - 1, 0, 1
    while probe < hi:
        if _pack_ends(plist, values[probe], stages, mem) is not None:
            hi = probe
            break
        lo = probe + 1
        probe, stride = min(lo + stride, hi), stride * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if _pack_ends(plist, values[mid], stages, mem) is not None:
            hi = mid
        else:
            lo = mid + 1
    limit = values[lo]
    sweep = _reachable(prefix, limit, stages, memory, mem_prefixes)
    assert sweep is not None
    return _backtrack(limit, stages, sweep)


def _backtrack(limit: float, stages: int, sweep: tuple[list[np.ndarray], list[np.ndarray]]) -> tuple[int, ...]:
    """Walk back from the last layer choosing, for each stage, the earliest valid start.

    Earliest start = the longest last stages, which keeps early stages (which hold the most
    in-flight micro-batches under 1F1B) as light as the bottleneck allows.
    """
    reach, far = sweep
    end = len(reach[0]) - 1
    counts: list[int] = []
    for s in range(stages - 1, -1, -1):
        ok = np.nonzero(reach[s][:end] & (far[s][:end] >= end))[0]
        start = int(ok[0])
        counts.append(end - start)
        end = start
    assert end == 0
    return tuple(reversed(counts))


def brute_force_partition(costs: Sequence[float], stages: int, memory: StageMemory | None = None) -> Partition | None:
    """Every contiguous partition, for testing the balancers on small cases."""
    from itertools import combinations

    _check(costs, stages)
    n = len(costs)
    best: Partition | None = None
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        counts = tuple(bounds[k + 1] - bounds[k] for k in range(stages))
        if memory is not None and any(
            memory.stage_bytes(s, bounds[s], bounds[s + 1]) > memory.capacity for s in range(stages)
        ):
            continue
        part = Partition(counts, _stage_costs(costs, counts))
        if best is None or part.bottleneck < best.bottleneck:
            best = part
    return best


def balance(costs: Sequence[float], stages: int, method: str = "optimal",
            memory: StageMemory | None = None) -> Partition:
    """Dispatch on the ``--balancer`` name."""
    if method == "greedy":
        return greedy_partition(costs, stages)
    if method == "optimal":
        return optimal_partition(costs, stages, memory)
    raise ValueError(f"unknown balancer {method!r}; use greedy or optimal")
