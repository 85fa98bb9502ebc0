"""Lower bounds on a candidate's step time and peak memory that no pipeline partition can beat.

They let the search skip, with proof, candidates that cannot reach the top K (branch and bound)
and reject candidates that cannot fit in memory, before partitioning or assembling anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from planner.cost import memory as mem
from planner.cost.parallel import FRAMEWORKS, OFFLOADS
from planner.search.assemble import optimizer_seconds

if TYPE_CHECKING:
    from planner.search.evaluate import Evaluator, Prepared


def lower_bounds(ev: "Evaluator", prep: "Prepared") -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, a step time and a peak memory no partition can beat.

    Time: with per-rank times T_r summing to S >= (sum of block times) and T_w = max T_r >=
    S / pp, the step ``m T_w + (S - T_w) / v + dp + optimizer`` is at least
    ``(S / pp)(m - 1/v) + S / v`` (it grows with T_w and S since m >= 1 >= 1/v) plus
    ``optimizer_bound``.
    Memory: the worst rank holds at least the mean over ranks; activations at least the
    in-flight count of the last rank (the smallest).
    """
    c = prep.space.columns
    w = ev.workload
    n = len(prep.space)
    block_sum = np.zeros(len(prep.keys))
    per_sample = np.zeros((len(prep.keys), 3))  # dense params, expert params, stored act bytes
    k = prep.keys
    # Keys are sorted by a code whose leading digits are (tp, sp, ep): each group is one run.
    cuts = np.concatenate(([0], np.flatnonzero(np.any(np.diff(k[:, :3], axis=0) != 0, axis=1)) + 1, [len(k)]))
    runs = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    groups = {}
    for a, _ in runs:
        tp, sp, ep = (int(x) for x in k[a, :3])
        groups[tp, sp, ep] = (int(k[a, 7]), int(k[a, 5]), prep.micro[tp, sp, ep])
    ev.tables(groups)  # every group's table in one pass
    for a, b in runs:
        tp, sp, ep = (int(x) for x in k[a, :3])
        dp, pp, micro = groups[tp, sp, ep]
        table = ev.table(tp, sp, ep, dp, pp, micro)
        # [mode, b] sums of per-block micro-batch time, and [mode] stored bytes per sample
        sums = (table.fwd + table.bwd)[None, :, :].sum(axis=2) + (table.rc + table.tp + table.ep).sum(axis=2)
        bi = np.searchsorted(np.array(table.micro_batches), k[a:b, 3])
        mode = k[a:b, 4]
        block_sum[a:b] = sums[mode, bi]
        per_sample[a:b, 0] = table.params.sum()
        per_sample[a:b, 1] = table.expert.sum()
        per_sample[a:b, 2] = table.act.sum(axis=1)[mode] * k[a:b, 3]
    S = block_sum[prep.inverse]
    pp, vs = c["pp"].astype(float), c["vs"].astype(float)
    m = c["grad_accum"].astype(float)
    dense, expert, stored = (per_sample[prep.inverse, j] for j in range(3))
    time_lb = S / pp * (m - 1.0 / vs) + S / vs + optimizer_bound(ev, c, dense, expert)
    states = np.zeros(n)
    edp = np.maximum(c["dp"] // c["ep"], 1).astype(float)
    code = (c["zero"] * 8 + c["offload"]) * 8 + c["framework"]
    for value in np.unique(code, return_counts=True)[0]:
        z, o, f = int(value // 64), int(value // 8 % 8), int(value % 8)
        s = code == value
        wd, gd, od, _ = mem.bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], c["dp"][s].astype(float), w.precision,
                                            w.optimizer_moments)
        we, ge, oe, _ = mem.bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], edp[s], w.precision, w.optimizer_moments)
        states[s] = (wd + gd + od) * dense[s] + (we + ge + oe) * expert[s]
    last = pp - 1
    inflight_last = np.where(pp == 1, 1.0, np.where(vs == 1, np.minimum(pp - last, m),
                                                    np.minimum((pp - last - 1) * 2 + (vs - 1) * pp + 1, m * vs) / vs))
    groups = sum((c[k] > 1).astype(float) for k in ("tp", "pp", "dp", "ep"))
    allocated = (states + stored * inflight_last) / pp + mem.NCCL_BYTES_PER_GROUP * groups
    mem_lb = allocated * (1 + mem.FRAGMENTATION) + mem.CUDA_CONTEXT_BYTES
    return time_lb, mem_lb


def optimizer_bound(ev: "Evaluator", col: dict[str, np.ndarray], dense: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """The optimizer step no partition can beat: its time is linear in a rank's parameters,
    so the slowest rank takes at least what the mean rank (the model's ``dense`` and
    ``expert`` parameters per TP rank, over pp) takes. Without it, plans whose step is mostly
    a ZeRO-0 optimizer over a whole model look as fast as their compute."""
    pp = col["pp"].astype(float)
    m = col["grad_accum"].astype(float)
    return optimizer_seconds(ev, col, (dense / pp)[:, None], (expert / pp)[:, None], m[:, None])[:, 0]


def split_time_bound(ev: "Evaluator", prep: "Prepared", rows: np.ndarray) -> np.ndarray:
    """A step-time bound for plain 1F1B candidates (vs = 1) whose time-optimal split is known,
    valid for every other split too (the memory-limited ones of planner/search/memfit.py).

    Any split's slowest rank takes at least the optimal bottleneck B of its blocks' times
    (the optimum minimises exactly that maximum; pipeline sends only add), and the ranks
    together at least S, the sum over blocks; with the step ``m T_w + (S' - T_w) + ...``
    growing in T_w and S', it is at least ``(m - 1) B + S``, plus the optimizer bound
    (whatever the split). Tighter than ``lower_bounds``'s ``(m - 1) S / pp + S`` because
    B >= S / pp.
    """
    c = prep.space.columns
    out = np.empty(len(rows))
    dense, expert = np.empty(len(rows)), np.empty(len(rows))
    for j, i in enumerate(rows):
        tp, sp, ep, b, mode, pp, vs, dp, _ = (int(x) for x in prep.keys[prep.inverse[i]])
        table = ev.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
        costs = ev.unit_costs(table, mode, b)
        bottleneck = ev.partition(table, (tp, sp, ep, b, mode, pp, vs), mode, b, pp * vs)[2]
        out[j] = (int(c["grad_accum"][i]) - 1) * bottleneck + float(sum(costs))
        dense[j], expert[j] = float(table.params.sum()), float(table.expert.sum())
    out += optimizer_bound(ev, {k: v[rows] for k, v in c.items()}, dense, expert)
    return out * (1 - 1e-9)  # rounding between the two sums must not lift the bound
