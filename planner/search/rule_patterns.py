"""The framework rules as the search asks them: once per pattern of what they read (a degree
combination's tp, pp, ep above 1 and, when interleaved, divisibility and accumulation), over
every (pattern, setting) row at once, and the refusals tallied for the no-plan message."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from planner.cost.framework_rules import Coded, ConfigColumns
from planner.cost.parallel import FRAMEWORKS, OFFLOADS, RECOMPUTES, expert_tp_of

# A framework rule: for many configs (ConfigColumns), the index of the rule each breaks, -1 when
# the runtime runs it (framework_rules.first_broken). It is asked once per ``rule_pattern``, so it may
# read the settings and whether tp, pp, ep and dp exceed 1, and only when virtual stages > 1, whether
# the layers (ModelFacts.units) divide by pp x virtual stages and whether there are at least pp
# accumulation steps: nothing else.
FrameworkRule = Callable[[ConfigColumns], np.ndarray]


class Degrees(NamedTuple):
    """One (dp, tp, pp, ep, vs) combination (a tuple: hundreds are made per search)."""

    dp: int
    tp: int
    pp: int
    ep: int
    vs: int


def rule_pattern(deg: Degrees, ga_ok: bool, units: int) -> tuple[int, ...]:
    """What of a degree combination the framework rules can see (planner/cost/framework_rules.py
    ``RULES``): whether tp, pp, ep and dp exceed 1 (torchtitan needs FSDP2 over more than one rank
    beside TP or PP), and, only for an interleaved schedule (vs > 1),
    whether the layers divide by pp x v and there are at least pp accumulation steps.
    So all plain pipelines share one pattern and interleaved ones a few, and the rules run over
    (pattern x setting) rows, not every candidate. tests/test_framework_rules_in_search.py checks the
    result against direct calls over whole spaces."""
    if deg.vs == 1:
        return (min(deg.tp, 2), min(deg.pp, 2), min(deg.ep, 2), 1, True, min(deg.dp, 2))
    return (min(deg.tp, 2), units % (deg.pp * deg.vs) == 0, min(deg.ep, 2), 2, ga_ok, min(deg.dp, 2))


@dataclass
class Verdicts:
    """The framework rules' answers per pattern (``pattern_verdicts``)."""

    # [6, rows]: each pattern's runnable settings in turn, in settings order, and last whether the
    # runtime may offload activations in that setting (asked only when the search may: else 0)
    ok_rows: np.ndarray
    allowed: list[tuple[int, int, int]]  # per pattern: (its first row in ok_rows, ok count, valid count)
    # Per pattern, per broken rule (by rule): the settings it refuses (how many, the first).
    reasons: list[dict[int, tuple[int, tuple[int, int, int, int, int]]]]


def pattern_verdicts(reps: list[tuple[Degrees, bool]], settings: list[tuple[int, int, int, int, int]],
                      rule: FrameworkRule, cp: int = 1, cp_comm: str = "p2p", rep: int = 1,
                      etp: int | None = None, activation_offload: bool = False, min_accumulation: int = 1) -> Verdicts:
    """Per pattern (given by a representative degree combination and its accumulation flag):
    the settings its framework runs, how many settings are structurally valid for it, and per
    broken rule the settings it refuses (how many, the first); with ``activation_offload``, which
    of the runnable ones still run with activations offloaded (the same rules, asked again).

    One call of ``rule`` over every (pattern, setting) row, each a config with the pattern's
    facts: dp = 2 x ep keeps ep | dp (1 where the pattern's dp is), and accumulation = pp x
    ``min_accumulation`` when it reaches that (space.enumerate_space's), else 1. The answers
    are tallied with whole-array calls, not per row."""
    st = np.fromiter(itertools.chain.from_iterable(settings), np.int64, 5 * len(settings)).reshape(-1, 5)
    deg = np.array([(min(d.tp, 2), *((min(d.pp, 2), 1, 1) if d.vs == 1 else (d.pp, d.vs, int(flag))), min(d.ep, 2),
                     min(d.dp, 2)) for d, flag in reps], dtype=np.int64).reshape(-1, 6)
    n, k = len(deg), len(st)
    tp, pp, vs, ga_ok, ep, dp = np.repeat(deg.T, k, axis=1)
    z, o, r, sp, f = np.tile(st.T, n)
    valid = (sp == 0) | (tp > 1)  # sequence parallel only means something with tp > 1
    cols = ConfigColumns(dp=np.where(dp > 1, 2 * ep, 1), tp=tp, pp=pp, ep=ep, zero_stage=z, offload=Coded(o, OFFLOADS),
                         micro_batch=np.ones_like(tp), grad_accum=np.where(ga_ok == 1, pp * min_accumulation, 1),
                         recompute=Coded(r, RECOMPUTES), sequence_parallel=sp == 1, virtual_stages=vs,
                         framework=Coded(f, FRAMEWORKS), cp=cp, cp_comm=cp_comm, dp_replicate=rep,
                         etp=tp if etp is None else np.minimum(etp, tp))
    broken = np.where(valid, rule(cols), -1)
    ok = valid & (broken < 0)
    ok_at = np.flatnonzero(ok)  # row i * k + j: pattern i, setting j
    offloads = np.zeros(len(ok_at), dtype=np.int64)
    if activation_offload and ok_at.size:
        offloads = (rule(dataclasses.replace(cols, activation_offload=1))[ok_at] < 0).astype(np.int64)
    ok_counts = np.bincount(ok_at // k, minlength=n).tolist()
    valid_counts = valid.reshape(n, k).sum(axis=1).tolist()
    starts = np.concatenate(([0], np.cumsum(ok_counts))).tolist()
    allowed = [(starts[i], ok_counts[i], valid_counts[i]) for i in range(n)]
    # Per (pattern, rule) code of the refused rows: how many, and the first setting (written
    # backwards, so the first row's index is the one left).
    hit = np.flatnonzero(broken >= 0)
    rules = int(broken.max()) + 1 if broken.size else 0
    codes = hit // k * rules + broken[hit]
    counts = np.bincount(codes, minlength=n * rules)
    first = np.zeros(n * rules, dtype=np.int64)
    first[codes[::-1]] = hit[::-1] % k
    reasons: list[dict[int, tuple[int, tuple[int, int, int, int, int]]]] = [{} for _ in range(n)]
    for code in np.flatnonzero(counts).tolist():  # ascending: by pattern, then by rule
        reasons[code // rules][code % rules] = (int(counts[code]), settings[first[code]])
    return Verdicts(np.vstack((np.ascontiguousarray(st.T)[:, ok_at % k], offloads)), allowed, reasons)


def refusals_of(reasons_per_pattern: list, weights: list[int], firsts: list[tuple[Degrees, int]], global_batch: int,
              tail: tuple[int, int, int], etp: int | None = None) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Candidates each framework reason refused, with the first refused candidate as an example
    (its columns; ``tail``: the space's cp, cp_comm code and rep, then the experts' TP and no
    activation offload)."""
    refusals: dict[int, tuple[int, tuple[int, ...]]] = {}
    for reasons, weight, (deg, b) in zip(reasons_per_pattern, weights, firsts):
        for reason, (count, setting) in reasons.items():
            seen, example = refusals.get(reason, (0, ()))
            if not example:  # patterns are met in block order: the first example stands
                example = (deg.dp, deg.tp, deg.pp, deg.ep, deg.vs, *setting, b, global_batch // (deg.dp * b), *tail,
                           expert_tp_of(etp, deg.tp), 0)
            refusals[reason] = (seen + count * weight, example)
    return refusals
