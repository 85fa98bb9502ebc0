"""The exhaustive reference the layer-partition balancers are tested against.

``brute_force_partition`` tries every contiguous split of the layers (C(n-1, stages-1) of
them), so it is only for the small cases of tests/test_partition.py. It sums the stage costs
itself rather than through planner.search.partition's helpers, so the oracle shares no code
with what it checks.
"""

from __future__ import annotations

from itertools import combinations
from typing import Sequence

from planner.search.partition import Partition, StageMemory


def brute_force_partition(costs: Sequence[float], stages: int, memory: StageMemory | None = None) -> Partition | None:
    """The partition with the smallest bottleneck among all that fit ``memory``; None if none fits."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} layers cannot fill {stages} stages (at least one layer each)")
    best: Partition | None = None
    for cuts in combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        if memory is not None and any(
            memory.stage_bytes(s, bounds[s], bounds[s + 1]) > memory.capacity for s in range(stages)
        ):
            continue
        counts = tuple(bounds[s + 1] - bounds[s] for s in range(stages))
        stage_costs = tuple(float(sum(costs[bounds[s]:bounds[s + 1]])) for s in range(stages))
        part = Partition(counts, stage_costs)
        if best is None or part.bottleneck < best.bottleneck:
            best = part
    return best
