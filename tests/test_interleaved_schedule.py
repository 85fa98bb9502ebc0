"""Megatron's pipeline schedules, replayed op by op (planner/cost/schedule_replay.py), against
the planner's closed-form model of them.

It checks what the planner assumes when pp does not divide the micro-batches per step M:
with memory.microbatch_group's G the step takes exactly the interleaved bubble of
step_time.pipeline (no dependency stalls) and each rank's peak of stored chunk activations
is memory.inflight_microbatches x v; with Megatron's default G = pp the same M stalls or
deadlocks, which is why Megatron refuses it and why the group has to be emitted. The plain
1F1B schedule (v = 1, warm-up pp - r - 1) is checked the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost import schedule_replay
from planner.cost.memory import inflight_microbatches, microbatch_group, microbatch_groups
from planner.cost.step_time import pipeline


def replay(pp: int, v: int, m: int, g: int, fwd: float = 1.0, bwd: float = 1.0) -> tuple[float, list[int]]:
    """Equal chunks: every chunk's forward takes ``fwd`` and its backward ``bwd``."""
    return schedule_replay.replay(pp, v, m, g, [[fwd] * v] * pp, [[bwd] * v] * pp)


def planned_step(pp: int, v: int, m: int, fwd: float, bwd: float) -> float:
    """step_time's interleaved step for equal ranks: m x T + bubble, T a rank's v chunks."""
    per_rank = v * (fwd + bwd)
    _, bubble = pipeline(np.full((1, pp), per_rank), np.array([pp]), np.array([float(v)]))
    return m * per_rank + float(bubble[0])


CASES = [(pp, v, m) for pp in (2, 3, 4, 5) for v in (2, 3, 4) for m in range(pp, 3 * pp + 3)]


@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0)])
def test_the_planned_group_runs_without_stalls_and_holds_what_memory_counts(fwd: float, bwd: float):
    for pp, v, m in CASES:
        g = microbatch_group(pp, m)
        step, peak = replay(pp, v, m, g, fwd, bwd)
        assert step == pytest.approx(planned_step(pp, v, m, fwd, bwd), abs=1e-9), (pp, v, m, g)
        assert peak == [inflight_microbatches(r, pp, v, m) * v for r in range(pp)], (pp, v, m, g)


@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0)])
def test_plain_1f1b_matches_the_same_bubble_and_in_flight_count(fwd: float, bwd: float):
    """The v = 1 case of both formulas (Narayanan et al. 2021): m + pp - 1 slots, p - r in flight."""
    for pp in (2, 3, 4, 5, 8):
        for m in range(1, 3 * pp + 2):
            step, peak = replay(pp, 1, m, pp, fwd, bwd)
            assert step == pytest.approx(planned_step(pp, 1, m, fwd, bwd), abs=1e-9), (pp, m)
            assert peak == [inflight_microbatches(r, pp, 1, m) for r in range(pp)], (pp, m)


def test_the_group_is_megatrons_smallest_valid_one():
    def valid(g: int, pp: int, m: int) -> bool:  # schedules.py's two checks
        return pp <= g <= m and (m % g == 0 or m % g >= pp)

    for pp, _, m in CASES:
        g = microbatch_group(pp, m)
        assert valid(g, pp, m) and not any(valid(h, pp, m) for h in range(1, g)), (pp, m, g)
        assert (g == pp) == (m % pp == 0)
    assert microbatch_group(4, 10) == 5 and microbatch_group(4, 7) == 7 and microbatch_group(8, 12) == 12
    pps = [pp for pp, _, _ in CASES]
    ms = [m for _, _, m in CASES]
    assert microbatch_groups(pps, ms).tolist() == [microbatch_group(p, m) for p, m in zip(pps, ms)]
    with pytest.raises(ValueError, match="at least pp = 4"):
        microbatch_group(4, 3)


def test_the_default_group_stalls_where_pp_does_not_divide_the_micro_batches():
    """What the planner's group avoids: Megatron's default G = pp on such M never runs as planned."""
    stalled = deadlocked = 0
    for pp, v, m in CASES:
        if m % pp == 0:
            continue
        try:
            step, _ = replay(pp, v, m, pp)
        except RuntimeError as err:
            assert "deadlocks" in str(err)
            deadlocked += 1
            continue
        assert step > planned_step(pp, v, m, 1.0, 1.0) + 0.5, (pp, v, m)
        stalled += 1
    assert stalled and deadlocked
