"""Branch and bound over a candidate space: evaluate in full only what can reach the top K.

Every candidate has a step time and a peak memory no split can beat (bounds.py). Keys are
evaluated in full best bound first, a chunk at a time, until the bound of what is left cannot
reach the K-th distinct value found (exact, since the bounds are proven:
tests/test_pruning_exact.py checks it against exhaustive ``estimate`` calls). Then pipelines
whose time-balanced split ran out of memory are rebalanced under a memory limit
(memfit.py), best split-independent bound first (bounds.split_time_bound), until that bound
cannot reach the top K either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from planner.cost.candidates import take
from planner.cost.goodput import candidates_goodput
from planner.cost.rank_chunks import Split
from planner.search import memfit
from planner.search.bounds import base_bounds, gather_bound, split_time_bound
from planner.search.evaluate import Detail, Pricing, evaluate_keys, fits
from planner.search.keys import KeyedSpace

# Keys evaluated in full before the first look at the bar (then twice as many each round).
FIRST_CHUNK = 8
# Ties may reorder plans within a hair: the bar stands this far above the K-th value.
BAR_SLACK = 2e-3


@dataclass
class Outcome:
    """Per candidate of the space: what the search found (inf where it did not evaluate)."""

    step: np.ndarray
    peak: np.ndarray  # evaluated, or the memory bound where that alone proves it out of memory
    cpu: np.ndarray
    done: np.ndarray  # evaluated in full
    certain_oom: np.ndarray  # out of memory by its bound alone
    time_lb: np.ndarray
    mem_lb: np.ndarray
    # Under the goodput objective, each evaluated candidate's goodput (1 elsewhere): priced once,
    # when its step time is known (planner/cost/goodput.py).
    goodput: np.ndarray = field(default_factory=lambda: np.ones(0))
    details: dict[int, Detail] = field(default_factory=dict)
    overrides: dict[int, tuple[Split, float]] = field(default_factory=dict)  # memory-limited splits

    def fitting(self, p: Pricing) -> np.ndarray:
        return self.done & fits(p.ctx, self.peak, self.cpu)


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending."""
    v = np.sort(values)
    return v[np.concatenate(([True], v[1:] != v[:-1]))] if v.size else v


def search(p: Pricing, ks: KeyedSpace, objective: str, top: int,
           progress: Callable[[float], None] | None = None) -> Outcome:
    """The candidates of ``ks`` that can be among the ``top`` best by ``objective``, evaluated."""
    time_lb, mem_lb, dense, expert = base_bounds(p, ks)
    certain_oom = mem_lb > p.ctx.cluster.profile.gpu.memory_bytes
    n = len(ks.space)
    out = Outcome(np.full(n, np.inf), np.where(certain_oom, mem_lb, np.inf), np.zeros(n), np.zeros(n, dtype=bool),
                  certain_oom, time_lb, mem_lb, np.ones(n))
    _evaluate_within_bar(p, ks, out, objective, top, dense, expert, progress)
    _rebalance_oom(p, ks, out, objective, top)
    return out


def _value(out: Outcome, p: Pricing, ks: KeyedSpace, objective: str) -> np.ndarray:
    """What the bar is set on, lower is better: peak memory, or step time, or under the goodput
    objective step time over goodput (never below the step time, so the time bound still bounds it)."""
    if objective == "memory":
        return out.peak
    return out.step / out.goodput if objective == "goodput" else out.step


def _price_goodput(out: Outcome, p: Pricing, ks: KeyedSpace, rows: np.ndarray) -> None:
    """``out.goodput`` of ``rows`` at their step times (the goodput objective)."""
    rows = rows[np.isfinite(out.step[rows])]
    if rows.size:
        ctx = p.ctx
        out.goodput[rows] = candidates_goodput(take(ks.columns, rows), out.step[rows], p.model, ctx.workload,
                                               ctx.cluster.profile, ctx.cluster.nodes)[0].goodput


def _bar(out: Outcome, p: Pricing, value: np.ndarray, top: int) -> float:
    """The K-th best distinct value so far, or inf. Identical predictions collapse into one plan
    (rank.distinct_top), so the K-th distinct value is the bar (never lower than the true K-th's)."""
    vals = distinct(value[out.fitting(p)])
    return vals[top - 1] * (1 + BAR_SLACK) if len(vals) >= top else np.inf


def _evaluate_within_bar(p: Pricing, ks: KeyedSpace, out: Outcome, objective: str, top: int, dense: np.ndarray,
                         expert: np.ndarray, progress: Callable[[float], None] | None) -> None:
    """The main loop: keys in bound order, a chunk at a time (doubling: evaluating keys together
    wants chunks, stopping early wants them small), until no key's bound is within the bar.

    The time bound's exposed-gather term is added to a key's candidates when the key comes up
    for evaluation (its DP group is priced then, as evaluating it would): a key whose bound
    rises goes back in line, and keys never reached are never priced."""
    by_memory = objective == "memory"
    lb = out.mem_lb if by_memory else out.time_lb
    alive = ~out.certain_oom
    key_lb = np.full(len(ks.keys), np.inf)
    np.minimum.at(key_lb, ks.inverse[alive], lb[alive])
    refined = np.full(len(ks.keys), by_memory)
    pending = np.isfinite(key_lb)
    total = max(int(pending.sum()), 1)
    batch, bar = FIRST_CHUNK, np.inf
    while True:
        left = np.flatnonzero(pending & (key_lb <= bar))
        if not left.size:
            break
        chunk = left[np.argsort(key_lb[left], kind="stable")[:batch]]
        raw = chunk[~refined[chunk]]
        if raw.size:
            rows = np.concatenate([ks.members(g) for g in raw.tolist()])
            rows = rows[alive[rows]]
            out.time_lb[rows] += gather_bound(p.ctx, take(ks.columns, rows), dense[rows], expert[rows])
            key_lb[raw] = np.inf
            np.minimum.at(key_lb, ks.inverse[rows], out.time_lb[rows])
            refined[raw] = True
            continue
        res = evaluate_keys(p, ks, chunk)
        rows = res.rows
        out.step[rows], out.peak[rows], out.cpu[rows], out.done[rows] = res.step_time, res.peak_bytes, \
            res.cpu_bytes, True
        if objective == "goodput":
            _price_goodput(out, p, ks, rows)
        out.details.update(res.details)
        pending[chunk] = False
        batch *= 2
        bar = _bar(out, p, _value(out, p, ks, objective), top)
        if progress is not None:  # keys evaluated, of those evaluated or still within the bar
            evaluated = total - int(pending.sum())
            progress(evaluated / (evaluated + int((pending & (key_lb <= bar)).sum())))
    if progress is not None:
        progress(1.0)


def _rebalance_oom(p: Pricing, ks: KeyedSpace, out: Outcome, objective: str, top: int) -> None:
    """Pipelines that ran out of memory with the time-balanced split but whose memory bound fits
    and whose bound on the objective could still reach the top K: rebalance under the memory
    limit (memfit.py) and take the exact re-evaluation.

    The bound is the one no split can beat: step time (bounds.split_time_bound) for throughput
    and cost, which rank by step time on a fixed GPU count; the memory bound for memory."""
    c = ks.columns
    by_memory = objective == "memory"
    value = _value(out, p, ks, objective)
    capacity = p.ctx.cluster.profile.gpu.memory_bytes
    rows = np.nonzero(out.done & ~out.certain_oom & (out.peak > capacity) & (c["pp"] > 1))[0]
    if by_memory:
        bound = out.mem_lb[rows]
    else:
        rows = rows[out.time_lb[rows] <= _bar(out, p, value, top)]
        # Their time-optimal split is known now, which bounds every other split more tightly.
        bound = np.maximum(out.time_lb[rows], split_time_bound(p, ks, rows))
    keep = bound <= _bar(out, p, value, top)
    rows, bound = rows[keep], bound[keep]
    if not rows.size:
        return
    # Best bound first, a few at a time: once the bound of the next one passes the K-th plan
    # found so far, no later one can enter the top K (the same test as the main loop).
    order = np.argsort(bound, kind="stable")[:memfit.MAX_REBALANCED]
    rows, bound = rows[order], bound[order]
    pos, batch = 0, 32
    while pos < len(rows) and bound[pos] <= (limit := _bar(out, p, _value(out, p, ks, objective), top)):
        # A time bar lets memfit skip candidates no split within memory makes fast enough.
        redone = []
        for r in memfit.rebalance(p, ks, rows[pos:pos + batch], np.inf if by_memory else limit):
            out.step[r.candidate], out.peak[r.candidate], out.cpu[r.candidate] = r.step_time, r.peak_bytes, r.cpu_bytes
            out.overrides[r.candidate] = (r.parts, r.bottleneck)
            redone.append(r.candidate)
        if objective == "goodput" and redone:
            _price_goodput(out, p, ks, np.array(redone, dtype=np.int64))
        pos += batch
