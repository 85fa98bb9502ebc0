"""What a rank table is built from (``RankSpec``) and its chunks (``Chunks``): many specs'
pipeline chunks laid end to end, and which rank, virtual stage and pipeline hops each takes
(looped, or DualPipeV's V: planner/cost/dualpipe.py)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from planner.cost import frameworks as fw
from planner.cost import pipeline_sends as ps
from planner.cost.block_times import BlockTable
from planner.cost.layout import Layout
from planner.cost.paid import Paid
from planner.cost.parallel import FRAMEWORKS, RECOMPUTES

Split = list[tuple[int, int]]


class RankSpec(NamedTuple):
    """What one rank table depends on: the block table, the split, the micro-batch and
    recompute mode, the pipeline shape and how the runtime sends across stages; and, for its
    ZeRO-3 rows (``zero3``), the data-parallel degree, its hybrid-sharding groups and the framework."""

    table: BlockTable
    parts: Split
    mode: int
    b: int
    pp: int
    vs: int
    tp: int
    ep: int
    dp: int
    framework: int
    send_div: int
    layout: Layout
    gathers: tuple[int, int] = (0, 0)
    transfers: int = 1
    meta: float = 0.0
    zero3: bool = False
    overlap: bool = False  # TP collectives overlapped with the GEMMs (frameworks.Traits.tp_comm_overlap)
    te: bool = False  # attention through Transformer Engine (frameworks.Traits.te_attention)
    rep: int = 1  # hybrid-sharding groups of the dp ranks (ParallelConfig.dp_replicate)
    ep_overlap: bool = False  # expert all-to-alls overlapped with another micro-batch (Traits.ep_comm_overlap)
    m: int = 1  # micro-batches per step (how many of a rank's passes the overlap merges: merged_share)
    tp_async: bool = False  # the backward's TP reductions under the wgrad GEMMs (Traits.tp_backward_overlap)

    @classmethod
    def build(cls, table: BlockTable, parts: Split, *, mode: int, b: int, pp: int, vs: int, tp: int, sp: bool,
              ep: int, dp: int, framework: int, layout: Layout, zero3: bool, send: str | None = None,
              paid: Paid = Paid(), rep: int = 1, m: int = 1) -> "RankSpec":
        """A spec with the runtime's pipeline sends (frameworks.Traits.pp_send, or ``send``) and
        how it pays its blocks (``paid``: frameworks.paid)."""
        traits = fw.traits(FRAMEWORKS[framework])
        send = send or traits.pp_send
        return cls(table, parts, mode, b, pp, vs, tp, ep, dp, framework, ps.pp_send_divisor(send, tp, sp), layout,
                   ps.pp_boundary_gathers(send, tp), ps.pp_transfers(traits), ps.pp_meta_bytes(send, tp), zero3,
                   paid.overlap, paid.te, rep, paid.ep_overlap, m if paid.ep_overlap else 1, paid.tp_async)

    def base_key(self) -> tuple:
        """What the rows but the ZeRO-3 ones depend on (not dp or the framework beyond its sends)."""
        return (id(self.table), tuple(self.parts), self.mode, self.b, self.pp, self.vs, self.tp, self.send_div,
                self.gathers, self.transfers, self.meta, self.layout.pp, self.overlap, self.te, self.ep_overlap, self.m,
                self.tp_async)


class Chunks:
    """The chunks of several specs laid end to end, spec after spec (chunk k of a spec runs on
    its rank k % pp, or in a V under DualPipeV: ``vshape``), and the specs' ranks side by side as
    columns; per chunk the pipeline hops its send and its receive take (-1: none)."""

    # Per-spec numbers, repeated per chunk (``chunk``) and per rank (``rank``).
    VALUES = ("b", "send_div", "meta", "transfers", "gather_out", "gather_in", "full", "pp", "tied_copy", "overlap",
              "te", "ep_overlap", "vs", "m", "tp_async")

    def __init__(self, specs: list[RankSpec], nblocks: int, tied_size: float, vshape: bool = False) -> None:
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
        layer_again = [RECOMPUTES[s.mode] in ("full", "op") for s in specs]  # a recomputed layer is live
        values = np.array([(s.b, s.send_div, s.meta, s.transfers, *s.gathers, again, s.pp, tied_size / s.tp, s.overlap,
                            s.te, s.ep_overlap, s.vs, s.m, s.tp_async)
                           for s, again in zip(specs, layer_again)], dtype=float).T
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
        back = (self.virtual == 1) & (self.chunk["vs"] == 2) & (pp > 1) if vshape else np.zeros(len(k), dtype=bool)
        rank = np.where(back, pp - 1 - rank, rank)  # the V's second leg runs back up the ranks
        self.column = first_rank + rank
        # A send over hop r links ranks r and r + 1 (placement.pipeline_hops): down the ranks a
        # chunk sends over its own and receives over the one before; back up, the other way round.
        self.send_hop = np.where(back, first_rank + rank - 1, self.column)
        self.recv_hop = np.where(back, self.column, first_rank + (rank - 1) % pp)
        self.turn = np.zeros((2, len(k)), dtype=bool)  # [out, in]: the V's turn on the last rank, no send
        if vshape:
            self.turn[0] = (k == pp - 1) & (self.chunk["vs"] == 2) & (pp > 1)
            self.turn[1] = back & (k == pp)
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
