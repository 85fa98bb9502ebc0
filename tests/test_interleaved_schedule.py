"""Megatron-Core's interleaved 1F1B schedule, replayed op by op, against the planner's model of it.

The replay follows the schedule as Megatron-Core builds it (``pipeline_parallel/schedules.py``):
a table of (micro-batch, chunk) pairs in groups of G micro-batches per chunk, a warm-up of
(pp - r - 1) x 2 + (v - 1) x G chunk-forwards on rank r, then one forward and one backward
at a time, then the remaining backwards, backwards visiting the chunks in reverse. Every op
starts when its rank is free and its inputs exist (the previous chunk of the model for a
forward, the next chunk's backward for a backward); sends cost nothing.

It checks what the planner assumes when pp does not divide the micro-batches per step M:
with memory.microbatch_group's G the step takes exactly the interleaved bubble of
step_time.pipeline (no dependency stalls) and each rank's peak of stored chunk activations
is memory.inflight_microbatches x v; with Megatron's default G = pp the same M stalls or
deadlocks, which is why Megatron refuses it and why the group has to be emitted. The plain
1F1B schedule (v = 1, warm-up pp - r - 1) is checked the same way.
"""

from __future__ import annotations

import pytest

from planner.cost.memory import inflight_microbatches, microbatch_group, microbatch_groups
from planner.cost.step_time import MicroBatchTime, pipeline


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """Forward order of (micro-batch, chunk): g micro-batches on each chunk in turn; a last
    group shorter than g runs whole on each chunk."""
    out: list[tuple[int, int]] = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        out += [(mb, c) for c in range(v) for mb in range(lo, hi)]
    return out


def rank_ops(rank: int, pp: int, v: int, m: int, g: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s ops in order; v = 1 is the plain 1F1B schedule (warm-up pp - r - 1)."""
    table = schedule_table(m, v, g)
    total = m * v
    warm = min(pp - rank - 1 if v == 1 else (pp - rank - 1) * 2 + (v - 1) * g, total)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", v - 1 - c, mb) for mb, c in table]
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return ops + bwd[total - warm:]


def inputs(kind: str, rank: int, chunk: int, mb: int, pp: int, v: int) -> list[tuple[str, int, int, int]]:
    """Ops whose results this op needs; chunk c of rank r is model chunk c x pp + r."""
    if kind == "F":
        if rank > 0:
            return [("F", rank - 1, chunk, mb)]
        return [("F", pp - 1, chunk - 1, mb)] if chunk > 0 else []
    own = [("F", rank, chunk, mb)]
    if rank < pp - 1:
        return own + [("B", rank + 1, chunk, mb)]
    return own + ([("B", 0, chunk + 1, mb)] if chunk < v - 1 else [])


def replay(pp: int, v: int, m: int, g: int, fwd: float = 1.0, bwd: float = 1.0) -> tuple[float, list[int]]:
    """(step seconds, per rank the peak of chunk-forwards awaiting their backward)."""
    ops = [rank_ops(r, pp, v, m, g) for r in range(pp)]
    finish: dict[tuple[str, int, int, int], float] = {}
    at, free = [0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    while any(at[r] < len(ops[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(ops[r]):
                kind, chunk, mb = ops[r][at[r]]
                need = inputs(kind, r, chunk, mb, pp, v)
                if any(n not in finish for n in need):
                    break
                start = max([free[r], *(finish[n] for n in need)])
                free[r] = finish[kind, r, chunk, mb] = start + (fwd if kind == "F" else bwd)
                live[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], live[r])
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("deadlock")
    return max(free), peak


def planned_step(pp: int, v: int, m: int, fwd: float, bwd: float) -> float:
    """step_time's interleaved step for equal ranks: m x T + bubble, T a rank's v chunks."""
    per_rank = v * (fwd + bwd)
    ranks = [MicroBatchTime(fwd=v * fwd, bwd=v * bwd, recompute=0.0, tp=0.0, ep=0.0, pp=0.0)
             for _ in range(pp)]
    assert all(abs(r.total - per_rank) < 1e-12 for r in ranks)
    _, bubble = pipeline(ranks, m, v)
    return m * per_rank + bubble


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
        except RuntimeError:
            deadlocked += 1
            continue
        assert step > planned_step(pp, v, m, 1.0, 1.0) + 0.5, (pp, v, m)
        stalled += 1
    assert stalled and deadlocked
