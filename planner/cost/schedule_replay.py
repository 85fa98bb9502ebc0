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
benchmarks/bench_pipeline_schedule.py), not for the search.
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


def replay(pp: int, v: int, m: int, g: int, fwd: Sequence[Sequence[float]],
           bwd: Sequence[Sequence[float]]) -> tuple[float, list[int]]:
    """(step seconds, per rank the peak of chunk-forwards awaiting their backward).

    ``fwd[r][c]`` / ``bwd[r][c]``: seconds of one micro-batch's forward / backward of chunk c on
    rank r (model chunk c x pp + r). RuntimeError when the schedule deadlocks (a group G that
    Megatron refuses can)."""
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
                free[r] = finish[kind, r, chunk, mb] = start + (fwd[r][chunk] if kind == "F" else bwd[r][chunk])
                live[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], live[r])
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the schedule deadlocks (pp {pp}, v {v}, {m} micro-batches, group {g})")
    return max(free), peak
