"""Lower bounds on a candidate's step time and peak memory that no pipeline partition can beat.

They let the search skip, with proof, candidates that cannot reach the top K (branch and bound)
and reject candidates that cannot fit in memory, before partitioning or assembling anything.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost.activation_offload import AUTO
from planner.cost.block_times import BlockTable, stacked, table_rows
from planner.cost.candidates import dp_ranks, expert_ranks, expert_shard_ranks, shard_ranks, take
from planner.cost.collectives import collective_times_numbered
from planner.cost.context import CostContext
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES
from planner.cost.step_time import DP_OPS, MEGATRON, layout_keys, optimizer_seconds
from planner.search.evaluate import Pricing
from planner.search.keys import KeyedSpace
from planner.search.splits import Units


def lower_bounds(p: Pricing, ks: KeyedSpace) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, a step time and a peak memory no partition can beat (``base_bounds``
    with every candidate's ``gather_bound`` added; the search adds it lazily)."""
    time_lb, mem_lb, dense, expert = base_bounds(p, ks)
    return time_lb + gather_bound(p.ctx, ks.columns, dense, expert), mem_lb


def base_bounds(p: Pricing, ks: KeyedSpace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate: a step time and a peak memory no partition can beat, but for the
    exposed weight all-gather (``gather_bound``, which needs each layout's DP group priced:
    the search adds it only to the candidates it is about to evaluate), and the dense and
    expert parameters per TP rank that ``gather_bound`` takes.

    Time: with per-rank times T_r summing to S >= (sum of block times) and T_w = max T_r >=
    max(S / pp, ``spread_bound``), the step ``m T_w + (S - T_w) / v + dp + optimizer`` is at
    least ``max(S / pp, spread)(m - 1/v) + S / v`` (it grows with T_w and S since m >= 1 >= 1/v) plus
    ``optimizer_bound`` (the step adds the slowest rank's optimizer time, at least that, and
    its exposed DP time, at least ``gather_bound``).
    Memory: the worst rank holds at least the mean over ranks; activations at least the
    in-flight count of the last rank (the smallest).
    """
    c = ks.columns
    sums = _key_sums(p, ks)
    S = sums.block_sum[ks.inverse]
    pp, vs = c["pp"].astype(float), c["vs"].astype(float)
    m = c["grad_accum"].astype(float)
    dense, expert, stored = sums.params[ks.inverse], sums.expert[ks.inverse], sums.act[ks.inverse]
    stored = stored - _offloadable(c["aoff"], sums.dec_act[ks.inverse], p.model.num_layers)
    share, vshape = bubble_share(p.ctx, pp, vs), v_rows(p.ctx, c)
    time_lb = (np.maximum(S / pp, sums.spread[ks.inverse]) * (m - share) + S * share
               + optimizer_bound(p.ctx, c, dense, expert))
    per_dense, per_expert = _state_bytes(p.ctx, c)  # model-state bytes per dense / expert parameter
    states = per_dense * dense + per_expert * expert
    # The last rank keeps one micro-batch in flight under 1F1B (min(pp - (pp - 1), m)) and without
    # a pipeline: only interleaved schedules need memory.inflight_array.
    inflight_last = np.ones(len(pp))
    if (c["vs"] > 1).any():
        group = mem.microbatch_groups(c["pp"], c["grad_accum"])
        inflight_last = np.where((pp == 1) | vshape, 1.0, mem.inflight_array(pp - 1, pp, vs, m, group))
    held = (states + stored * inflight_last) / pp
    deep = np.nonzero((c["pp"] > 1) & ~vshape)[0]  # DualPipeV's ranks hold at least one of each chunk
    if deep.size:
        held[deep] = np.maximum(held[deep], _pipeline_held(ks, p.splits.units, deep, per_dense[deep], per_expert[deep],
                                                           states[deep], stored[deep], sums.tables, sums.run_of))
    mem_lb = mem.peak_bytes(held + mem.nccl_bytes(mem.process_groups(c)))  # buckets and pipeline buffers: >= 0
    return time_lb, mem_lb, dense, expert


def v_rows(ctx: CostContext, c: dict[str, np.ndarray]) -> np.ndarray:
    """The candidates whose pipeline runs DualPipeV (Workload.pp_schedule, pp > 1)."""
    return (c["pp"] > 1) & (ctx.workload.pp_schedule == "dualpipev")


def bubble_share(ctx: CostContext, pp, vs):
    """What of the ranks' summed micro-batch seconds a pipeline's bubble takes at least: 1/v of
    them past the slowest rank in a looped schedule (step_time.pipeline); DualPipeV's, which
    overlaps and defers weight gradients (dualpipe.bubble), is only bounded below by zero."""
    return np.where((np.asarray(pp) > 1) & (ctx.workload.pp_schedule == "dualpipev"), 0.0, 1.0 / np.asarray(vs))


def _offloadable(aoff: np.ndarray, decoder_act: np.ndarray, layers: int) -> np.ndarray:
    """Stored bytes activation offload may take off the GPU: the layers a plan names, or where the
    search decides (activation_offload.AUTO) all but one of the ``layers`` decoder layers."""
    share = np.where(aoff == AUTO, layers - 1, np.maximum(aoff, 0)) / layers
    return share * decoder_act


class _KeySums(NamedTuple):
    """Per key: the sum of its blocks' seconds per micro-batch, ``spread_bound`` of its pipeline
    units, its parameters per TP rank (dense, expert), stored activation bytes and those of its
    decoder layers; and the block tables of the (tp, sp, ep) groups with each key's table."""

    block_sum: np.ndarray
    spread: np.ndarray
    params: np.ndarray
    expert: np.ndarray
    act: np.ndarray
    dec_act: np.ndarray
    tables: list[BlockTable]
    run_of: np.ndarray


def _key_sums(p: Pricing, ks: KeyedSpace) -> _KeySums:
    """``_KeySums`` of every key. Tables built in one pass share their micro-batch sizes: they
    are stacked, so each quantity is computed over [table, mode, micro-batch, ...] at once."""
    k = ks.keys
    out = _KeySums(*(np.zeros(len(k)) for _ in range(6)), [], np.zeros(0))
    decoder = np.array([b.kind == "decoder" for b in p.model.blocks], dtype=float)  # DecoderBlock.kind
    # Keys are sorted by a code whose leading digits are (tp, sp, ep): each group is one run.
    new = np.ones(len(k), dtype=bool)
    np.any(k[1:, :3] != k[:-1, :3], axis=1, out=new[1:])
    run_of = np.cumsum(new) - 1  # per key: its group's table
    groups = {(tp, sp, ep): ks.micro[tp, sp, ep] for tp, sp, ep in k[new, :3].tolist()}
    p.tables.prepare(groups)  # every group's table in one pass
    tables = [p.tables.table(tp, sp, ep, groups[tp, sp, ep]) for tp, sp, ep in groups]
    units = p.splits.units
    by_sizes: dict[tuple[int, ...], list[int]] = {}
    for r, table in enumerate(tables):
        by_sizes.setdefault(table.micro_batches, []).append(r)
    for sizes, rs in by_sizes.items():
        ts = [tables[r] for r in rs]
        local = np.zeros(len(tables), dtype=np.int64)
        local[rs] = np.arange(len(rs))
        sel = np.flatnonzero(np.isin(run_of, rs)) if len(rs) < len(tables) else slice(None)
        lr, mode = local[run_of[sel]], k[sel, 4]
        bi = np.searchsorted(np.array(sizes), k[sel, 3])
        # Every block as the runtime that pays least for it (TP overlapped or its backward's reductions
        # under the wgrad GEMMs: tp_ov, tp_async <= tp; EP
        # overlapped: ep_ov <= ep; TE's attention saving te_*), so the bound holds for every
        # framework of the key; a workload that turns an overlap off has every runtime pay it whole.
        fb = stacked(ts, "fwd") + stacked(ts, "bwd") - stacked(ts, "te_f") - stacked(ts, "te_b")  # [table, b, block]
        w = p.ctx.workload
        fields = ("rc", "tp_async", "ep_ov" if w.ep_comm_overlap else "ep", "cp")
        rc, tpt, ept, cpt = (stacked(ts, f) for f in fields)  # [table, mode, b, block]
        if w.tp_comm_overlap:
            tpt = np.minimum(tpt, stacked(ts, "tp_ov"))
        rc = rc - stacked(ts, "te_rc")
        ept = ept + cpt
        rest = rc + tpt + ept
        _, modes, nb, blocks = rest.shape
        row = (lr * modes + mode) * nb + bi  # per key: its (table, mode, b) row
        out.block_sum[sel] = (fb.sum(axis=2)[:, None, :] + rest.sum(axis=3)).ravel()[row]
        # [row, unit] seconds per micro-batch of each pipeline unit, largest first, on the rows
        # some key reads (``at``: each row's place among them)
        used = np.flatnonzero(np.bincount(row))
        at = np.zeros(used[-1] + 1, dtype=np.intp)
        at[used] = np.arange(len(used))
        whole = np.empty((len(used), blocks + 1))
        whole[:, 0] = 0.0
        np.cumsum((fb[:, None] + rc + tpt + ept).reshape(-1, blocks)[used], axis=1, out=whole[:, 1:])
        unit_s = np.sort(whole[:, units.ends] - whole[:, units.starts], axis=1)[:, ::-1]
        # [depth, row]: the keys add dp, vs and the framework, which leave it alone
        pp = k[sel, 5]
        depths = sorted(set(pp.tolist()))
        by_depth = np.stack([_heads_bound(unit_s, d) for d in depths]) * (1 - 1e-9)
        out.spread[sel] = by_depth[np.searchsorted(depths, pp), at[row]]
        out.params[sel] = np.array([t.params.sum() for t in ts])[lr]
        out.expert[sel] = np.array([t.expert.sum() for t in ts])[lr]
        act = stacked(ts, "act")
        out.act[sel] = act.sum(axis=2)[lr, mode] * k[sel, 3]  # stored bytes
        out.dec_act[sel] = (act @ decoder)[lr, mode] * k[sel, 3]
    return out._replace(tables=tables, run_of=run_of)


def _state_bytes(ctx: CostContext, c: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: GPU model-state bytes (weights, gradients, optimizer) per dense parameter
    (sharded over dp) and per expert parameter (over its replicas: candidates.expert_shard_ranks).
    ``memory.bytes_per_param`` runs once per (framework, ZeRO, offload) present, over the group
    sizes present, not over every candidate of each setting; one lookup in the [setting x size]
    table hands out both values."""
    w = ctx.workload
    setting = (c["framework"] * 8 + c["zero"]) * 8 + c["offload"]
    ranks = shard_ranks(c)
    size = np.concatenate((ranks, np.maximum(expert_shard_ranks(c), 1)))  # dense, then expert group sizes
    sizes = np.flatnonzero(np.bincount(size))  # the sizes present, ascending
    table, n = np.zeros((int(setting.max(initial=0)) + 1, len(sizes))), sizes.astype(float)
    for code in np.flatnonzero(np.bincount(setting)).tolist():
        weights, grads, opt, _ = mem.bytes_per_param(FRAMEWORKS[code // 64], code // 8 % 8, OFFLOADS[code % 8],
                                                     n, w.precision, w.optimizer_moments,
                                                     **w.state_dtypes)
        table[code] = weights + grads + opt
    column = np.zeros(sizes.max(initial=0) + 1, dtype=np.intp)
    column[sizes] = np.arange(len(sizes))
    dense, expert = table.ravel()[column[size].reshape(2, -1) + setting * len(sizes)]
    return dense, expert


def spread_bound(units: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """Per row of ``units`` (pipeline units' seconds, largest first): a time the slowest of
    ``pp`` ranks needs whatever the split. Each unit sits on one rank, so of the j largest
    some rank holds at least ceil(j / pp), each taking at least the j-th largest: the rank
    takes ``max_j ceil(j / pp) c_(j)``. With j = 1 it is the largest unit, which bounds deep
    pipelines of uneven units (a VLM's first and last units) far above S / pp."""
    pp = np.asarray(pp)
    out = np.empty(len(units))
    for p in set(pp.tolist()):
        rows = pp == p
        out[rows] = _heads_bound(units[rows], int(p))
    return out * (1 - 1e-9)


def _heads_bound(units: np.ndarray, pp: int) -> np.ndarray:
    """``spread_bound`` along the last axis of ``units`` (largest first) at one depth, without
    its margin. Within a run of j sharing ceil(j / pp) = q the largest unit comes first, so
    only j = 1, pp + 1, 2 pp + 1, ... can give the maximum: one strided slice."""
    heads = units[..., ::pp]
    return (np.arange(1, heads.shape[-1] + 1, dtype=float) * heads).max(axis=-1)


def _pipeline_held(ks: KeyedSpace, units: Units, rows: np.ndarray, per_dense: np.ndarray,
                   per_expert: np.ndarray, states: np.ndarray, stored: np.ndarray, tables: list[BlockTable],
                   table_of: np.ndarray) -> np.ndarray:
    """For pipelines: model states plus in-flight activations on the fullest rank, bounded
    over every split of the pipeline units (rank r keeps k_r micro-batches of its stage:
    min(pp - r, m) under 1F1B, memory.inflight_array's count when interleaved).

    The fullest rank holds at least any weighted mean of the ranks, sum_r w_r f_r, and with
    f_r = sum over its units u of (s_u + a_u k_r), that is at least sum_u min_r w_r (s_u + a_u k_r)
    whichever rank each unit lands on. With w_r proportional to 1 / (sigma + k_r), sigma the
    candidate's states-to-activation ratio, each term (s_u + a_u k) / (sigma + k) is monotone in
    k, so its minimum is at the least or the most k_r (1 or min(pp, m) under 1F1B): a few
    array operations per candidate. For
    uniform layers it is about the balanced split's value; the mean-rank bound is pp / H(pp)
    lower when activations dominate (13x at pp 64), which made deep pipelines look like they fit.
    ``per_dense`` / ``per_expert``: model-state bytes per parameter of each row; ``tables``: the
    block tables of the (tp, sp, ep) groups, ``table_of`` each key's."""
    c = ks.columns
    pp = c["pp"][rows].astype(float)
    m = c["grad_accum"][rows].astype(float)
    least, top = np.ones(len(rows)), np.minimum(pp, m)
    sigma = states / np.maximum(stored, 1e-30)
    # Z = sum_r 1 / (sigma + k_r): under 1F1B pp - top + 1 ranks keep `top`, then one rank each
    # keeps top-1 .. 1. A larger Z only lowers the bound, so the sum over k may be replaced by
    # the integral of the convex 1 / (sigma + x) from 1/2 to top - 1/2, which is at least it.
    z = (pp - top + 1) / (sigma + top) + np.log((sigma + top - 0.5) / (sigma + 0.5))
    inter = np.flatnonzero(c["vs"][rows] > 1)
    if inter.size:  # interleaved: the ranks' counts follow no such run, so sum them exactly
        least[inter], top[inter], z[inter] = _interleaved_inflight(c, rows[inter], sigma[inter])
    # Units priced alike (the 126 decoder layers of a dense model) collapse into one type with
    # a count: [type x row] arrays stay small. Groups: (table, recompute), numbered in key order.
    modes = len(RECOMPUTES)
    key = ks.inverse[rows]
    group = (table_of * modes + ks.keys[:, 4])[key]
    present = np.flatnonzero(np.bincount(group))
    rank = np.zeros(present[-1] + 1, dtype=np.intp)
    rank[present] = np.arange(len(present))
    dense_t, expert_t, act_t, count_t = _unit_types(units, tables, present // modes, present % modes)
    gi = rank[group]
    s_u = per_dense * np.take(dense_t.T, gi, axis=1) + per_expert * np.take(expert_t.T, gi, axis=1)
    a_u = np.take(act_t.T, gi, axis=1) * c["micro_batch"][rows].astype(float)
    g = np.minimum((s_u + a_u * least) / (sigma + least), (s_u + a_u * top) / (sigma + top))  # [type x row]
    out = (np.ascontiguousarray(g.T) @ count_t) / z
    return out * (1 - 1e-9)  # summation order must not lift the bound


def _interleaved_inflight(c: dict[str, np.ndarray], rows: np.ndarray,
                          sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per interleaved row: the least and the most in-flight micro-batches of a rank's stage
    (memory.inflight_array, as assemble charges them) and sum_r 1 / (sigma + k_r) over its ranks."""
    pp, vs, m = (c[k][rows][:, None] for k in ("pp", "vs", "grad_accum"))
    group = mem.microbatch_groups(c["pp"][rows], c["grad_accum"][rows])[:, None]
    rank = np.arange(int(pp.max()))[None, :]
    k = mem.inflight_array(rank, pp, vs, m, group).astype(float)  # [row x rank], ranks past pp unused
    real = rank < pp
    least = np.where(real, k, np.inf).min(axis=1)
    most = np.where(real, k, -np.inf).max(axis=1)
    z = np.where(real, 1.0 / (sigma[:, None] + k), 0.0).sum(axis=1)
    return least, most, z


def _unit_types(units: Units, tables: list[BlockTable], table: np.ndarray,
                mode: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per group (``tables[table]`` under recompute ``mode``) and type of pipeline unit: dense
    and expert parameters and stored activation bytes per sample ([group x type] each), and how
    many units are of each type ([type]). Units equal in every group share a type: the 126
    decoder layers of a dense model are one type, priced once."""
    starts = units.starts
    (params, rows), (expert, _), (act, _) = (table_rows(tables, f) for f in ("params", "expert", "act"))
    # Parameters do not depend on the recompute mode: one row per table (``table`` is sorted).
    # A key equal to its neighbour breaks no tie, so lexsort orders the units as with every group's.
    once = np.concatenate(([True], table[1:] != table[:-1]))
    of_group = np.cumsum(once) - 1
    dense = np.add.reduceat(params, starts, axis=1)[rows[table[once]]]
    expert = np.add.reduceat(expert, starts, axis=1)[rows[table[once]]]
    act = np.add.reduceat(act, starts, axis=2)[rows[table], mode]
    feats = np.concatenate((dense, expert, act))  # [table + table + group x unit]
    order = np.lexsort(feats)
    ordered = feats[:, order]
    first = np.concatenate(([True], np.any(np.diff(ordered, axis=1) != 0, axis=0)))
    counts = np.diff(np.concatenate((np.flatnonzero(first), [ordered.shape[1]]))).astype(float)
    rep = order[first]
    return dense[:, rep][of_group], expert[:, rep][of_group], act[:, rep], counts


def optimizer_bound(ctx: CostContext, col: dict[str, np.ndarray], dense: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """The optimizer step no partition can beat: its time is linear in a rank's parameters,
    so the slowest rank takes at least what the mean rank (the model's ``dense`` and
    ``expert`` parameters per TP rank, over pp) takes. Without it, plans whose step is mostly
    a ZeRO-0 optimizer over a whole model look as fast as their compute."""
    pp = col["pp"].astype(float)
    m = col["grad_accum"].astype(float)
    return optimizer_seconds(ctx, col, (dense / pp)[:, None], (expert / pp)[:, None], m[:, None])[:, 0]


def gather_bound(ctx: CostContext, col: dict[str, np.ndarray], dense: np.ndarray, expert: np.ndarray) -> np.ndarray:
    """The ZeRO-1/2 weight all-gather no partition can hide where nothing overlaps it
    (step_time.dp_exposed: hidden only behind Megatron's first forward): each rank's
    exposed DP time is at least its own gather, the all-gather time grows with the bytes
    (every algorithm's term does), and the fullest rank holds at least the mean, ``dense / pp``
    (``expert / pp``) parameters, so the slowest rank's DP time is at least the gather of that.
    Dense and expert gathers run over different groups: the larger of the two is the bound."""
    n = len(col["dp"])
    out = np.zeros(n)
    hidden = np.array([f == MEGATRON and fw.grad_reduce_overlaps(fw.traits(name), 2)
                       for f, name in enumerate(FRAMEWORKS)])
    rows = np.flatnonzero(((col["zero"] == 1) | (col["zero"] == 2)) & ~hidden[col["framework"]] & (dp_ranks(col) > 1))
    if not rows.size:
        return out
    sub = take(col, rows)
    key_of, layout_of = layout_keys(ctx, sub)  # numbered as step_time.dp_collectives prices them
    dense_gather = layout_of * 3 * len(DP_OPS) + 3 * DP_OPS.index("allgather")
    which = np.stack((dense_gather, np.where(expert_ranks(sub) > 1, dense_gather + 1, -1)))
    pp = sub["pp"].astype(float)
    t = collective_times_numbered(ctx.cluster, key_of, which, np.stack((2 * dense[rows] / pp, 2 * expert[rows] / pp)))
    out[rows] = t.max(axis=0) * (1 - 1e-9)
    return out


def split_time_bound(p: Pricing, ks: KeyedSpace, rows: np.ndarray) -> np.ndarray:
    """A step-time bound for pipelined candidates whose time-optimal split is known, valid for
    every other split too (the memory-limited ones of planner/search/memfit.py).

    Any split's slowest chunk takes at least the optimal bottleneck B of its blocks' times
    (the optimum over pp x v chunks minimises exactly that maximum; pipeline sends only add),
    so the slowest rank, which holds it, takes T_w >= B; the ranks together take S' >= S, the
    sum over blocks, so T_w >= S / pp too, and T_w >= ``spread_bound`` (any split). With the
    step ``m T_w + (S' - T_w) / v + ...`` growing in T_w (m >= 1/v) and S', it is at least
    ``(m - 1/v) max(B, S / pp, spread) + S / v``, plus the optimizer and gather bounds
    (whatever the split): never looser than ``lower_bounds``'s ``(m - 1/v) max(S / pp, spread)
    + S / v``, and for 1F1B (v = 1, where B >= S / pp) ``(m - 1) B + S``.
    """
    c = ks.columns
    out = np.empty(len(rows))
    dense, expert = np.empty(len(rows)), np.empty(len(rows))
    for j, i in enumerate(rows):
        key = ks.key_of(i)
        pp, vs = key.pp, key.vs
        table = p.table(ks, key)
        paid = p.paid(key)  # the key's blocks as its runtime pays them
        costs = p.splits.unit_costs(table, key.recompute, key.micro_batch, paid)
        bottleneck = p.splits.split(table, key.split, paid).optimal
        total = float(sum(costs))
        spread = float(spread_bound(np.sort(costs)[None, ::-1], np.array([pp]))[0])
        share = float(bubble_share(p.ctx, pp, vs))
        out[j] = (int(c["grad_accum"][i]) - share) * max(bottleneck, total / pp, spread) + total * share
        dense[j], expert[j] = float(table.params.sum()), float(table.expert.sum())
    cols = take(c, rows)
    out += optimizer_bound(p.ctx, cols, dense, expert) + gather_bound(p.ctx, cols, dense, expert)
    return out * (1 - 1e-9)  # rounding between the two sums must not lift the bound
