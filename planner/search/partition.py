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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.search.packing import (
    StageMemory,
    all_sums,
    best_pack,
    cost_profile,
    fast_time_only,
    memory_rows,
    pack_ends,
)

__all__ = ["Partition", "StageMemory", "balance", "fits_within", "greedy_partition", "optimal_partition"]


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
        counts = fast_time_only(costs, stages, upper)
        return Partition(counts, _stage_costs(costs, counts))
    key = tuple(float(c) for c in costs)
    _, prefix, _, total = cost_profile(key)
    sums = all_sums(key)
    mem = memory_rows(memory, stages, len(costs))
    floor = max(float(np.max(costs)), total / stages, lower or 0.0)
    values = sums[np.searchsorted(sums, floor * (1 - 1e-12), side="left"):].tolist()
    result = best_pack(prefix, values, stages, mem)
    if result is None:
        counts = best_pack(prefix, values, stages, None)
        assert counts is not None  # without memory the whole sum always works
        return Partition(counts, _stage_costs(costs, counts), fits=False)
    return Partition(result, _stage_costs(costs, result))


def fits_within(costs: Sequence[float], stages: int, memory: StageMemory, limit: float) -> bool:
    """Whether some split has every stage within memory and a bottleneck of at most ``limit``:
    one greedy max-pack (exact, see ``pack_ends``), far cheaper than finding the best split.
    The search asks it first when only a split below ``limit`` could still matter."""
    _check(costs, stages)
    prefix = cost_profile(tuple(float(c) for c in costs))[1]
    return pack_ends(prefix, limit, stages, memory_rows(memory, stages, len(costs))) is not None


def balance(costs: Sequence[float], stages: int, method: str = "optimal",
            memory: StageMemory | None = None) -> Partition:
    """Dispatch on the ``--balancer`` name."""
    if method == "greedy":
        return greedy_partition(costs, stages)
    if method == "optimal":
        return optimal_partition(costs, stages, memory)
    raise ValueError(f"unknown balancer {method!r}; use greedy or optimal")
