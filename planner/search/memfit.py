"""Rebalance pipelines whose time-balanced split runs out of memory.

The search splits layers over stages by time only (one partition per group of candidates
that share it), then checks memory. Under 1F1B the first stage holds the most in-flight
micro-batches and, in a vision-language model, the vision tower and the embedding too: the
time-balanced split can overflow it while a split that moves layers to later stages fits.
For such candidates this module builds each stage's memory as ``StageMemory`` (an upper
bound of what ``assemble`` computes, so a split that fits it fits for real), asks the
optimal balancer for the fastest split within that limit, and re-evaluates the candidate
exactly with it (planner/cost/assemble.py).

With interleaving a rank holds v chunks (k, k + pp, ...), which a limit per contiguous stage
cannot express exactly; each chunk is held instead to an equal share of its rank's room (a
sufficient condition: v chunks within 1/v of the room each fit together), so a split found
that way fits for real, though a split that fits only by giving a rank unequal chunks is
not found.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.cost import dualpipe
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES, expert_replicas
from planner.cost.partition import default_partition
from planner.cost.rank_chunks import Split
from planner.search.bounds import bubble_share
from planner.search.evaluate import Pricing, evaluate_rows
from planner.search.keys import KeyedSpace
from planner.search.partition import StageMemory, fits_within, optimal_partition

# Candidates rebalanced per search at most (best time bound first): each costs a memory-
# constrained partition and one exact evaluation. The search stops well before this
# once the bound of the next candidate passes the K-th plan (bounds.split_time_bound): on the
# presets it rebalances 20-100. The cap only guards against pathological spaces.
MAX_REBALANCED = 512


def stage_memory(p: Pricing, ks: KeyedSpace, i: int) -> StageMemory:
    """Per pipeline unit and stage, bytes candidate ``i`` holds, bounded from above.

    Additive terms (model states, stored activations x in-flight micro-batches) are exact;
    the terms that depend on the split through a maximum or a minimum (ZeRO-3's live
    weights, a fully recomputed layer's live activations, pipeline buffers, ZeRO buckets,
    a tied head's copy of the embedding) take their largest value in ``base``. Every byte
    counts ``mem.GROWTH`` times toward the peak (memory.peak_bytes is affine).

    Interleaved (v > 1): one stage per chunk (pp x v of them), chunk k on rank k mod pp with
    that rank's in-flight count and fixed bytes, and its per-unit bytes counted v times, so
    a chunk within capacity uses at most 1/v of its rank's room: the v chunks of a rank then
    hold at most ``capacity``, and 1/v of the sum of their ``stage_bytes`` bounds the rank.
    """
    c = ks.columns
    key = ks.key_of(i)
    tp, ep, b, mode, pp, vs, fwi = key.tp, key.ep, key.micro_batch, key.recompute, key.pp, key.vs, key.framework
    dp = key.dp * p.cp // p.rep  # the ranks ZeRO shards over (ParallelConfig.dp_shard)
    zero, off, m = int(c["zero"][i]), int(c["offload"][i]), int(c["grad_accum"][i])
    edp = max(expert_replicas(key.dp * p.cp, tp, ep, int(c["etp"][i])) // p.rep, 1)
    w = p.ctx.workload
    table = p.table(ks, key)
    wd, gd, od, _ = mem.bytes_per_param(FRAMEWORKS[fwi], zero, OFFLOADS[off], dp, w.precision, w.optimizer_moments,
                                        **w.state_dtypes)
    we, ge, oe, _ = mem.bytes_per_param(FRAMEWORKS[fwi], zero, OFFLOADS[off], edp, w.precision,
                                        w.optimizer_moments, **w.state_dtypes)
    grow = mem.GROWTH
    per_block_state = (wd + gd + od) * table.params + (we + ge + oe) * table.expert
    if zero == 3 and fw.traits(FRAMEWORKS[fwi]).fsdp_pp_keeps_stage_gathered and pp > 1:
        per_block_state = per_block_state + 6.0 * (table.params + table.expert)  # memory.state_bytes' whole stage
    per_block_act = table.act[mode] * b
    starts = p.splits.units.starts
    state = (grow * np.add.reduceat(per_block_state, starts)).tolist()  # units tile the blocks in order
    act = (grow * np.add.reduceat(per_block_act, starts)).tolist()
    rank = np.arange(pp)
    group = int(mem.microbatch_groups(np.array([pp]), np.array([m]))[0])  # pp where too few to interleave
    inflight = mem.inflight_array(rank, pp, vs, m, group).astype(float)
    groups = sum(int(x > 1) for x in (tp, pp, key.dp, ep, p.cp, p.rep))
    # The buffers at their largest (buckets no smaller than a stage), the pipeline's receive buffers.
    fixed = float(mem.buffer_bytes(np.array(fwi), np.array(zero), np.inf, groups,
                                   2.0 * float(table.pp_bytes.max()) * b))
    if zero == 3:
        fixed += 4.0 * float((table.params + table.expert).max())
    if RECOMPUTES[mode] in ("full", "op"):
        fixed += float(table.act_live.max()) * b
    base = np.full(pp, grow * fixed + mem.CUDA_CONTEXT_BYTES)
    tied = p.ranks.tied
    if tied is not None and not (vs > 1 and w.pp_schedule == "dualpipev"):  # the V's rank 0 holds both ends
        base[-1] += grow * (wd + gd + od) * tied.params / tp
    if vs > 1 and w.pp_schedule == "dualpipev":  # chunk k on rank k, then back up the ranks (dualpipe.py)
        first, second = dualpipe.held(rank, pp)
        inflight, base = np.concatenate((first, second[::-1])), np.concatenate((base, base[::-1]))
    elif vs > 1:
        inflight, base = np.tile(inflight, vs), np.tile(base, vs)
    if vs > 1:
        state, act = [vs * x for x in state], [vs * x for x in act]
    return StageMemory(state=state, act=act, inflight=list(inflight), base=list(base),
                       capacity=float(p.ctx.cluster.profile.gpu.memory_bytes))


class Rebalanced(NamedTuple):
    """A candidate that fits with a memory-limited split: the split, its slowest stage's
    seconds per micro-batch, and the candidate's exact step time, peak and host bytes with it."""

    candidate: int
    parts: Split
    bottleneck: float
    step_time: float
    peak_bytes: float
    cpu_bytes: float


def megatron_split(p: Pricing, costs: list[float], stages: int, limit: float | None) -> tuple[Split, float] | None:
    """Megatron's own even split (partition.default_partition, what ``estimate`` prices) and its
    slowest stage's seconds per micro-batch, unless that is slower than ``limit``. Under
    interleaving (the only case ``rebalance`` asks) ``stage_memory`` holds each chunk to an equal
    share of its rank's room, which an even split whose first and last chunks carry the embedding
    and the head can miss while it fits: the exact evaluation decides."""
    parts = default_partition(p.model, stages)
    first = np.searchsorted(p.splits.units.starts, [a for a, _ in parts] + [p.splits.units.nblocks])
    sums = np.concatenate([[0.0], np.cumsum(costs)])
    bottleneck = float(np.max(sums[np.minimum(first[1:], len(costs))] - sums[first[:-1]]))
    return None if limit is not None and bottleneck > limit else (parts, bottleneck)


def rebalance(p: Pricing, ks: KeyedSpace, rows: np.ndarray, bar: float = float("inf")) -> list[Rebalanced]:
    """Rebalance candidates ``rows`` (pp > 1) under their memory limit, or else try Megatron's even
    split (``megatron_split``); those that now fit.

    ``bar``: a step time a candidate must reach to matter. A split whose slowest chunk takes
    B seconds per micro-batch gives a step of at least (m - 1/v) B + S/v
    (bounds.split_time_bound), so only splits with B <= (bar - S/v) / (m - 1/v) can; one pack
    (partition.fits_within) tells whether any such split fits in memory, and the candidate is
    skipped, with proof, when none does.
    """
    found: dict[int, tuple[Split, float]] = {}
    for i in rows[:MAX_REBALANCED].tolist():
        key = ks.key_of(i)
        pp, vs = key.pp, key.vs
        table = p.table(ks, key)
        # The time-only optimum of the same split problem: no memory-limited split beats it.
        paid = p.paid(key)
        fastest = p.splits.split(table, key.split, paid).optimal
        costs = p.splits.unit_costs(table, key.recompute, key.micro_batch, paid)
        m = int(ks.columns["grad_accum"][i])
        limit = None
        if m * vs > 1 and np.isfinite(bar):
            # generous by a hair: rounding must not prune a split that reaches the bar
            share = float(bubble_share(p.ctx, pp, vs))
            limit = (bar - float(sum(costs)) * share) / (m - share) * (1 + 1e-9)
            if limit < fastest:  # no split is fast enough, within memory or not
                continue
        memory = stage_memory(p, ks, i)
        part = None
        if limit is None or fits_within(costs, pp * vs, memory, limit):
            part = optimal_partition(costs, pp * vs, memory=memory, lower=fastest)
        if part is not None and part.fits:
            found[i] = (p.splits.units.blocks(part.counts), part.bottleneck)
        elif vs > 1 and (even := megatron_split(p, costs, pp * vs, limit)) is not None:
            found[i] = even  # tried exactly below: it may fit where the bound above is too coarse
    priced = evaluate_rows(p, ks, list(found), {i: parts for i, (parts, _) in found.items()})
    capacity = p.ctx.cluster.profile.gpu.memory_bytes
    # A peak over capacity cannot happen while stage_memory bounds assemble from above; kept honest anyway.
    return [Rebalanced(i, found[i][0], found[i][1], step, peak, cpu) for i, (step, peak, cpu) in priced.items()
            if peak <= capacity]
