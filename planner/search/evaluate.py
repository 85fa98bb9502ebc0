"""Evaluate candidates in full with the cost model: per key its split, its rank table, then
memory and step time of every member (planner/cost/assemble.py).

The cost model is the one ``estimate`` applies to one candidate; what the search adds is
doing it for many keys at a time (their rank tables built together, every depth assembled in
one pass) and keeping what it learnt of each candidate (``Detail``) so that building the
winners' Plans prices nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from planner.cost import memory as mem
from planner.cost.assemble import Assembly, assemble
from planner.cost.block_times import BlockTable, BlockTables
from planner.cost.candidates import config_at, take
from planner.cost.context import CostContext
from planner.cost.paid import Paid, paid
from planner.cost.parallel import FRAMEWORKS, Workload
from planner.cost.plan import Plan
from planner.cost.plans import BlockKinds, build_plan
from planner.cost.rank_chunks import Split
from planner.cost.rank_tables import Z3_ROWS, RankSpec, RankTables, padded, rank_fields
from planner.hardware.cluster import Cluster
from planner.model.spec import ModelSpec
from planner.search.keys import Key, KeyedSpace
from planner.search.splits import SplitResult, Splits, Units


@dataclass(frozen=True)
class Pricing:
    """What a search keeps of the cost model for one (model, cluster, workload, context-parallel
    split): the block tables, the splits and the rank tables it has built. Every candidate of one
    search has the same ``cp`` (suggest searches each cp on its own and ranks them together)."""

    model: ModelSpec
    ctx: CostContext
    tables: BlockTables
    splits: Splits
    ranks: RankTables
    kinds: BlockKinds
    cp: int = 1
    rep: int = 1  # hybrid-sharding groups, one value per search as cp
    etp: int | None = None  # the routed experts' TP: None, the attention's tp; 1, folded into EP (as cp)

    @classmethod
    def of(cls, model: ModelSpec, cluster: Cluster, workload: Workload, balancer: str = "optimal", cp: int = 1,
           cp_comm: str = "p2p", rep: int = 1, etp: int | None = None) -> "Pricing":
        ctx = CostContext.of(cluster, workload)
        return cls(model, ctx, BlockTables(model, cluster, workload, ctx.dev, cp, cp_comm, etp),
                   Splits(Units(model), balancer), RankTables(model, ctx), BlockKinds(model), cp, rep, etp)

    def table(self, ks: KeyedSpace, key: Key) -> BlockTable:
        """The block table of ``key``'s group, covering the sizes its group's keys use."""
        return self.tables.table(key.tp, key.sp, key.ep, ks.micro[key.group])

    def split(self, ks: KeyedSpace, key: Key) -> SplitResult:
        return self.splits.split(self.table(ks, key), key.split, self.paid(key))

    def paid(self, key: Key) -> Paid:
        """How ``key``'s runtime pays its blocks (TP overlapped, TE's attention): its rank tables
        and its split both use it."""
        return paid(self.ctx, FRAMEWORKS[key.framework], key.sp == 1, key.tp, key.ep, key.dp * self.cp, key.pp,
                    key.vs)

    def spec(self, table: BlockTable, parts: Split, key: Key, zero3: bool) -> RankSpec:
        return RankSpec.build(table, parts, mode=key.recompute, b=key.micro_batch, pp=key.pp, vs=key.vs, tp=key.tp,
                              sp=key.sp == 1, ep=key.ep, dp=key.dp * self.cp, framework=key.framework,
                              layout=self.ctx.layout(key.tp, key.ep, key.dp * self.cp, key.pp, self.rep,
                                                     self.tables.runs.expert_tp(key.tp)),
                              zero3=zero3, paid=self.paid(key), rep=self.rep,
                              m=self.ctx.workload.global_batch // (key.micro_batch * key.dp))


class Detail(NamedTuple):
    """What a full evaluation learnt of one candidate: its ``Assembly`` and row there, its
    key's rank table and split."""

    asm: Assembly
    n: int
    ranks: np.ndarray
    split: SplitResult


@dataclass(frozen=True)
class Evaluation:
    """Per evaluated candidate (``rows``), aligned."""

    rows: np.ndarray
    step_time: np.ndarray
    peak_bytes: np.ndarray
    cpu_bytes: np.ndarray  # host bytes per node when offloading
    fits: np.ndarray
    split_id: np.ndarray  # into Splits.all
    greedy_bottleneck: np.ndarray  # seconds per micro-batch of the slowest stage (nan: pp = 1)
    optimal_bottleneck: np.ndarray
    details: dict[int, Detail]


def fits(ctx: CostContext, peak: np.ndarray, cpu: np.ndarray) -> np.ndarray:
    """Whether a peak fits on the GPU and offloaded states on the node's usable host memory."""
    profile = ctx.cluster.profile
    return (peak <= profile.gpu.memory_bytes) & (cpu <= mem.host_capacity_bytes(profile.node.host_memory_GiB))


def evaluate_keys(p: Pricing, ks: KeyedSpace, key_ids: np.ndarray | None = None) -> Evaluation:
    """Every candidate of the keys ``key_ids`` (all when None), in full."""
    key_ids = np.arange(len(ks.keys)) if key_ids is None else np.asarray(key_ids)
    specs, splits = [], []
    for g in key_ids.tolist():
        key = ks.key(g)
        table = p.table(ks, key)
        split = p.splits.split(table, key.split, p.paid(key))
        specs.append(p.spec(table, split.parts, key, bool(ks.zero3[g])))
        splits.append(split)
    if not specs:
        empty = np.zeros(0)
        return Evaluation(np.zeros(0, dtype=np.int64), empty, empty, empty, empty.astype(bool),
                          empty.astype(np.int64), empty, empty, {})
    ranks = p.ranks.tables(specs)  # every key's rank table in one pass
    members = [ks.members(g) for g in key_ids.tolist()]
    rows = np.concatenate(members)
    local = np.repeat(np.arange(len(members)), [len(m) for m in members])
    stacked, width = padded(ranks)  # every depth in one assemble pass, shallower tables padded
    asm = assemble(p.ctx, take(ks.columns, rows), rank_fields(stacked[local]), width)
    details = {i: Detail(asm, n, ranks[g], splits[g]) for n, (i, g) in enumerate(zip(rows.tolist(), local.tolist()))}
    meta = np.array([(s.id, s.greedy, s.optimal) for s in splits])[local]
    return Evaluation(rows, asm.step_time, asm.peak_bytes, asm.cpu_bytes, fits(p.ctx, asm.peak_bytes, asm.cpu_bytes),
                      meta[:, 0].astype(np.int64), meta[:, 1], meta[:, 2], details)


def evaluate_rows(p: Pricing, ks: KeyedSpace, rows: list[int],
                  overrides: dict[int, Split]) -> dict[int, tuple[float, float, float]]:
    """(step time, peak bytes, CPU bytes per node) of candidates ``rows``, each with its own
    split where ``overrides`` names one, assembled together per pipeline depth."""
    out = {}
    for js, _, asm in _by_depth(p, ks, rows, overrides):
        out.update({rows[j]: (float(asm.step_time[n]), float(asm.peak_bytes[n]), float(asm.cpu_bytes[n]))
                    for n, j in enumerate(js)})
    return out


def candidate_details(p: Pricing, ks: KeyedSpace, rows: list[int], known: dict[int, Detail],
                      overrides: dict[int, Split]) -> list[Detail]:
    """Per candidate of ``rows``, its ``Detail``: from ``known`` (a full evaluation with its key's
    split), else assembled now (with its override's split), per pipeline depth."""
    out: list = [None] * len(rows)
    zero = ks.columns["zero"]
    for j, i in enumerate(rows):
        if i in known and i not in overrides:
            d = known[i]
            if zero[i] != 3 and d.ranks[Z3_ROWS].any():  # the key's ZeRO-3 rows, which this candidate's table has not
                ranks = d.ranks.copy()
                ranks[Z3_ROWS] = 0.0
                d = d._replace(ranks=ranks)
            out[j] = d
    rest = [j for j, o in enumerate(out) if o is None]
    for js, ones, asm in _by_depth(p, ks, [rows[j] for j in rest], overrides):
        for n, j in enumerate(js):
            split, ranks = ones[j]
            out[rest[j]] = Detail(asm, n, ranks, split)
    return out


def build_plans(p: Pricing, ks: KeyedSpace, rows: list[int], known: dict[int, Detail],
                overrides: dict[int, Split]) -> list[tuple[Plan, tuple[float, float]]]:
    """Candidates ``rows`` as Plans, each with its (greedy, optimal) balancer bottlenecks."""
    flops = p.tables.runs.flops_per_step()
    out = []
    for i, d in zip(rows, candidate_details(p, ks, rows, known, overrides)):
        parts = overrides.get(i, d.split.parts)
        plan = build_plan(p.model, p.ctx, config_at(ks.columns, i), parts, d.ranks, d.asm, d.n, flops, p.kinds)
        out.append((plan, (d.split.greedy, d.split.optimal)))
    return out


def _one(p: Pricing, ks: KeyedSpace, i: int, overrides: dict[int, Split]) -> tuple[SplitResult, np.ndarray]:
    """Candidate ``i``'s split (its key's; the parts of its override if any) and rank table."""
    key = ks.key_of(i)
    table = p.table(ks, key)
    split = p.splits.split(table, key.split, p.paid(key))
    parts = overrides.get(i, split.parts)
    return split, p.ranks.tables([p.spec(table, parts, key, bool(ks.columns["zero"][i] == 3))])[0]


def _by_depth(p: Pricing, ks: KeyedSpace, rows: list[int],
              overrides: dict[int, Split]) -> Iterator[tuple[list[int], list, Assembly]]:
    """Per pipeline depth among ``rows``: (positions in ``rows``, every row's ``_one``, their
    ``Assembly``, in the order of the positions)."""
    ones = [_one(p, ks, i, overrides) for i in rows]
    by_pp: dict[int, list[int]] = {}
    for j, (_, ranks) in enumerate(ones):
        by_pp.setdefault(ranks.shape[1], []).append(j)
    for pp, js in by_pp.items():
        idx = np.array([rows[j] for j in js])
        stacked = rank_fields(np.stack([ones[j][1] for j in js]))
        yield js, ones, assemble(p.ctx, take(ks.columns, idx), stacked, pp)
