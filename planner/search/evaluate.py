"""Vectorised evaluation of a candidate space: memory and step time of every candidate at once.

The same model as ``planner.cost.estimate`` (planner/cost/README.md), assembled over numpy
columns instead of one configuration at a time:

1. per (tp, sp, ep): the layer cost profile and its per-block times for every micro-batch
   size (planner/search/blocks.py);
2. per (tp, sp, ep, micro-batch, recompute, pp, virtual stages): the pipeline partition, by
   both balancers (the chosen one is evaluated, both bottlenecks are reported);
3. per partition and (dp, pp send size): per-rank sums (time parts, parameters, stored
   activations) from prefix sums;
4. per candidate, over [candidates x ranks] arrays (planner/search/assemble.py): model
   states under ZeRO/offload, activations with the in-flight micro-batches, buffers, the
   pipeline, exposed DP traffic and the optimizer step.

tests/test_suggest.py checks every quantity against ``estimate`` (same config and partition).
Not modelled here: the memory-aware optimal partition (partition.StageMemory); the search
balances time, then checks memory.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost.collectives import collective_time_array
from planner.cost.layers import layer_costs
from planner.cost.parallel import FRAMEWORKS, RECOMPUTES, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, Placement, pipeline_hops
from planner.model.spec import DecoderBlock, EmbeddingBlock, LMHeadBlock, ModelSpec, VisionBlock
from planner.search.assemble import assemble
from planner.search.blocks import BlockTable, block_tables
from planner.search.partition import greedy_partition, optimal_partition
from planner.search.space import Space


@dataclass
class Prepared:
    """A space with its candidates grouped by partition/rank-table key."""

    space: Space
    keys: np.ndarray  # [key, (tp, sp, ep, micro_batch, recompute, pp, vs, dp, framework)]
    inverse: np.ndarray  # candidate -> key
    micro: dict[tuple[int, int, int], tuple[int, ...]]  # micro-batch sizes per (tp, sp, ep)
    order: np.ndarray  # candidates sorted by key
    starts: np.ndarray  # order[starts[k]:starts[k + 1]] are the candidates of key k
    zero3: np.ndarray  # per key: whether any of its candidates uses ZeRO-3 (needs the per-block collectives)


@dataclass
class Evaluation:
    """Per-candidate results, aligned with the space's columns."""

    step_time: np.ndarray
    peak_bytes: np.ndarray
    cpu_bytes: np.ndarray  # host bytes per node when offloading
    fits: np.ndarray
    partition_id: np.ndarray  # index into ``partitions``
    greedy_bottleneck: np.ndarray  # seconds per micro-batch of the slowest stage (nan: pp = 1)
    optimal_bottleneck: np.ndarray
    partitions: list[list[tuple[int, int]]] = field(default_factory=list)


def pipeline_units(model: ModelSpec) -> list[tuple[int, int]]:
    """Block ranges the balancers move as one: each layer (ViT or decoder) with the small
    blocks before it (patch embedding, projector, token embedding); the final norm and the LM
    head stay with the last layer, so the first and last stages carry them."""
    layers = [i for i, b in enumerate(model.blocks) if isinstance(b, (VisionBlock, DecoderBlock))]
    starts = [0] + [layers[k - 1] + 1 for k in range(1, len(layers))]
    ends = starts[1:] + [len(model.blocks)]
    return list(zip(starts, ends))


# Rows of a rank table (Evaluator.rank_table): per pipeline rank, one micro-batch's seconds of
# forward, backward, recompute, TP, EP and pipeline traffic; the stage's dense and expert
# parameters, its largest block, stored and live activation bytes and pipeline buffers; the
# parameters of a tied embedding's copy when the rank holds one of two (estimate._tied_group);
# the ZeRO-3 per-block gathers and reduce-scatters.
RANK_FIELDS = ("fwd", "bwd", "rc", "tp", "ep", "dense", "expert", "pp", "largest", "stored", "live", "ppbuf",
               "tied", "z3_gather", "z3_reduce")


def _padded(tables: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Rank tables of several depths as one [table x field x widest] array, zeros past each
    table's ranks (assemble reads no padded rank), and that width."""
    width = max(t.shape[1] for t in tables)
    if all(t.shape[1] == width for t in tables):
        return np.stack(tables), width
    out = np.zeros((len(tables), len(RANK_FIELDS), width))
    for i, t in enumerate(tables):
        out[i, :, :t.shape[1]] = t
    return out, width


def rank_fields(ranks: np.ndarray) -> dict[str, np.ndarray]:
    """Name the rows of rank tables ([..., field, rank] -> {field: [..., rank]}), as views."""
    return {name: ranks[..., k, :] for k, name in enumerate(RANK_FIELDS)}


class Shapes:
    """Process-group shapes of a placement, as ``estimate.build_comms`` lays ranks out.

    Each shape is summarised on first use: block tables need only tp and ep, and on
    thousands of GPUs a shape costs a sort over every rank."""

    def __init__(self, cluster: Cluster, tp: int, ep: int, dp: int, pp: int) -> None:
        self._full = Placement(cluster, dims={"tp": tp, "ep": ep, "dp": dp // ep, "pp": pp},
                               order=("tp", "ep", "dp", "pp"))
        self._dense = Placement(cluster, dims={"tp": tp, "dp": dp, "pp": pp}, order=("tp", "dp", "pp"))

    @functools.cached_property
    def tp(self) -> GroupShape:
        return self._full.group("tp")

    @functools.cached_property
    def ep(self) -> GroupShape:
        return self._full.group("ep")

    @functools.cached_property
    def edp(self) -> GroupShape:
        return self._full.group("dp")

    @functools.cached_property
    def pp(self) -> GroupShape:
        return self._full.group("pp")

    @functools.cached_property
    def dp(self) -> GroupShape:
        return self._dense.group("dp")

    @functools.cached_property
    def pp_hops(self) -> tuple[np.ndarray, GroupShape | None]:
        """placement.pipeline_hops of the pp dimension: which rank's hop to the next leaves the
        node, and the shape that prices the others (None: every hop priced alike)."""
        crosses, near = pipeline_hops(self._full.cluster, self._full.stride("pp"), self._full.dims["pp"])
        return np.array(crosses, dtype=bool), near


class Evaluator:
    """Evaluates spaces for one (model, cluster, workload); caches survive across calls."""

    def __init__(self, model: ModelSpec, cluster: Cluster, workload: Workload, balancer: str = "optimal") -> None:
        self.model, self.cluster, self.workload, self.balancer = model, cluster, workload, balancer
        self.dev = eff.device(cluster.profile, workload.precision)
        self.units = pipeline_units(model)
        # First and one-past-last block of each unit, as index arrays (prefix sums over blocks
        # become per-unit sums with one subtraction).
        self.unit_starts = np.array([a for a, _ in self.units])
        self.unit_ends = np.array([e for _, e in self.units])
        self.nblocks = len(model.blocks)
        self._shapes: dict[tuple[int, int, int, int], Shapes] = {}
        self._tables: dict[tuple, BlockTable] = {}
        self._parts: dict[tuple, tuple[list[tuple[int, int]], float, float]] = {}
        self._tied = self._tied_blocks()
        self.partitions: list[list[tuple[int, int]]] = []  # every partition any result refers to
        self._part_index: dict[tuple, int] = {}
        self._prefix: dict[tuple, tuple[BlockTable, dict[str, np.ndarray]]] = {}
        self.model_flops: float | None = None  # flops_per_step, once asked
        self._z3: dict[tuple, tuple[BlockTable, dict[str, np.ndarray]]] = {}
        self._rank_base: dict[tuple, tuple[BlockTable, dict[str, np.ndarray]]] = {}
        # Candidates whose time-balanced split ran out of memory and that were rebalanced under
        # a memory limit (planner/search/memfit.py): candidate -> (block ranges, bottleneck).
        self.overrides: dict[int, tuple[list[tuple[int, int]], float]] = {}
        self._runs: tuple[ModelSpec, np.ndarray] | None = None
        self._layer_memo: dict = {}  # layer_costs' memo for the run model (per block, tp, sp, ep)
        self._unit_costs: dict[tuple, tuple[BlockTable, list[float]]] = {}
        self._details: tuple[Prepared | None, dict[int, tuple[dict[str, np.ndarray], int]]] = (None, {})

    # -- caches ---------------------------------------------------------------------------
    def shapes(self, tp: int, ep: int, dp: int, pp: int) -> Shapes:
        key = (tp, ep, dp, pp)
        if key not in self._shapes:
            self._shapes[key] = Shapes(self.cluster, tp, ep, dp, pp)
        return self._shapes[key]

    def table(self, tp: int, sp: int, ep: int, dp: int, pp: int, micro: tuple[int, ...]) -> BlockTable:
        """The block table of (tp, sp, ep) covering ``micro`` (the TP and EP group shapes
        depend on tp and ep only: TP is innermost and EP next, whatever dp and pp are)."""
        key = (tp, sp, ep)
        t = self._tables.get(key)
        if t is not None and (t.micro_batches == micro or set(micro) <= set(t.micro_batches)):
            return t
        mbs = tuple(sorted(set(micro) | set(t.micro_batches if t else ())))
        t = self._block_table(tp, bool(sp), ep, mbs, self.shapes(tp, ep, dp, pp))
        self._tables[key] = t
        return t

    def partition(self, table: BlockTable, key: tuple, mode: int, b: int, stages: int):
        """(block ranges, greedy bottleneck, optimal bottleneck) of one partition key."""
        if key in self._parts:
            return self._parts[key]
        unit_costs = self.unit_costs(table, mode, b)
        if stages == 1:
            out = ([(0, self.nblocks)], float("nan"), float("nan"))
        else:
            g = greedy_partition(unit_costs, stages)
            o = optimal_partition(unit_costs, stages, upper=g.bottleneck)
            chosen = o if self.balancer == "optimal" else g
            out = (self._blocks(chosen.counts), g.bottleneck, o.bottleneck)
        self._parts[key] = out
        return out

    def tables(self, groups: dict[tuple[int, int, int], tuple[int, int, tuple[int, ...]]]) -> None:
        """Build the missing block tables of many (tp, sp, ep) groups in one pass.

        ``groups`` maps (tp, sp, ep) to (dp, pp, micro-batches) of one of its candidates. Every
        table covers the union of the micro-batch sizes (the kernels are elementwise in the
        size, so a wider table holds the same numbers for the sizes a group uses)."""
        todo = [(key, dp, pp) for key, (dp, pp, micro) in groups.items()
                if key not in self._tables or not set(micro) <= set(self._tables[key].micro_batches)]
        if not todo:
            return
        mbs = tuple(sorted({b for _, _, micro in groups.values() for b in micro}))
        # Tables read only the TP and EP group shapes, which depend on tp and ep alone.
        shapes: dict[tuple[int, int], Shapes] = {}
        for (tp, _, ep), dp, pp in todo:
            shapes.setdefault((tp, ep), self.shapes(tp, ep, dp, pp))
        specs = [(tp, bool(sp), ep, shapes[tp, ep]) for (tp, sp, ep), _, _ in todo]
        for (key, _, _), table in zip(todo, self._block_tables(specs, mbs)):
            self._tables[key] = table

    def _block_table(self, tp: int, sp: bool, ep: int, mbs: tuple[int, ...], shapes: Shapes) -> BlockTable:
        return self._block_tables([(tp, sp, ep, shapes)], mbs)[0]

    def _block_tables(self, specs: list[tuple[int, bool, int, Shapes]], mbs: tuple[int, ...]) -> list[BlockTable]:
        """``block_table(layer_costs(...))`` per (tp, sp, ep, shapes), priced once per run of
        identical blocks.

        A block's cost depends on the block, the workload and (for a norm) whether the block
        before it is a vision block, so the first block of each run stands for the run: the
        27 SigLIP blocks or 126 Llama layers are priced once, not once per layer, and the
        per-block arrays are expanded afterwards. Equal to the direct call
        (tests/test_search_space.py)."""
        short, pos = self._run_model()
        groups = [(layer_costs(short, self.workload, tp, sp, ep, self._layer_memo), shapes.tp, shapes.ep)
                  for tp, sp, ep, shapes in specs]
        return block_tables(groups, mbs, self.dev, self.cluster, expand=pos)

    def _run_model(self) -> tuple[ModelSpec, np.ndarray]:
        """The model with each run of identical consecutive blocks cut to its first block, and
        for every block the index of the one standing for it."""
        if self._runs is None:
            blocks = self.model.blocks
            # Most copies are one object: ``is`` answers before pydantic's field-by-field ==.
            keep = [i for i in range(len(blocks))
                    if i == 0 or (blocks[i] is not blocks[i - 1] and blocks[i] != blocks[i - 1])]
            pos = np.searchsorted(keep, np.arange(len(blocks)), side="right") - 1
            self._runs = (self.model.model_copy(update={"blocks": [blocks[i] for i in keep]}), pos)
        return self._runs

    def flops_per_step(self) -> float:
        """``estimate.model_flops`` with each run of identical blocks priced once (the same
        per-block numbers, summed in the same order)."""
        if self.model_flops is None:
            short, pos = self._run_model()
            fwd = [c.fwd_flops for c in layer_costs(short, self.workload, memo=self._layer_memo)]
            self.model_flops = 3.0 * sum(fwd[j] for j in pos.tolist()) * self.workload.global_batch
        return self.model_flops

    def unit_costs(self, table: BlockTable, mode: int, b: int) -> list[float]:
        """Seconds per micro-batch of each pipeline unit: what the balancers split (the same
        for every pp and virtual-stage count, so kept per table, mode and micro-batch)."""
        key = (id(table), mode, b)
        hit = self._unit_costs.get(key)
        if hit is None or hit[0] is not table:
            prefix = np.concatenate(([0.0], np.cumsum(table.total(mode, table.b_index(b)))))
            hit = (table, (prefix[self.unit_ends] - prefix[self.unit_starts]).tolist())
            self._unit_costs[key] = hit  # holding the table keeps its id unique
        return hit[1]

    def _blocks(self, counts: tuple[int, ...]) -> list[tuple[int, int]]:
        bounds, u = [], 0
        for c in counts:
            bounds.append((self.units[u][0], self.units[u + c - 1][1]))
            u += c
        return bounds

    def _tied_blocks(self) -> tuple[int, int, float] | None:
        blocks = self.model.blocks
        heads = [i for i, b in enumerate(blocks) if isinstance(b, LMHeadBlock) and b.tied]
        embeds = [i for i, b in enumerate(blocks) if isinstance(b, EmbeddingBlock)]
        if not heads or not embeds:
            return None
        head = blocks[heads[0]]
        return heads[0], embeds[0], float(head.vocab * head.hidden)

    # -- per-rank tables ----------------------------------------------------------------
    def _grad_bytes(self, fwi: int) -> int:
        """Bytes per gradient element on the wire (estimate._grad_comm_bytes)."""
        w = self.workload
        traits = fw.traits(FRAMEWORKS[fwi])
        return 4 if (w.precision == "fp32" or (traits.fp32_grad_buffer and w.precision == "bf16")) else 2

    def _z3_prefix(self, table: BlockTable, key: tuple, shapes: Shapes, dp: int, ep: int,
                   gbytes: int) -> dict[str, np.ndarray] | None:
        """ZeRO-3 collectives one block at a time (gather 16-bit weights, reduce-scatter
        gradients), as prefix sums over blocks; None when there is no DP group to talk to."""
        if dp == 1 and ep == 1:
            return None
        hit = self._z3.get(key)
        if hit is not None and hit[0] is table:
            return hit[1]
        edp = dp // ep

        def on(op: str, d: np.ndarray, e: np.ndarray) -> np.ndarray:
            t = collective_time_array(self.cluster, op, shapes.dp, d) if dp > 1 else np.zeros_like(d)
            if edp > 1:
                t = t + np.where(e > 0, collective_time_array(self.cluster, op, shapes.edp, e), 0.0)
            return t

        gather = on("allgather", 2 * table.params, 2 * table.expert)
        reduce = on("reducescatter", gbytes * table.params, gbytes * table.expert)
        out = {"z3_gather": np.concatenate(([0.0], np.cumsum(gather))),
               "z3_reduce": np.concatenate(([0.0], np.cumsum(reduce)))}
        self._z3[key] = (table, out)
        return out

    def _prefixes(self, table: BlockTable, mode: int, bi: int) -> np.ndarray:
        """Prefix sums over blocks of fwd, bwd, rc, tp, ep, dense, expert, act: [8 x blocks + 1]."""
        key = (id(table), mode, bi)
        hit = self._prefix.get(key)
        if hit is not None and hit[0] is table:
            return hit[1]
        series = np.stack((table.fwd[bi], table.bwd[bi], table.rc[mode, bi], table.tp[mode, bi], table.ep[mode, bi],
                           table.params, table.expert, table.act[mode]))
        sums = np.zeros((len(series), series.shape[1] + 1))
        np.cumsum(series, axis=1, out=sums[:, 1:])  # row by row, as one cumsum per series
        self._prefix[key] = (table, sums)  # holding the table keeps its id unique
        return sums

    def rank_table(self, table: BlockTable, parts: list[tuple[int, int]], mode: int, b: int, pp: int, vs: int,
                   tp: int, send_div: int, shapes: Shapes, z3: dict[str, np.ndarray] | None = None,
                   gathers: tuple[int, int] = (0, 0), transfers: int = 1, meta: float = 0.0) -> np.ndarray:
        """Per pipeline rank: one micro-batch's time parts and the stage's contents, as a
        [RANK_FIELDS x pp] matrix (one array per key, so a chunk of keys stacks in one call;
        ``rank_fields`` names its rows).

        All but the ZeRO-3 parts depend on the partition and the pp group's shape, not on dp or
        the framework (beyond how it sends across stages), so they are computed once per such key."""
        key = (id(table), tuple(parts), mode, b, pp, vs, tp, send_div, gathers, transfers, meta, shapes.pp)
        hit = self._rank_base.get(key)
        if hit is None or hit[0] is not table:
            hit = (table, self._rank_base_table(table, parts, mode, b, pp, vs, tp, send_div, shapes, gathers,
                                                transfers, meta))
            self._rank_base[key] = hit  # holding the table keeps its id unique
        if not z3:
            return hit[1]
        out = hit[1].copy()
        starts = np.array([a for a, _ in parts])
        ends = np.array([e for _, e in parts])
        for row, name in ((-2, "z3_gather"), (-1, "z3_reduce")):
            out[row] = (z3[name][ends] - z3[name][starts]).reshape(vs, pp).sum(axis=0)
        return out

    def _rank_base_table(self, table: BlockTable, parts: list[tuple[int, int]], mode: int, b: int, pp: int, vs: int,
                         tp: int, send_div: int, shapes: Shapes, gathers: tuple[int, int] = (0, 0),
                         transfers: int = 1, meta: float = 0.0) -> np.ndarray:
        """The rank table of RANK_FIELDS, ZeRO-3 rows left at zero."""
        starts = np.array([a for a, _ in parts])
        ends = np.array([e for _, e in parts])
        pre = self._prefixes(table, mode, table.b_index(b))
        # Per chunk, then the chunks of each rank (chunk k runs on rank k % pp) added up.
        sums = (pre[:, ends] - pre[:, starts]).reshape(len(pre), vs, pp).sum(axis=1)

        def chunk_max(x: np.ndarray) -> np.ndarray:
            return np.maximum.reduceat(x, starts).reshape(vs, pp).max(axis=0)

        # step_time.rank_time: each chunk sends its output forward (unless it ends the model)
        # and receives from the chunk before it (unless it starts the model).
        whole_out = np.where(ends < self.nblocks, table.pp_bytes[np.maximum(ends - 1, 0)] * b, 0.0)
        whole_in = np.where(starts > 0, table.pp_bytes[np.maximum(starts - 1, 0)] * b, 0.0)
        out = np.zeros((len(RANK_FIELDS), pp))
        out[:7] = sums[:7]  # fwd, bwd, rc, tp, ep, dense, expert
        if shapes.pp.size > 1:
            sizes = np.stack((whole_out, whole_in)) / send_div
            if meta:  # step_time.rank_time: each transfer preceded by its meta tensor
                sizes = np.concatenate((sizes, np.where(sizes > 0, meta, 0.0)))
            priced = collective_time_array(self.cluster, "p2p", shapes.pp, sizes)
            crosses, near = shapes.pp_hops
            if near is not None:  # hops inside a node go over NVLink (estimate: Comms.pp_near)
                near_priced = collective_time_array(self.cluster, "p2p", near, sizes)
                rank = np.arange(len(parts)) % pp  # chunk k runs on rank k % pp
                out_far = np.arange(len(sizes)) % 2 == 0  # rows: send, recv (, meta send, meta recv)
                priced = np.where(out_far[:, None], np.where(crosses[rank], priced, near_priced),
                                  np.where(crosses[(rank - 1) % pp], priced, near_priced))
            send_t, recv_t = priced[0::2].sum(axis=0) * transfers, priced[1::2].sum(axis=0) * transfers
            if gathers != (0, 0):  # frameworks.pp_boundary_gathers
                g_out, g_in = collective_time_array(self.cluster, "allgather", shapes.tp, np.stack((whole_out, whole_in)))
                send_t, recv_t = send_t + gathers[0] * g_out, recv_t + gathers[1] * g_in
            out[7] = (send_t + recv_t).reshape(vs, pp).sum(axis=0)
        out[8] = chunk_max(table.params + table.expert)  # largest
        out[9] = sums[7] * b  # stored activations
        if RECOMPUTES[mode] == "full":
            out[10] = chunk_max(table.act_live) * b  # live
        if pp > 1:
            out[11] = 2.0 * chunk_max(table.pp_bytes) * b  # pipeline buffers
        if self._tied is not None:
            head, embed, size = self._tied
            owner = {}
            for s, (a, e) in enumerate(parts):
                for i in (head, embed):
                    if a <= i < e:
                        owner[i] = s % pp
            if owner[head] != owner[embed]:
                out[5, owner[head]] += size / tp  # the head's copy of the embedding, on the dense row
                out[12, owner[head]] = out[12, owner[embed]] = size / tp  # the tied pair
        return out

    # -- the whole space ------------------------------------------------------------------
    def prepare(self, space: Space) -> "Prepared":
        """Group candidates by what their partition and per-rank tables depend on.

        The grouping is one stable sort of a mixed-radix code per candidate (what np.unique
        does inside), whose order is also the candidates sorted by key: no second sort."""
        c = space.columns
        cols = [c[k] for k in ("tp", "sp", "ep", "micro_batch", "recompute", "pp", "vs", "dp", "framework")]
        n = len(space)
        if not n:
            return Prepared(space, np.zeros((0, len(cols)), dtype=np.int64), np.zeros(0, dtype=np.intp), {},
                            np.zeros(0, dtype=np.intp), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=bool))
        # One int64 per row (mixed radix, Horner's scheme) so the grouping is a 1-D sort, not a row lexsort.
        radix = [int(col.max()) + 1 for col in cols]
        code = cols[0].copy()
        for col, r in zip(cols[1:], radix[1:]):
            code *= r
            code += col
        order = np.argsort(code, kind="stable")
        new = np.empty(n, dtype=bool)
        new[0] = True
        sorted_code = code[order]
        np.not_equal(sorted_code[1:], sorted_code[:-1], out=new[1:])
        cuts = np.flatnonzero(new)
        inverse = np.empty(n, dtype=np.intp)
        inverse[order] = np.cumsum(new) - 1
        first = order[cuts]
        keys = np.stack([col[first] for col in cols], axis=1)
        # Keys are sorted by their code, whose leading digits are (tp, sp, ep): each group's keys
        # form one run, met in sorted order.
        group = sorted_code[cuts] // int(np.prod(radix[3:]))
        runs = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1, [len(keys)]))
        micro = {tuple(int(x) for x in keys[a, :3]): tuple(sorted(set(keys[a:b, 3].tolist())))
                 for a, b in zip(runs[:-1], runs[1:]) if b > a}
        starts = np.concatenate((cuts, [n]))
        zero3 = np.logical_or.reduceat((c["zero"] == 3)[order], cuts)
        return Prepared(space, keys, inverse, micro, order, starts, zero3)

    def lower_bounds(self, prep: "Prepared") -> tuple[np.ndarray, np.ndarray]:
        from planner.search.bounds import lower_bounds

        return lower_bounds(self, prep)

    def evaluate(self, prep: "Prepared", key_ids: np.ndarray | None = None) -> tuple[np.ndarray, Evaluation]:
        """Full evaluation of the candidates of ``key_ids`` (all when None): (rows, results)."""
        c = prep.space.columns
        key_ids = np.arange(len(prep.keys)) if key_ids is None else np.asarray(key_ids)
        groups: list[tuple[int, np.ndarray, tuple]] = []
        for g in key_ids:
            tp, sp, ep, b, mode, pp, vs, dp, fwi = (int(x) for x in prep.keys[g])
            table = self.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
            pkey = (tp, sp, ep, b, mode, pp, vs)
            parts, gbot, obot = self.partition(table, pkey, mode, b, pp * vs)
            if pkey not in self._part_index:
                self._part_index[pkey] = len(self.partitions)
                self.partitions.append(parts)
            ranks = self._key_ranks(table, parts, (tp, sp, ep, b, mode, pp, vs, dp, fwi), bool(prep.zero3[g]))
            groups.append((int(g), ranks, (self._part_index[pkey], gbot, obot)))
        if not groups:
            empty = np.zeros(0)
            return np.zeros(0, dtype=np.int64), Evaluation(empty, empty, empty, empty.astype(bool),
                                                           empty.astype(np.int64), empty, empty, self.partitions)
        # Every depth in one assemble pass, the shallower rank tables padded with zeros.
        rows_list, local_list = [], []
        for i, (g, _, _) in enumerate(groups):
            members = prep.order[prep.starts[g]:prep.starts[g + 1]]
            rows_list.append(members)
            local_list.append(np.full(len(members), i))
        rows = np.concatenate(rows_list)
        local = np.concatenate(local_list)
        stacked, width = _padded([r for _, r, _ in groups])
        parts_of = assemble(self, {k: v[rows] for k, v in c.items()}, rank_fields(stacked[local]), width, detail=True)
        step, peak, cpu = parts_of["step_time"], parts_of["peak_bytes"], parts_of["cpu_bytes"]
        details = self._detail_of(prep)
        details.update(zip(rows.tolist(), zip(itertools.repeat(parts_of), range(len(rows)))))
        meta = np.array([mt for _, _, mt in groups])[local]
        capacity = self.cluster.profile.gpu.memory_bytes
        host = mem.host_capacity_bytes(self.cluster.profile.node.host_memory_GiB)
        return rows, Evaluation(step, peak, cpu, (peak <= capacity) & (cpu <= host), meta[:, 0].astype(np.int64), meta[:, 1], meta[:, 2],
                                self.partitions)

    def _detail_of(self, prep: "Prepared") -> dict[int, tuple[dict[str, np.ndarray], int]]:
        """Per candidate of ``prep`` evaluated in full: its ``assemble`` detail (the arrays of its
        chunk, and its position there), so building its Plan later assembles nothing again."""
        if self._details[0] is not prep:
            self._details = (prep, {})
        return self._details[1]

    def candidate(self, prep: "Prepared", i: int) -> tuple[list[tuple[int, int]], dict[str, np.ndarray], dict, tuple]:
        """Candidate ``i`` in detail: its partition, per-rank table, assembled parts, bottlenecks."""
        return self.candidates(prep, [i])[0]

    def candidates(self, prep: "Prepared", rows: list[int]) -> list[tuple[list[tuple[int, int]], dict[str, np.ndarray],
                                                                          dict, tuple]]:
        """``candidate`` of many, assembled together per pipeline depth: one numpy pass per
        depth rather than per plan (``--top 1000`` builds a thousand)."""
        out: list = [None] * len(rows)
        # Evaluated in full with their time-balanced split: the parts are known already.
        known = self._detail_of(prep)
        for j, i in enumerate(rows):
            if i in known and i not in self.overrides:
                parts, ranks, _, bottlenecks = self._one(prep, i)
                d, n = known[i]
                out[j] = (parts, rank_fields(ranks), {k: v[n:n + 1] for k, v in d.items()}, bottlenecks)
        rest = [j for j, o in enumerate(out) if o is None]
        for js, ones, d in self._by_depth(prep, [rows[j] for j in rest], detail=True):
            for n, j in enumerate(js):
                parts, ranks, _, bottlenecks = ones[j]
                out[rest[j]] = (parts, rank_fields(ranks), {k: v[n:n + 1] for k, v in d.items()}, bottlenecks)
        return out

    def evaluate_one(self, prep: "Prepared", i: int) -> tuple[float, float, float]:
        """Candidate ``i``'s (step time, peak bytes, CPU bytes per node), with its override if any."""
        return self.evaluate_rows(prep, [i])[i]

    def evaluate_rows(self, prep: "Prepared", rows: list[int]) -> dict[int, tuple[float, float, float]]:
        """``evaluate_one`` of many candidates, assembled together per pipeline depth."""
        out = {}
        for js, _, (step, peak, cpu) in self._by_depth(prep, rows, detail=False):
            out.update({rows[j]: (float(step[n]), float(peak[n]), float(cpu[n])) for n, j in enumerate(js)})
        return out

    def _by_depth(self, prep: "Prepared", rows: list[int], detail: bool):
        """Per pipeline depth among ``rows``: (positions in ``rows``, every row's ``_one``, their
        ``assemble`` output, in the order of the positions)."""
        ones = [self._one(prep, i) for i in rows]
        by_pp: dict[int, list[int]] = {}
        for j, one in enumerate(ones):
            by_pp.setdefault(one[2], []).append(j)
        for pp, js in by_pp.items():
            idx = np.array([rows[j] for j in js])
            stacked = rank_fields(np.stack([ones[j][1] for j in js]))
            yield js, ones, assemble(self, {k: v[idx] for k, v in prep.space.columns.items()}, stacked, pp, detail=detail)

    def _key_ranks(self, table: BlockTable, parts: list[tuple[int, int]], key: tuple, zero3: bool) -> np.ndarray:
        """The rank table of one key (tp, sp, ep, b, mode, pp, vs, dp, framework) split as
        ``parts``; the ZeRO-3 rows only when ``zero3`` (some candidate of it uses ZeRO-3)."""
        tp, sp, ep, b, mode, pp, vs, dp, fwi = key
        send = fw.traits(FRAMEWORKS[fwi]).pp_send
        send_div = fw.pp_send_divisor(send, tp, bool(sp))
        gathers = fw.pp_boundary_gathers(send, tp)
        traits = fw.traits(FRAMEWORKS[fwi])
        shapes = self.shapes(tp, ep, dp, pp)
        z3 = (self._z3_prefix(table, (tp, sp, ep, dp, pp, fwi), shapes, dp, ep, self._grad_bytes(fwi))
              if zero3 else None)
        return self.rank_table(table, parts, mode, b, pp, vs, tp, send_div, shapes, z3, gathers,
                               fw.pp_transfers(traits), fw.pp_meta_bytes(send, tp))

    def _one(self, prep: "Prepared", i: int) -> tuple[list[tuple[int, int]], np.ndarray, int, tuple[float, float]]:
        """Candidate ``i``'s (partition, rank table, pp, (greedy, optimal) bottlenecks)."""
        tp, sp, ep, b, mode, pp, vs, dp, fwi = (int(x) for x in prep.keys[prep.inverse[i]])
        table = self.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
        parts, gbot, obot = self.partition(table, (tp, sp, ep, b, mode, pp, vs), mode, b, pp * vs)
        if i in self.overrides:
            parts = self.overrides[i][0]
        ranks = self._key_ranks(table, parts, (tp, sp, ep, b, mode, pp, vs, dp, fwi),
                                prep.space.columns["zero"][i] == 3)
        return parts, ranks, pp, (gbot, obot)
