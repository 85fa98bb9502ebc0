"""Megatron's pipeline schedules replayed op by op: the reference the closed-form pipeline
model (step_time.pipeline, memory.inflight_microbatches) is checked against.

The replay follows the schedules as Megatron-Core builds them (``pipeline_parallel/schedules.py``):

- plain 1F1B (v = 1): rank r runs pp - r - 1 warm-up forwards, then one forward and one
  backward at a time, then the remaining backwards (Narayanan et al. 2021);
- interleaved 1F1B (v > 1): a table of (micro-batch, chunk) pairs in groups of G micro-batches
  per chunk (a last group shorter than G runs whole on each chunk), a warm-up of
  (pp - r - 1) x 2 + (v - 1) x G chunk-forwards, then one forward and one backward at a time,
  backwards visiting the chunks in reverse.

Every op starts when its rank is free and its inputs exist (the previous chunk of the model for
a forward, the next chunk's backward for a backward). Sends cost nothing and nothing overlaps
on a rank: it is the schedule's own shape, without the interconnect. Pure Python, O(pp x v x m)
ops: for tests and benchmarks (tests/test_interleaved_schedule.py,
benchmarks/bench_pipeline_schedule.py) and for the one plan a user is shown
(planner/cost/schedule_check.py), not for every candidate of a search.
"""

from __future__ import annotations

from collections.abc import Sequence

Op = tuple[str, int, int]  # ("F" | "B", chunk on its rank, micro-batch)


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """Forward order of (micro-batch, chunk) on every rank."""
    out: list[tuple[int, int]] = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        out += [(mb, c) for c in range(v) for mb in range(lo, hi)]
    return out


def rank_ops(rank: int, pp: int, v: int, m: int, g: int) -> list[Op]:
    """Rank ``rank``'s ops in the order Megatron issues them."""
    table = schedule_table(m, v, g)
    total = m * v
    warm = min(pp - rank - 1 if v == 1 else (pp - rank - 1) * 2 + (v - 1) * g, total)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", v - 1 - c, mb) for mb, c in table]
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return ops + bwd[total - warm:]


def replay(pp: int, v: int, m: int, g: int, fwd: Sequence[Sequence[float]],
           bwd: Sequence[Sequence[float]]) -> tuple[float, list[int]]:
    """(step seconds, per rank the peak of chunk-forwards awaiting their backward).

    ``fwd[r][c]`` / ``bwd[r][c]``: seconds of one micro-batch's forward / backward of chunk c on
    rank r (model chunk c x pp + r). RuntimeError when the schedule deadlocks (a group G that
    Megatron refuses can).

    Each op's finish is the later of its rank's previous op and its inputs, plus its own time,
    whatever order the ops are visited in; a rank runs until an input is missing and waits on
    that op, which wakes it when done. Ops are numbered, so a 405b plan's 4,096 ops replay in
    a few ms (``schedule_check`` runs one per search)."""
    size = pp * v * m  # op ids: forward (rank, chunk, mb) -> (rank * v + chunk) * m + mb, backward + size
    rows = [_rank_row(r, pp, v, m, g, fwd[r], bwd[r]) for r in range(pp)]
    finish = [-1.0] * (2 * size)
    waiting: dict[int, list[int]] = {}
    at, free = [0] * pp, [0.0] * pp
    live, peak = [0] * pp, [0] * pp
    ready = list(range(pp - 1, -1, -1))
    while ready:
        r = ready.pop()
        row, i, t = rows[r], at[r], free[r]
        while i < len(row):
            own, deps, seconds, step = row[i]
            start = t
            blocked = -1
            for d in deps:
                done = finish[d]
                if done < 0:
                    blocked = d
                    break
                if done > start:
                    start = done
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            t = finish[own] = start + seconds
            live[r] += step
            if live[r] > peak[r]:
                peak[r] = live[r]
            i += 1
            woken = waiting.pop(own, None)
            if woken:
                ready.extend(woken)
        at[r], free[r] = i, t
    if any(at[r] < len(rows[r]) for r in range(pp)):
        raise RuntimeError(f"the schedule deadlocks (pp {pp}, v {v}, {m} micro-batches, group {g})")
    return max(free), peak


def _rank_row(r: int, pp: int, v: int, m: int, g: int, fwd: Sequence[float],
              bwd: Sequence[float]) -> list[tuple[int, tuple[int, ...], float, int]]:
    """Rank ``r``'s ops in Megatron's order as (op id, ids of its inputs, seconds, +1 forward /
    -1 backward). A forward needs the previous chunk of the model (chunk c of rank r is model
    chunk c x pp + r: the same chunk one rank back, or the chunk before on the last rank); a
    backward needs its own forward and the next chunk of the model's backward."""
    size = pp * v * m
    row = []
    for kind, c, mb in rank_ops(r, pp, v, m, g):
        if kind == "F":
            if r > 0:
                deps: tuple[int, ...] = (((r - 1) * v + c) * m + mb,)
            else:
                deps = (((pp - 1) * v + c - 1) * m + mb,) if c > 0 else ()
            row.append(((r * v + c) * m + mb, deps, fwd[c], 1))
        else:
            own = (r * v + c) * m + mb
            if r < pp - 1:
                deps = (own, size + ((r + 1) * v + c) * m + mb)
            else:
                deps = (own, size + c * m + mb + m) if c < v - 1 else (own,)
            row.append((size + own, deps, bwd[c], -1))
    return row
