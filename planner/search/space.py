"""The candidate space: every parallel configuration a framework can run, as numpy columns.

The space is the product of the structural degrees (tp, pp, dp, ep, virtual stages), the
per-rank settings (ZeRO stage, offload, recomputation, sequence parallel, framework) and the
batch split (micro-batch, accumulation). Rules are applied where they bite, so rejected
candidates are counted by reason without being materialised:

- ``indivisible``: degree combinations that break a divisibility rule (TP divides the
  attention and KV heads and stays inside a node, EP divides the routed experts and DP,
  PP x virtual stages does not exceed the pipeline units, DP divides the global batch,
  every process group holds equal shares of the nodes it spans);
- ``framework``: settings the chosen runtime cannot run (checked once per distinct
  signature with the cost model's scalar rule, so the two can never disagree).

Columns are int arrays (offload, recompute and framework as indices into the tuples of
planner/cost/parallel.py) so evaluation can be vectorised over them.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from planner.cost.activation_offload import AUTO
from planner.cost.candidates import COLUMNS, config_of
from planner.cost.parallel import (
    CP_COMMS,
    FRAMEWORKS,
    OFFLOADS,
    RECOMPUTES,
    SEARCHED_BY_DEFAULT,
    ParallelConfig,
    expert_tp_of,
    replicates_evenly,
)
from planner.hardware.placement import splits_evenly
from planner.search.rule_patterns import Degrees, FrameworkRule, Verdicts, pattern_verdicts, refusals_of, rule_pattern

# Interleaved chunks per pipeline rank tried when the user does not pin --virtual-stages: every
# count up to 8. Megatron's published configurations use 2 and 3 (SC21 Table 1, the sc21
# scripts' interleaving; reference/megatron2021_table1_weak_scaling.csv), and 6 or 8
# win some layouts here (gpt3-175b on 128 nodes: +3.4% with v = 8 over the best of 1, 2 and 4).
# Beyond 8, chunks of one or two layers lean on per-chunk costs (a send and a receive each
# way per chunk, kernel launches) that no published run calibrates; pass a list to go further.
DEFAULT_VIRTUAL_STAGES = tuple(range(1, 9))


@dataclass(frozen=True)
class Constraints:
    """What the user pinned or restricted; None means "search every valid value"."""

    dp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    zero: tuple[int, ...] | None = None
    offload: tuple[str, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    virtual_stages: tuple[int, ...] | None = None
    framework: tuple[str, ...] | None = None
    sequence_parallel: tuple[bool, ...] | None = None
    allow_tp_across_nodes: bool = False
    cp: tuple[int, ...] | None = None  # context-parallel degrees (search/context_splits.py)
    cp_comm: tuple[str, ...] | None = None
    dp_replicate: tuple[int, ...] | None = None  # hybrid-sharding groups, each searched on its own [default: 1]
    # The experts' TP: 1 (folded into EP) and/or None (the attention's tp), each searched on its own
    # [default: both, for a mixture-of-experts model] (suggest.expert_tp_choices).
    etp: tuple[int | None, ...] | None = None
    # Whether a candidate that runs out of memory may offload the activations of as few decoder
    # layers as make it fit, where the runtime can (activation_offload.py) [default: yes].
    activation_offload: bool = True


@dataclass(frozen=True)
class ModelFacts:
    """The few model facts the space depends on."""

    heads: tuple[int, ...]  # every attention head count TP must divide (LM heads, vision heads)
    kv_heads: int
    routed_experts: int
    units: int  # pipeline-partitionable layers


@dataclass
class Space:
    """Candidate columns plus the counts of candidates rejected before evaluation."""

    columns: dict[str, np.ndarray]
    rejected: dict[str, int] = field(default_factory=lambda: {"indivisible": 0, "framework": 0})
    # Per broken rule (its index): candidates it refused, and the first of them as a row of COLUMNS.
    refusals: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.columns["dp"].shape[0])

    def config(self, i: int) -> ParallelConfig:
        """Candidate i as the cost model's ParallelConfig."""
        return config_of({k: int(v[i]) for k, v in self.columns.items()})

    def subset(self, mask: np.ndarray) -> "Space":
        return Space({k: v[mask] for k, v in self.columns.items()}, dict(self.rejected), dict(self.refusals))

    def most_refused(self) -> tuple[int, ParallelConfig] | None:
        """(how many candidates, one of them) for the rule that refused the most, or None."""
        if not self.refusals:
            return None
        count, row = max(self.refusals.values(), key=lambda cr: cr[0])
        return count, config_of(dict(zip(COLUMNS, row)))


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: O(sqrt n), so callers bound ``n`` (planner/limits.py:
    the GPUs and the global batch, at most 2**24, take at most 4,096 steps)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _allowed(values: Iterable, pinned: Sequence | None) -> list:
    values = list(values)
    return values if pinned is None else [v for v in values if v in pinned]


def degree_combinations(world: int, gpus_per_node: int, global_batch: int, facts: ModelFacts,
                        cons: Constraints, cp: int = 1, head_split: int = 1,
                        nvlink_gpus: int | None = None, etp: int | None = None,
                        tp1: bool = True) -> tuple[list[Degrees], int]:
    """Valid (dp, tp, pp, ep, vs) combinations beside a context-parallel degree ``cp`` (dp x
    tp x pp x cp = world) and how many were rejected as indivisible. ``head_split``: the ranks
    a context-parallel all-to-all splits heads over besides TP (context_parallel.py). ``etp``
    1: the experts folded out of TP, so ep divides tp x dp x cp (None: experts on the attention's
    tp, ep divides dp x cp); ``tp1`` False leaves out tp 1 (where folding changes nothing).

    TP groups stay inside ``nvlink_gpus`` (Cluster.nvlink_gpus: the node, or a multi-node
    NVLink domain such as NVL72's 72 GPUs; default the node) unless allowed across.

    The divisors of a number and the virtual-stage counts a pp allows are found once, and the
    rejected count is every combination the pins allow less the valid ones (not tallied per
    (tp, pp, ep) in every branch)."""
    valid: list[Degrees] = []
    combos = 0  # (tp, pp, ep) combinations the pins allow, each with every count of vss
    vss = sorted({v for v in cons.virtual_stages or DEFAULT_VIRTUAL_STAGES if 1 <= v <= facts.units})
    experts = facts.routed_experts
    world_divisors = divisors(world)  # pp | world / tp and ep | dp x cp divide the world too: filtered from these
    world //= cp  # the ranks dp x tp x pp fill
    found: dict[int, list[int]] = {}
    pp_vss: dict[int, list[int]] = {}

    def divisors_of(n: int) -> list[int]:
        if n not in found:  # an MoE model asks once per (tp, pp) for the eps of dp
            found[n] = [d for d in world_divisors if n % d == 0]
        return found[n]

    for tp in _allowed([d for d in world_divisors if world % d == 0], cons.tp):
        if tp == 1 and not tp1:
            continue
        et = expert_tp_of(etp, tp)
        tp_ok = all(h % (tp * head_split) == 0 for h in facts.heads) and facts.kv_heads % (tp * head_split) == 0
        tp_ok = tp_ok and (cons.allow_tp_across_nodes or (nvlink_gpus or gpus_per_node) % tp == 0)
        for pp in _allowed(divisors_of(world // tp), cons.pp):
            dp = world // (tp * pp)
            if cons.dp is not None and dp not in cons.dp:
                continue
            # A dense model has no experts to shard: ep is 1, not a rejected candidate.
            eps = _allowed(divisors_of(dp * cp * tp // et), cons.ep) if experts else [1]
            combos += len(eps)
            if not (tp_ok and pp <= facts.units and global_batch % dp == 0):
                continue
            if pp not in pp_vss:
                pp_vss[pp] = [vs for vs in vss if pp * vs <= facts.units and (vs == 1 or pp > 1)]
            for ep in eps:
                if (not experts or experts % ep == 0) and _groups_split_evenly(gpus_per_node, tp, ep, dp * cp, pp, cp,
                                                                               et):
                    valid += [Degrees(dp, tp, pp, ep, vs) for vs in pp_vss[pp]]
    return valid, combos * len(vss) - len(valid)


def _groups_split_evenly(gpus_per_node: int, tp: int, ep: int, dp: int, pp: int, cp: int = 1,
                         etp: int | None = None) -> bool:
    """Every process group of the layout (expert TP innermost, then EP, expert-DP and PP; and
    TP, DP, PP for dense parameters; CP the first ``cp`` of the ``dp`` ranks after TP, which
    here count the context-parallel ones) holds equal shares of the nodes it touches. Other layouts run,
    but the collective model prices one group shape per dimension, so they are not offered:
    e.g. DP groups of 3 ranks 4 apart on 8-GPU nodes put two ranks on one node, one on the next."""
    et = tp if etp is None else etp
    return all(splits_evenly(gpus_per_node, stride, size) for stride, size in (
        (1, tp), (1, et), (et, ep), (et * ep, dp * tp // (et * ep)), (tp, dp), (tp * dp, pp), (tp, cp)))


def allowed_settings(cons: Constraints) -> list[tuple[int, int, int, int, int]]:
    """(zero, offload, recompute, sp, framework) index tuples allowed by the constraints.

    Combinations ParallelConfig itself forbids (offload without ZeRO, parameter offload
    without ZeRO-3) are not candidates at all, so they are neither evaluated nor counted; nor is
    torchtitan's per-op selective checkpointing (recompute "op") under another runtime, which
    has no such mode (not a layout it refuses, a name it does not have).
    """
    zeros = _allowed((0, 1, 2, 3), cons.zero)
    offloads = [OFFLOADS.index(o) for o in _allowed(OFFLOADS, cons.offload)]
    recomputes = [RECOMPUTES.index(r) for r in _allowed(RECOMPUTES, cons.recompute)]
    sps = [int(s) for s in _allowed((False, True), cons.sequence_parallel)]
    # torchtitan only when pinned (parallel.SEARCHED_BY_DEFAULT); FRAMEWORKS order either way.
    searched = SEARCHED_BY_DEFAULT if cons.framework is None else FRAMEWORKS
    frameworks = [FRAMEWORKS.index(f) for f in _allowed(searched, cons.framework)]
    # The rule reads zero and offload only: checked per pair, not per setting.
    pairs = [(z, o) for z in zeros for o in offloads
             if not ((OFFLOADS[o] == "optimizer" and z == 0) or (OFFLOADS[o] == "optimizer+params" and z != 3))]
    op, titan = RECOMPUTES.index("op"), FRAMEWORKS.index("torchtitan")
    return [(z, o, r, sp, fw) for (z, o), r, sp, fw in itertools.product(pairs, recomputes, sps, frameworks)
            if r != op or fw == titan]


def _micro_splits(micro: list[int], per_dp: int, pp: int) -> list[tuple[bool, list[int]]]:
    """The micro-batches ``micro`` (ascending, each dividing the per-DP-rank batch ``per_dp``)
    split by whether the accumulation per_dp / b reaches pp (True first); a side left empty is
    left out. It does for b <= per_dp // pp: a prefix."""
    cut = bisect_right(micro, per_dp // pp)
    return [(flag, mbs) for flag, mbs in ((True, micro[:cut]), (False, micro[cut:])) if mbs]


def enumerate_space(world: int, gpus_per_node: int, global_batch: int, facts: ModelFacts,
                    cons: Constraints, framework_rule: FrameworkRule, cp: int = 1, cp_comm: str = "p2p",
                    head_split: int = 1, nvlink_gpus: int | None = None, rep: int = 1, etp: int | None = None,
                    tp1: bool = True, min_accumulation: int = 1) -> Space:
    """Every candidate beside the context-parallel split (``cp``, ``cp_comm``; ``head_split`` as
    degree_combinations takes it), the hybrid-sharding groups ``rep``, the expert-TP choice (``etp``,
    ``tp1`` likewise) and the micro-batches per stage the schedule needs (``min_accumulation``: 2 for
    DualPipeV), as columns; rejected counts by reason (indivisible: degrees ``rep`` does not split)."""
    degrees, indivisible = degree_combinations(world, gpus_per_node, global_batch, facts, cons, cp, head_split,
                                               nvlink_gpus, etp, tp1)
    settings = allowed_settings(cons)
    # Micro-batches per dp, split by whether accumulation reaches the schedule's least (shared).
    micro: dict[int, list[int]] = {}
    splits: dict[tuple[int, int], list[tuple[bool, list[int]]]] = {}
    patterns: dict[tuple, int] = {}
    reps: list[tuple[Degrees, bool]] = []
    pattern_first: list[tuple[Degrees, int]] = []  # per pattern: its first block's degrees and micro-batch
    blocks: list[tuple[Degrees, list[int], int]] = []
    for deg in degrees:
        if not replicates_evenly(deg.dp, cp, deg.ep, rep, deg.tp // expert_tp_of(etp, deg.tp)):
            indivisible += 1
            continue
        split = splits.get((deg.dp, deg.pp))
        if split is None:
            if deg.dp not in micro:
                micro[deg.dp] = _allowed(divisors(global_batch // deg.dp), cons.micro_batch)
            split = splits[deg.dp, deg.pp] = _micro_splits(micro[deg.dp], global_batch // deg.dp,
                                                           deg.pp * min_accumulation)
        if not split:
            indivisible += 1
            continue
        for flag, mbs in split:
            pattern = rule_pattern(deg, flag, facts.units)
            pattern_id = patterns.get(pattern)
            if pattern_id is None:
                pattern_id = patterns[pattern] = len(reps)
                reps.append((deg, flag))
                pattern_first.append((deg, mbs[0]))
            blocks.append((deg, mbs, pattern_id))
    verdicts = (pattern_verdicts(reps, settings, framework_rule, cp, cp_comm, rep, etp, cons.activation_offload,
                                 min_accumulation)
                if reps else Verdicts(np.zeros((6, 0), dtype=np.int64), [], []))
    pattern_mbs = [0] * len(reps)  # candidates per setting of each pattern (its blocks' micro-batches)
    # Per (degrees, accumulation flag): ok settings x micro-batches, laid out at the end in one pass.
    kept: list[tuple[Degrees, int, int, list[int]]] = []  # (degrees, first ok row, ok count, micro-batches)
    framework_rejected = 0
    for deg, mbs, pattern_id in blocks:
        first, k, n_valid = verdicts.allowed[pattern_id]
        framework_rejected += (n_valid - k) * len(mbs)
        pattern_mbs[pattern_id] += len(mbs)
        if k:
            kept.append((deg, first, k, mbs))
    refusals = refusals_of(verdicts.reasons, pattern_mbs, pattern_first, global_batch,
                           (cp, CP_COMMS.index(cp_comm), rep), etp)
    columns = _layout(kept, verdicts.ok_rows, global_batch)
    n = len(columns["dp"])
    columns.update({k: np.full(n, v, dtype=np.int64) for k, v in (("cp", cp), ("cp_comm", CP_COMMS.index(cp_comm)),
                                                                   ("rep", rep))})
    columns["etp"] = columns["tp"].copy() if etp is None else np.minimum(columns["tp"], etp)
    return Space(columns, {"indivisible": indivisible, "framework": framework_rejected}, refusals)


def _layout(blocks: list[tuple[Degrees, int, int, list[int]]], ok_rows: np.ndarray,
            global_batch: int) -> dict[str, np.ndarray]:
    """The candidate columns: block (degrees, first, k, micro-batches) is ok_rows[:, first:first + k],
    each repeated for every micro-batch of the block, beside the block's degrees, micro-batches
    and accumulation.

    Built by repeats and one gather per group of columns ([5 x candidates] arrays whose rows
    are the columns), with no per-candidate division: accumulation is computed per (block,
    micro-batch) and gathered like the micro-batch."""
    if not blocks:
        return {name: np.zeros(0, dtype=np.int64) for name in COLUMNS}
    degs, first, k, mbs = zip(*blocks)
    heads = np.fromiter(itertools.chain.from_iterable(degs), np.int64, 5 * len(degs)).reshape(-1, 5).T  # [5, block]
    first, k = np.array(first, dtype=np.int64), np.array(k, dtype=np.int64)
    m = np.fromiter(map(len, mbs), np.int64, len(mbs))
    sizes = k * m
    # One "setting row" per (block, ok setting): its index in ok_rows, its micro-batch count and
    # its first candidate.
    row_m = np.repeat(m, k)
    row_setting = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k - first, k)
    row_start = np.cumsum(row_m) - row_m  # first candidate of the row
    mb_all = np.fromiter(itertools.chain.from_iterable(mbs), np.int64, int(m.sum()))
    batch = np.stack((mb_all, global_batch // (np.repeat(heads[0], m) * mb_all)))  # micro-batch, accumulation
    # Candidate -> its micro-batch in mb_all: the row's block start plus the position in the row.
    at = np.arange(int(sizes.sum())) - np.repeat(row_start - np.repeat(np.cumsum(m) - m, k), row_m)
    head = np.repeat(heads, sizes, axis=1)
    setting = np.take(ok_rows, np.repeat(row_setting, row_m), axis=1)
    return {**dict(zip(COLUMNS[:5], head)), **dict(zip(COLUMNS[5:10], setting)),
            **dict(zip(COLUMNS[10:12], np.take(batch, at, axis=1))), "aoff": np.where(setting[5] > 0, AUTO, 0)}
