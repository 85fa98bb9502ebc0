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
from typing import NamedTuple

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost.collectives import collective_time_array, collective_times_keyed
from planner.cost.layers import layer_costs
from planner.cost.parallel import FRAMEWORKS, RECOMPUTES, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, Placement, pipeline_hops
from planner.model.spec import ModelSpec
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
    # By kind (VisionBlock.kind, DecoderBlock.kind): isinstance against a pydantic model class
    # goes through ABCMeta's subclass check, ~2k instructions each time it fails.
    layers = [i for i, b in enumerate(model.blocks) if b.kind in ("vision", "decoder")]
    starts = [0] + [layers[k - 1] + 1 for k in range(1, len(layers))]
    ends = starts[1:] + [len(model.blocks)]
    return list(zip(starts, ends))


# Rows of a rank table (Evaluator.rank_tables): per pipeline rank, one micro-batch's seconds of
# forward, backward, recompute, TP, EP and pipeline traffic; the stage's dense and expert
# parameters, its largest block, stored and live activation bytes and pipeline buffers; the
# parameters of a tied embedding's copy when the rank holds one of two (estimate._tied_group);
# the ZeRO-3 per-block gathers and reduce-scatters.
RANK_FIELDS = ("fwd", "bwd", "rc", "tp", "ep", "dense", "expert", "pp", "largest", "stored", "live", "ppbuf",
               "tied", "z3_gather", "z3_reduce")
_Z3_ROWS = [RANK_FIELDS.index("z3_gather"), RANK_FIELDS.index("z3_reduce")]  # zero unless the candidate runs ZeRO-3


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


class RankSpec(NamedTuple):
    """What one rank table depends on, its ZeRO-3 rows aside (Evaluator.rank_tables): the
    split, the micro-batch and recompute mode, the pipeline shape and how the framework sends
    across stages (frameworks.pp_send_divisor, pp_boundary_gathers, pp_transfers, pp_meta_bytes)."""

    table: BlockTable
    parts: list[tuple[int, int]]
    mode: int
    b: int
    pp: int
    vs: int
    tp: int
    send_div: int
    shapes: Shapes
    gathers: tuple[int, int] = (0, 0)
    transfers: int = 1
    meta: float = 0.0

    def cache_key(self) -> tuple:
        return (id(self.table), tuple(self.parts), self.mode, self.b, self.pp, self.vs, self.tp, self.send_div,
                self.gathers, self.transfers, self.meta, self.shapes.pp)


def _with_z3(base: np.ndarray, spec: RankSpec, z3: dict[str, np.ndarray] | None) -> np.ndarray:
    """``base`` with its ZeRO-3 rows summed from the prefix sums ``z3`` (a copy; ``base`` itself
    when there are none)."""
    if not z3:
        return base
    out = base.copy()
    starts = np.array([a for a, _ in spec.parts])
    ends = np.array([e for _, e in spec.parts])
    for row, name in ((-2, "z3_gather"), (-1, "z3_reduce")):
        out[row] = (z3[name][ends] - z3[name][starts]).reshape(spec.vs, spec.pp).sum(axis=0)
    return out


class _Chunks:
    """The chunks of several rank-table specs laid end to end, spec after spec (chunk k of a
    spec runs on its rank k % pp), and the specs' ranks side by side as columns, so that one
    numpy call computes a quantity for every spec."""

    # Per-spec numbers, repeated per chunk (``chunk``) and per rank (``rank``).
    VALUES = ("b", "send_div", "meta", "transfers", "gather_out", "gather_in", "full", "pp", "tied_copy")

    def __init__(self, specs: list[RankSpec], nblocks: int, tied_size: float) -> None:
        self.specs = specs
        tables: dict[int, tuple[int, BlockTable]] = {}
        prefixes: dict[tuple, tuple[int, RankSpec]] = {}
        for s in specs:
            tables.setdefault(id(s.table), (len(tables), s.table))
            prefixes.setdefault((id(s.table), s.mode, s.b), (len(prefixes), s))
        self.prefix_specs = [s for _, s in prefixes.values()]  # one per distinct (table, mode, b)
        stride = nblocks + 1  # a table's blocks and one padding block (an end index stays in bounds)
        counts, pps, prefix, base = np.array([(len(s.parts), s.pp, prefixes[id(s.table), s.mode, s.b][0],
                                               tables[id(s.table)][0] * stride) for s in specs]).T
        values = np.array([(s.b, s.send_div, s.meta, s.transfers, *s.gathers, RECOMPUTES[s.mode] == "full", s.pp,
                            tied_size / s.tp) for s in specs], dtype=float).T
        self.chunk = dict(zip(self.VALUES, np.repeat(values, counts, axis=1)))
        self.rank = dict(zip(self.VALUES, np.repeat(values, pps, axis=1)))
        self.counts, self.pps = counts, pps
        chunks = int(counts.sum())
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(s.parts for s in specs))
        bounds = np.fromiter(flat, dtype=np.int64, count=2 * chunks).reshape(chunks, 2)
        self.starts, self.ends = bounds[:, 0], bounds[:, 1]
        self.rank_start = np.concatenate(([0], np.cumsum(pps)))
        self.width = int(self.rank_start[-1])
        pp, first_chunk, first_rank, self.prefix, self.block_base = np.repeat(
            np.stack((pps, np.cumsum(counts) - counts, self.rank_start[:-1], prefix, base)), counts, axis=1)
        k = np.arange(len(bounds)) - first_chunk
        rank, self.virtual = k % pp, k // pp
        self.column, self.previous_column = first_rank + rank, first_rank + (rank - 1) % pp
        # The distinct tables' largest-block candidates (params + expert), live activations and
        # pipeline bytes per sample: [3 x table and block].
        arrays = np.zeros((3, len(tables), stride))
        for j, t in tables.values():
            arrays[:, j, :nblocks] = (t.params + t.expert, t.act_live, t.pp_bytes)
        self.block_arrays = arrays.reshape(3, -1)

    def rank_sum(self, x: np.ndarray) -> np.ndarray:
        """[rows x chunk] -> [rows x rank]: each rank's chunks added in chunk order (np.bincount
        adds in input order, as reshape(vs, pp).sum(axis=0) adds the virtual stages in turn)."""
        rows = len(x)
        index = (np.arange(rows)[:, None] * self.width + self.column).ravel()
        return np.bincount(index, weights=x.ravel(), minlength=rows * self.width).reshape(rows, self.width)

    def rank_max(self, x: np.ndarray) -> np.ndarray:
        """[rows x chunk] -> [rows x rank]: each rank's largest chunk value (values >= 0)."""
        grid = np.zeros((len(x), int(self.virtual.max()) + 1, self.width))
        grid[:, self.virtual, self.column] = x
        return grid.max(axis=1)

    def block_max(self) -> np.ndarray:
        """Per chunk, its largest block in each row of ``block_arrays``: [3 x chunk]."""
        index = np.stack((self.starts + self.block_base, self.ends + self.block_base), axis=1).ravel()
        return np.maximum.reduceat(self.block_arrays, index, axis=1)[:, ::2]  # odd entries: between chunks


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
        self._rank_base: dict[tuple, tuple[BlockTable, np.ndarray]] = {}
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
        return block_tables(groups, mbs, self.dev, self.cluster, runs=np.bincount(pos))

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
        kinds = [b.kind for b in blocks]  # LMHeadBlock.kind, EmbeddingBlock.kind (see pipeline_units)
        heads = [i for i, k in enumerate(kinds) if k == "lm_head" and blocks[i].tied]
        embeds = [i for i, k in enumerate(kinds) if k == "embedding"]
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

    def _prefixes(self, specs: list[RankSpec]) -> np.ndarray:
        """Prefix sums over blocks of fwd, bwd, rc, tp, ep, dense, expert, act of each spec's
        (table, mode, micro-batch): [8 x spec x blocks + 1]; the missing ones in one cumsum."""
        keys = [(id(s.table), s.mode, s.table.b_index(s.b)) for s in specs]
        todo = [(key, s) for key, s in zip(keys, specs)
                if (hit := self._prefix.get(key)) is None or hit[0] is not s.table]
        if todo:
            series = np.stack([row for (_, mode, bi), s in todo for row in (
                s.table.fwd[bi], s.table.bwd[bi], s.table.rc[mode, bi], s.table.tp[mode, bi], s.table.ep[mode, bi],
                s.table.params, s.table.expert, s.table.act[mode])])
            sums = np.zeros((len(todo), 8, series.shape[1] + 1))
            np.cumsum(series.reshape(len(todo), 8, -1), axis=2, out=sums[:, :, 1:])  # each series on its own
            for (key, s), one in zip(todo, sums):
                self._prefix[key] = (s.table, one)  # holding the table keeps its id unique
        return np.stack([self._prefix[key][1] for key in keys], axis=1)

    def rank_tables(self, specs: list[tuple[RankSpec, dict[str, np.ndarray] | None]]) -> list[np.ndarray]:
        """Per (spec, ZeRO-3 prefix sums or None): one micro-batch's time parts and the stage's
        contents per pipeline rank, as a [RANK_FIELDS x pp] matrix (one array per spec, so a
        chunk of keys stacks in one call; ``rank_fields`` names its rows).

        All but the ZeRO-3 parts depend on the spec, not on dp or the framework (beyond how it
        sends across stages), so they are kept per spec; the missing ones are built together."""
        keys = [spec.cache_key() for spec, _ in specs]
        missing: dict[tuple, RankSpec] = {}
        for key, (spec, _) in zip(keys, specs):
            hit = self._rank_base.get(key)
            if hit is None or hit[0] is not spec.table:
                missing[key] = spec
        if missing:
            for (key, spec), ranks in zip(missing.items(), self._rank_base_tables(list(missing.values()))):
                self._rank_base[key] = (spec.table, ranks)  # holding the table keeps its id unique
        return [_with_z3(self._rank_base[key][1], spec, z3) for key, (spec, z3) in zip(keys, specs)]

    def _rank_base_tables(self, specs: list[RankSpec]) -> list[np.ndarray]:
        """The rank tables of RANK_FIELDS of many specs, ZeRO-3 rows left at zero.

        A search evaluates a few keys at a time, where numpy's fixed cost per call outweighs
        the arithmetic of one key: every spec's chunks are laid end to end (_Chunks), so each
        quantity takes one call for all specs. A rank's chunks are added in chunk order, as
        one spec's reshape(vs, pp).sum(axis=0) does, so each table is bit for bit the same."""
        ch = _Chunks(specs, self.nblocks, self._tied[2] if self._tied else 0.0)
        pre = self._prefixes(ch.prefix_specs)
        # Per chunk: fwd, bwd, rc, tp, ep, dense, expert, stored activations per sample, pipeline seconds.
        per_chunk = np.empty((9, len(ch.starts)))
        np.subtract(pre[:, ch.prefix, ch.ends], pre[:, ch.prefix, ch.starts], out=per_chunk[:8])
        per_chunk[8] = self._pipeline_seconds(ch)
        sums = ch.rank_sum(per_chunk)
        largest, live, buf = ch.rank_max(ch.block_max())
        b = ch.rank["b"]
        out = np.zeros((len(RANK_FIELDS), ch.width))
        out[:7] = sums[:7]  # fwd, bwd, rc, tp, ep, dense, expert
        out[7] = sums[8]  # pp
        out[8] = largest
        out[9] = sums[7] * b  # stored activations
        out[10] = np.where(ch.rank["full"] > 0, live * b, 0.0)  # live, under full recompute
        out[11] = np.where(ch.rank["pp"] > 1, 2.0 * buf * b, 0.0)  # pipeline buffers
        if self._tied is not None:
            self._tied_rows(out, ch)
        return np.split(out, ch.rank_start[1:-1], axis=1)

    def _pipeline_seconds(self, ch: "_Chunks") -> np.ndarray:
        """Per chunk: one micro-batch's pipeline traffic, every spec's transfers priced in one
        ``collective_times_keyed`` call. step_time.rank_time: each chunk sends its output
        forward (unless it ends the model) and receives from the chunk before it (unless it
        starts the model), each transfer preceded by its meta tensor where there is one;
        frameworks.pp_boundary_gathers adds TP all-gathers of the whole boundary tensor."""
        c = ch.chunk
        pp_bytes = ch.block_arrays[2]
        whole_out = np.where(ch.ends < self.nblocks, pp_bytes[ch.block_base + np.maximum(ch.ends - 1, 0)] * c["b"], 0.0)
        whole_in = np.where(ch.starts > 0, pp_bytes[ch.block_base + np.maximum(ch.starts - 1, 0)] * c["b"], 0.0)
        sent, received = whole_out / c["send_div"], whole_in / c["send_div"]
        sizes = np.stack((sent, received, np.where(sent > 0, c["meta"], 0.0), np.where(received > 0, c["meta"], 0.0),
                          whole_out, whole_in))
        keys, which = self._pipeline_keys(ch)
        # Only the rows with something to price: meta tensors and TP gathers are DeepSpeed's.
        used = (which >= 0).any(axis=1)
        p = np.zeros_like(sizes)
        if used.any():
            p[used] = collective_times_keyed(self.cluster, keys, which[used], sizes[used])
        # No meta tensor or gather: its rows priced at zero seconds, added exactly.
        send = (p[0] + p[2]) * c["transfers"] + c["gather_out"] * p[4]
        recv = (p[1] + p[3]) * c["transfers"] + c["gather_in"] * p[5]
        return send + recv

    def _pipeline_keys(self, ch: "_Chunks") -> tuple[list[tuple[str, GroupShape]], np.ndarray]:
        """The (op, shape) pairs of every spec's pipeline transfers and, per row of
        ``_pipeline_seconds``' sizes and chunk, the pair that prices it (-1: nothing). A hop
        inside a node goes over NVLink (estimate: Comms.pp_near): the send of a chunk on rank r
        takes hop r, its receive hop r - 1 (placement.pipeline_hops)."""
        pairs: dict[tuple[str, GroupShape], int] = {}
        per_spec, crosses = [], []
        for s in ch.specs:
            if s.shapes.pp.size > 1:
                hops, near = s.shapes.pp_hops
                far = pairs.setdefault(("p2p", s.shapes.pp), len(pairs))
                near_key = far if near is None else pairs.setdefault(("p2p", near), len(pairs))
                gather = -1 if s.gathers == (0, 0) else pairs.setdefault(("allgather", s.shapes.tp), len(pairs))
                per_spec.append((far, near_key, gather))
                crosses.append(hops)
            else:
                per_spec.append((-1, -1, -1))
                crosses.append(np.zeros(s.pp, dtype=bool))
        far, near, gather = np.repeat(np.array(per_spec).T, ch.counts, axis=1)
        hop = np.concatenate(crosses)
        send, recv = np.where(hop[ch.column], far, near), np.where(hop[ch.previous_column], far, near)
        return list(pairs), np.stack((send, recv, send, recv, gather, gather))

    def _tied_rows(self, out: np.ndarray, ch: "_Chunks") -> None:
        """estimate._tied_group: where a tied embedding's copy sits on another rank than the
        embedding, the head's rank holds it on the dense row, and both ranks mark the pair."""
        head, embed, _ = self._tied
        heads, embeds = (ch.column[(ch.starts <= i) & (i < ch.ends)] for i in (head, embed))  # a chunk per spec
        apart = heads != embeds
        heads, embeds = heads[apart], embeds[apart]
        copy = out[12, heads] = out[12, embeds] = ch.rank["tied_copy"][heads]
        out[5, heads] += copy  # the head's copy of the embedding, on the dense row

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
        todo: list[tuple[BlockTable, list[tuple[int, int]], tuple, bool]] = []
        found: list[tuple[int, tuple]] = []
        for g in key_ids:
            tp, sp, ep, b, mode, pp, vs, dp, fwi = key = tuple(int(x) for x in prep.keys[g])
            table = self.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
            pkey = (tp, sp, ep, b, mode, pp, vs)
            parts, gbot, obot = self.partition(table, pkey, mode, b, pp * vs)
            if pkey not in self._part_index:
                self._part_index[pkey] = len(self.partitions)
                self.partitions.append(parts)
            todo.append((table, parts, key, bool(prep.zero3[g])))
            found.append((int(g), (self._part_index[pkey], gbot, obot)))
        # Every key's rank table in one pass (a few keys per call: numpy's cost per call dominates).
        groups = [(g, ranks, meta) for (g, meta), ranks in zip(found, self._key_ranks(todo))]
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
        metas = [mt for _, _, mt in groups]
        details.update((i, (parts_of, n, groups[g][1], metas[g]))
                       for i, n, g in zip(rows.tolist(), range(len(rows)), local.tolist()))
        meta = np.array(metas)[local]
        capacity = self.cluster.profile.gpu.memory_bytes
        host = mem.host_capacity_bytes(self.cluster.profile.node.host_memory_GiB)
        return rows, Evaluation(step, peak, cpu, (peak <= capacity) & (cpu <= host), meta[:, 0].astype(np.int64), meta[:, 1], meta[:, 2],
                                self.partitions)

    def _detail_of(self, prep: "Prepared") -> dict[int, tuple[dict[str, np.ndarray], int, np.ndarray, tuple]]:
        """Per candidate of ``prep`` evaluated in full: its ``assemble`` detail (the arrays of its
        chunk, and its position there), its key's rank table and (partition id, greedy and
        optimal bottlenecks), so building its Plan later assembles nothing again."""
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
        return [(parts, rank_fields(ranks), {k: v[n:n + 1] for k, v in d.items()}, bottlenecks)
                for parts, ranks, d, n, bottlenecks in self.candidate_parts(prep, rows)]

    def candidate_parts(self, prep: "Prepared", rows: list[int]) -> list[tuple[list[tuple[int, int]], np.ndarray,
                                                                               dict[str, np.ndarray], int, tuple]]:
        """``candidates`` unsliced: per row, (partition, [RANK_FIELDS x pp] rank table, the
        ``assemble`` detail holding it, its position there, bottlenecks), for callers that read
        a few numbers of each (plans.build_plans) rather than every array."""
        out: list = [None] * len(rows)
        # Evaluated in full with their time-balanced split: everything is known already.
        known = self._detail_of(prep)
        zero = prep.space.columns["zero"]
        for j, i in enumerate(rows):
            if i in known and i not in self.overrides:
                d, n, ranks, (pid, gbot, obot) = known[i]
                if zero[i] != 3 and ranks[_Z3_ROWS].any():  # the key's ZeRO-3 rows, which this candidate's table has not
                    ranks = ranks.copy()
                    ranks[_Z3_ROWS] = 0.0
                out[j] = (self.partitions[pid], ranks, d, n, (gbot, obot))
        rest = [j for j, o in enumerate(out) if o is None]
        for js, ones, d in self._by_depth(prep, [rows[j] for j in rest], detail=True):
            for n, j in enumerate(js):
                parts, ranks, _, bottlenecks = ones[j]
                out[rest[j]] = (parts, ranks, d, n, bottlenecks)
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

    def _key_ranks(self, keys: list[tuple[BlockTable, list[tuple[int, int]], tuple, bool]]) -> list[np.ndarray]:
        """The rank tables of keys (tp, sp, ep, b, mode, pp, vs, dp, framework), each given as
        (block table, split, key, zero3), built together; the ZeRO-3 rows only when ``zero3``
        (some candidate of the key uses ZeRO-3)."""
        specs = []
        for table, parts, key, zero3 in keys:
            tp, sp, ep, b, mode, pp, vs, dp, fwi = key
            traits = fw.traits(FRAMEWORKS[fwi])
            send = traits.pp_send
            shapes = self.shapes(tp, ep, dp, pp)
            z3 = (self._z3_prefix(table, (tp, sp, ep, dp, pp, fwi), shapes, dp, ep, self._grad_bytes(fwi))
                  if zero3 else None)
            spec = RankSpec(table, parts, mode, b, pp, vs, tp, fw.pp_send_divisor(send, tp, bool(sp)), shapes,
                            fw.pp_boundary_gathers(send, tp), fw.pp_transfers(traits), fw.pp_meta_bytes(send, tp))
            specs.append((spec, z3))
        return self.rank_tables(specs)

    def _one(self, prep: "Prepared", i: int) -> tuple[list[tuple[int, int]], np.ndarray, int, tuple[float, float]]:
        """Candidate ``i``'s (partition, rank table, pp, (greedy, optimal) bottlenecks)."""
        tp, sp, ep, b, mode, pp, vs, dp, fwi = (int(x) for x in prep.keys[prep.inverse[i]])
        table = self.table(tp, sp, ep, dp, pp, prep.micro[(tp, sp, ep)])
        parts, gbot, obot = self.partition(table, (tp, sp, ep, b, mode, pp, vs), mode, b, pp * vs)
        if i in self.overrides:
            parts = self.overrides[i][0]
        ranks = self._key_ranks([(table, parts, (tp, sp, ep, b, mode, pp, vs, dp, fwi),
                                  bool(prep.space.columns["zero"][i] == 3))])[0]
        return parts, ranks, pp, (gbot, obot)
