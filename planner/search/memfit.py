"""Rebalance pipelines whose time-balanced split runs out of memory.

The search splits layers over stages by time only (one partition per group of candidates
that share it), then checks memory. Under 1F1B the first stage holds the most in-flight
micro-batches and, in a vision-language model, the vision tower and the embedding too: the
time-balanced split can overflow it while a split that moves layers to later stages fits.
For such candidates this module builds each stage's memory as ``StageMemory`` (an upper
bound of what ``assemble`` computes, so a split that fits it fits for real), asks the
optimal balancer for the fastest split within that limit, and re-evaluates the candidate
exactly with it (planner/search/assemble.py).

With interleaving a rank holds v chunks (k, k + pp, ...), which a limit per contiguous stage
cannot express exactly; each chunk is held instead to an equal share of its rank's room (a
sufficient condition: v chunks within 1/v of the room each fit together), so a split found
that way fits for real, though a split that fits only by giving a rank unequal chunks is
not found.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES
from planner.search.partition import StageMemory, fits_within, optimal_partition

if TYPE_CHECKING:
    from planner.search.evaluate import Evaluator, Prepared

# Candidates rebalanced per search at most (best time bound first): each costs a memory-
# constrained partition and one exact evaluation (~2 ms). The search stops well before this
# once the bound of the next candidate passes the K-th plan (bounds.split_time_bound): on the
# presets it rebalances 20-100. The cap only guards against pathological spaces.
MAX_REBALANCED = 512


def stage_memory(ev: "Evaluator", prep: "Prepared", i: int) -> StageMemory:
    """Per pipeline unit and stage, bytes candidate ``i`` holds, bounded from above.

    Additive terms (model states, stored activations x in-flight micro-batches) are exact;
    the terms that depend on the split through a maximum or a minimum (ZeRO-3's live
    weights, a fully recomputed layer's live activations, pipeline buffers, ZeRO buckets,
    a tied head's copy of the embedding) take their largest value in ``base``.

    Interleaved (v > 1): one stage per chunk (pp x v of them), chunk k on rank k mod pp with
    that rank's in-flight count and fixed bytes, and its per-unit bytes counted v times, so
    a chunk within capacity uses at most 1/v of its rank's room: the v chunks of a rank then
    hold at most ``capacity``, and 1/v of the sum of their ``stage_bytes`` bounds the rank.
    """
    c = prep.space.columns
    tp, sp, ep, b, mode, pp, vs, dp, fwi = (int(x) for x in prep.keys[prep.inverse[i]])
    zero, off, m = int(c["zero"][i]), int(c["offload"][i]), int(c["grad_accum"][i])
    w = ev.workload
    table = ev.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
    wd, gd, od, _ = mem.bytes_per_param(FRAMEWORKS[fwi], zero, OFFLOADS[off], dp, w.precision, w.optimizer_moments)
    we, ge, oe, _ = mem.bytes_per_param(FRAMEWORKS[fwi], zero, OFFLOADS[off], max(dp // ep, 1), w.precision,
                                        w.optimizer_moments)
    grow = 1.0 + mem.FRAGMENTATION
    per_block_state = (wd + gd + od) * table.params + (we + ge + oe) * table.expert
    per_block_act = table.act[mode] * b
    starts = ev.unit_starts
    state = (grow * np.add.reduceat(per_block_state, starts)).tolist()  # units tile the blocks in order
    act = (grow * np.add.reduceat(per_block_act, starts)).tolist()
    rank = np.arange(pp)
    inflight = mem.inflight_array(rank, pp, vs, m, mem.microbatch_group(pp, m) if vs > 1 else pp).astype(float)
    groups = sum(int(x > 1) for x in (tp, pp, dp, ep))
    fixed = mem.NCCL_BYTES_PER_GROUP * groups + 2.0 * float(table.pp_bytes.max()) * b
    if zero == 3:
        fixed += 4.0 * float((table.params + table.expert).max())
    if RECOMPUTES[mode] == "full":
        fixed += float(table.act_live.max()) * b
    if fw.traits(FRAMEWORKS[fwi]).zero_buckets:
        if zero in (1, 2):
            fixed += fw.OVERLAP_COMM_FACTOR * 2 * (fw.REDUCE_BUCKET_SIZE + fw.ALLGATHER_BUCKET_SIZE)
        elif zero == 3:
            fixed += 2 * fw.STAGE3_PREFETCH_BUCKET_SIZE + 2 * fw.REDUCE_BUCKET_SIZE
    base = np.full(pp, grow * fixed + mem.CUDA_CONTEXT_BYTES)
    if ev._tied is not None:
        base[-1] += grow * (wd + gd + od) * ev._tied[2] / tp
    if vs > 1:
        state, act = [vs * x for x in state], [vs * x for x in act]
        inflight, base = np.tile(inflight, vs), np.tile(base, vs)
    return StageMemory(state=state, act=act, inflight=list(inflight), base=list(base),
                       capacity=float(ev.cluster.profile.gpu.memory_bytes))


def rebalance(ev: "Evaluator", prep: "Prepared", rows: np.ndarray,
              bar: float = float("inf")) -> list[tuple[int, float, float, float]]:
    """Rebalance candidates ``rows`` (pp > 1) under their memory limit.

    Returns (candidate, step time, peak bytes, CPU bytes per node) for each that now fits;
    its split is recorded in ``ev.overrides`` so the Plan built later uses it. ``bar``: a step
    time a candidate must reach to matter. A split whose slowest chunk takes B seconds per
    micro-batch gives a step of at least (m - 1/v) B + S/v (bounds.split_time_bound), so only
    splits with B <= (bar - S/v) / (m - 1/v) can; one pack (partition.fits_within) tells
    whether any such split fits in memory, and the candidate is skipped, with proof, when
    none does.
    """
    fitted = []
    for i in rows[:MAX_REBALANCED]:
        i = int(i)
        tp, sp, ep, b, mode, pp, vs, dp, _ = (int(x) for x in prep.keys[prep.inverse[i]])
        table = ev.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
        # The time-only optimum of the same split problem: no memory-limited split beats it.
        fastest = ev.partition(table, (tp, sp, ep, b, mode, pp, vs), mode, b, pp * vs)[2]
        costs = ev.unit_costs(table, mode, b)
        m = int(prep.space.columns["grad_accum"][i])
        limit = None
        if m * vs > 1 and np.isfinite(bar):
            # generous by a hair: rounding must not prune a split that reaches the bar
            limit = (bar - float(sum(costs)) / vs) / (m - 1 / vs) * (1 + 1e-9)
            if limit < fastest:  # no split is fast enough, within memory or not
                continue
        memory = stage_memory(ev, prep, i)
        if limit is not None and not fits_within(costs, pp * vs, memory, limit):
            continue
        part = optimal_partition(costs, pp * vs, memory=memory, lower=fastest)
        if part.fits:
            ev.overrides[i] = (ev._blocks(part.counts), part.bottleneck)
            fitted.append(i)
    out = []
    for i, (step, peak, cpu) in ev.evaluate_rows(prep, fitted).items():
        if peak <= ev.cluster.profile.gpu.memory_bytes:
            out.append((i, step, peak, cpu))
        else:  # cannot happen while stage_memory bounds assemble from above; keep the plan honest anyway
            del ev.overrides[i]
    return out
