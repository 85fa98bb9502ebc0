"""Per pipeline rank, one micro-batch's work and the stage's contents: the rank table.

A pipeline split is ``pp * v`` contiguous block ranges (chunks); rank r runs chunks r, r + pp,
... (Megatron's model chunks), or under DualPipeV chunks r and 2 pp - 1 - r (dualpipe.py: a V,
whose two legs meet on the last rank without a send). Its table sums, over its chunks, the block tables' seconds of
forward, backward, recompute, TP and EP traffic for its micro-batch size and recompute mode,
the parameters and stored activations, and adds what the split itself decides:

- the pipeline sends: each chunk sends its output forward (unless it ends the model) and
  receives from the chunk before it (unless it starts the model), one transfer per
  micro-batch on each side. Megatron pairs a send with the opposite receive
  (send_forward_recv_backward): one transfer on a full-duplex link; DeepSpeed's PipelineEngine
  sends and receives one after the other (pipeline_sends.pp_transfers), a partitioned tensor after
  its meta tensor (pipeline_sends.pp_meta_bytes), and all-gathers the boundary over TP
  (pipeline_sends.pp_boundary_gathers). A hop inside a node goes over NVLink, one that leaves it
  over the network (placement.pipeline_hops);
- the largest block (ZeRO-3 gathers it whole), a fully recomputed block's live activations,
  the pipeline receive buffers;
- a tied LM head on another rank than the embedding: that rank keeps its own copy of the word
  embeddings (Megatron allocates it on the last stage and all-reduces the two gradients), and
  both ranks are marked for DeepSpeed's ReduceTiedGrads;
- under ZeRO-3, each block's weight all-gather and gradient reduce-scatter over the DP and
  expert-DP groups, one collective per block (its per-call latency counts once per layer).

``RankTables`` builds the tables of many splits at once, every split's chunks laid end to end;
a rank's chunks are added in chunk order, so a table is bit for bit the same however many are
built together.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.cost import dualpipe
from planner.cost.block_times import BlockTable
from planner.cost.collectives import collective_times_keyed
from planner.cost.context import CostContext
from planner.cost.paid import merged_share
from planner.cost.rank_chunks import Chunks, RankSpec
from planner.cost.zero3_fetch import block_seconds
from planner.hardware.placement import GroupShape
from planner.model.spec import ModelSpec

# Rows of a rank table: per pipeline rank, one micro-batch's seconds of forward, backward,
# recompute, TP, EP and pipeline traffic; the stage's dense and expert parameters, its largest
# block, stored and live activation bytes and pipeline buffers; the parameters of a tied
# embedding's copy when the rank holds one of two; the ZeRO-3 per-block gathers and
# reduce-scatters; the quantized weights; the exposed context-parallel traffic; last, the rank's
# decoder layers and their stored bytes (what activation offload moves: activation_offload.py); the
# weight-gradient GEMMs' seconds and the stored bytes of the rank's second chunk (DualPipeV's bubble
# and held activations: dualpipe.py).
RANK_FIELDS = ("fwd", "bwd", "rc", "tp", "ep", "dense", "expert", "pp", "largest", "stored", "live", "ppbuf",
               "tied", "z3_gather", "z3_gather_rest", "z3_reduce", "z3_host", "low", "cp", "dec_n", "dec_act",
               "wg", "stored_v")
ROW = {name: k for k, name in enumerate(RANK_FIELDS)}
# ZeRO-3's gathers of the step's first forward and of every other pass, its reduction and its
# hooks' host time (zero3_fetch.block_seconds); zero unless the candidate runs ZeRO-3.
Z3_SERIES = {"z3_gather": "first", "z3_gather_rest": "rest", "z3_reduce": "reduce", "z3_host": "host"}
Z3_ROWS = [ROW[name] for name in Z3_SERIES]
TIME_ROWS = [ROW[k] for k in ("fwd", "bwd", "rc", "tp", "ep", "pp", "cp")]  # MicroBatchTime's fields, in order
# The per-block series summed over a chunk's blocks (by prefix sums), and then the chunk's pipeline
# seconds: the rows of the per-chunk array a rank table is summed from. The first seven are
# RANK_FIELDS' first seven; "act" is stored bytes per sample, "low" the weights of the GEMMs
# that run in a precision recipe's format (their quantized copies are cached for the step),
# "tp_ov" the TP seconds left exposed where the runtime overlaps them (the "tp" row of a spec
# with ``overlap``), "te_*" what TE's attention saves of fwd, bwd and rc (a spec with ``te``),
# "cp" the exposed context-parallel attention traffic, "ep_ov" the EP seconds left exposed where a
# spec's ``ep_overlap`` merges micro-batches (``merged_share``), "dec" 1 per decoder layer and
# "dec_act" its stored bytes per sample, "wg" the weight-gradient GEMMs' seconds, "tp_async" the TP
# seconds with the backward's reductions under them (a spec with ``tp_async``).
PREFIX_SERIES = ("fwd", "bwd", "rc", "tp", "ep", "dense", "expert", "act", "low", "tp_ov", "te_f", "te_b", "te_rc",
                 "cp", "ep_ov", "dec", "dec_act", "wg", "tp_async")
CHUNK_ROWS = (*PREFIX_SERIES, "pp")
_CHUNK = {name: k for k, name in enumerate(CHUNK_ROWS)}
assert RANK_FIELDS[:7] == PREFIX_SERIES[:7]


def rank_fields(ranks: np.ndarray) -> dict[str, np.ndarray]:
    """Name the rows of rank tables ([..., field, rank] -> {field: [..., rank]}), as views."""
    return {name: ranks[..., k, :] for k, name in enumerate(RANK_FIELDS)}


def padded(tables: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Rank tables of several depths as one [table x field x widest] array, zeros past each
    table's ranks (assemble reads no padded rank), and that width."""
    width = max(t.shape[1] for t in tables)
    if all(t.shape[1] == width for t in tables):
        return np.stack(tables), width
    out = np.zeros((len(tables), len(RANK_FIELDS), width))
    for i, t in enumerate(tables):
        out[i, :, :t.shape[1]] = t
    return out, width


class TiedEmbedding(NamedTuple):
    """A tied LM head: its block, the embedding's block and the shared matrix's parameters."""

    head: int
    embed: int
    params: float


def tied_embedding(model: ModelSpec) -> TiedEmbedding | None:
    """The block that reads the embedding's matrix besides the embedding (a tied LM head, or a
    multi-token-prediction depth, which looks the next tokens up in it: Megatron-Core keeps a
    copy on the MTP's stage) and the embedding, or None when no block shares it."""
    blocks = model.blocks
    kinds = [b.kind for b in blocks]  # LMHeadBlock.kind, MTPBlock.kind, EmbeddingBlock.kind
    heads = [i for i, k in enumerate(kinds) if (k == "lm_head" and blocks[i].tied) or k == "mtp"]
    embeds = [i for i, k in enumerate(kinds) if k == "embedding"]
    if not heads or not embeds:
        return None
    head = blocks[heads[0]]
    return TiedEmbedding(heads[0], embeds[0], float(head.vocab * head.hidden))


class RankTables:
    """The rank tables of one model's splits, kept per spec: a search asks again for the splits
    its candidates share (every ZeRO stage, offload and dp of one key)."""

    def __init__(self, model: ModelSpec, ctx: CostContext) -> None:
        self.ctx = ctx
        self.nblocks = len(model.blocks)
        self.decoder = np.array([b.kind == "decoder" for b in model.blocks], dtype=float)  # DecoderBlock.kind
        self.tied = tied_embedding(model)
        self.vshape = ctx.workload.pp_schedule == "dualpipev"  # pp > 1 splits of two chunks a rank lie in a V
        self._prefix: dict[tuple, tuple[BlockTable, np.ndarray]] = {}
        self._z3: dict[tuple, tuple[BlockTable, dict[str, np.ndarray]]] = {}
        self._base: dict[tuple, tuple[BlockTable, np.ndarray]] = {}

    def tables(self, specs: list[RankSpec]) -> list[np.ndarray]:
        """Per spec, one micro-batch's time parts and the stage's contents per pipeline rank, as a
        [RANK_FIELDS x pp] matrix (``rank_fields`` names its rows). The ones not built before are
        built together; the ZeRO-3 rows only for specs that ask for them."""
        keys = [spec.base_key() for spec in specs]
        missing: dict[tuple, RankSpec] = {}
        for key, spec in zip(keys, specs):
            hit = self._base.get(key)
            if hit is None or hit[0] is not spec.table:
                missing[key] = spec
        if missing:
            for (key, spec), ranks in zip(missing.items(), self._base_tables(list(missing.values()))):
                self._base[key] = (spec.table, ranks)  # holding the table keeps its id unique
        return [self._with_z3(self._base[key][1], spec) for key, spec in zip(keys, specs)]

    def _with_z3(self, base: np.ndarray, spec: RankSpec) -> np.ndarray:
        """``base`` with its ZeRO-3 rows summed over each rank's blocks (a copy; ``base`` itself
        when the spec has none)."""
        z3 = self._z3_prefix(spec) if spec.zero3 else None
        if not z3:
            return base
        out = base.copy()
        starts = np.array([a for a, _ in spec.parts])
        ends = np.array([e for _, e in spec.parts])
        for name in Z3_SERIES:
            per_chunk = (z3[name][ends] - z3[name][starts]).reshape(spec.vs, spec.pp)
            if self.vshape and spec.vs == 2:
                per_chunk[1] = per_chunk[1, ::-1].copy()  # the V's second leg, back up the ranks
            out[ROW[name]] = per_chunk.sum(axis=0)
        return out

    def _z3_prefix(self, spec: RankSpec) -> dict[str, np.ndarray] | None:
        """ZeRO-3 collectives one block at a time (gather 16-bit weights, reduce-scatter
        gradients) within the rank's sharding group (all dp ranks, or one hybrid-sharding group of
        them: ``layout.dp``), as prefix sums over blocks; None when there is no DP group to talk to."""
        ep, table = spec.ep, spec.table
        dp = spec.dp // spec.rep
        if dp == 1 and ep == 1:
            return None
        key = (id(table), spec.tp, ep, spec.dp, spec.pp, spec.framework, spec.rep)
        hit = self._z3.get(key)
        if hit is not None and hit[0] is table:
            return hit[1]
        series = block_seconds(self.ctx, spec.layout, dp, spec.layout.edp.size, spec.framework, table.params,
                               table.expert,
                               table.low, table.z3_calls, table.z3_tensors)
        out = {row: np.concatenate(([0.0], np.cumsum(series[part]))) for row, part in Z3_SERIES.items()}
        self._z3[key] = (table, out)
        return out

    def _prefixes(self, specs: list[RankSpec]) -> np.ndarray:
        """Prefix sums over blocks of the PREFIX_SERIES of each spec's (table, mode, micro-batch):
        [series x spec x blocks + 1]; the missing ones in one cumsum."""
        keys = [(id(s.table), s.mode, s.table.b_index(s.b)) for s in specs]
        todo = [(key, s) for key, s in zip(keys, specs)
                if (hit := self._prefix.get(key)) is None or hit[0] is not s.table]
        if todo:
            series = np.stack([row for (_, mode, bi), s in todo for row in (
                s.table.fwd[bi], s.table.bwd[bi], s.table.rc[mode, bi], s.table.tp[mode, bi], s.table.ep[mode, bi],
                s.table.params, s.table.expert, s.table.act[mode], s.table.low, s.table.tp_ov[mode, bi],
                s.table.te_f[bi], s.table.te_b[bi], s.table.te_rc[mode, bi], s.table.cp[mode, bi],
                s.table.ep_ov[mode, bi], self.decoder, s.table.act[mode] * self.decoder, s.table.wg[bi],
                s.table.tp_async[mode, bi])])
            n = len(PREFIX_SERIES)
            sums = np.zeros((len(todo), n, series.shape[1] + 1))
            np.cumsum(series.reshape(len(todo), n, -1), axis=2, out=sums[:, :, 1:])  # each series on its own
            for (key, s), one in zip(todo, sums):
                self._prefix[key] = (s.table, one)  # holding the table keeps its id unique
        return np.stack([self._prefix[key][1] for key in keys], axis=1)

    def _base_tables(self, specs: list[RankSpec]) -> list[np.ndarray]:
        """The rank tables of many specs, ZeRO-3 rows left at zero, built together."""
        ch = Chunks(specs, self.nblocks, self.tied.params if self.tied else 0.0, self.vshape)
        pre = self._prefixes(ch.prefix_specs)
        per_chunk = np.empty((len(CHUNK_ROWS), len(ch.starts)))
        series = len(PREFIX_SERIES)
        np.subtract(pre[:, ch.prefix, ch.ends], pre[:, ch.prefix, ch.starts], out=per_chunk[:series])
        per_chunk[_CHUNK["pp"]] = self._pipeline_seconds(ch)
        sums = ch.rank_sum(per_chunk)
        largest, live, buf = ch.rank_max(ch.block_max())
        b = ch.rank["b"]
        out = np.zeros((len(RANK_FIELDS), ch.width))
        out[:7] = sums[:7]  # fwd, bwd, rc, tp, ep, dense, expert: the first seven of both
        out[ROW["pp"]] = sums[_CHUNK["pp"]]
        out[ROW["largest"]] = largest
        out[ROW["stored"]] = sums[_CHUNK["act"]] * b
        out[ROW["low"]] = sums[_CHUNK["low"]]
        out[ROW["cp"]] = sums[_CHUNK["cp"]]
        out[ROW["dec_n"]] = sums[_CHUNK["dec"]]
        out[ROW["dec_act"]] = sums[_CHUNK["dec_act"]] * b
        out[ROW["wg"]] = sums[_CHUNK["wg"]]
        if self.vshape:
            out[ROW["stored_v"]] = ch.rank_sum(np.where(ch.virtual == 1, per_chunk[_CHUNK["act"]], 0.0)[None])[0] * b
        out[ROW["tp"]] = np.where(ch.rank["overlap"] > 0, sums[_CHUNK["tp_ov"]],
                                  np.where(ch.rank["tp_async"] > 0, sums[_CHUNK["tp_async"]], sums[_CHUNK["tp"]]))
        rank = np.arange(ch.width) - np.repeat(ch.rank_start[:-1], ch.pps)
        share = merged_share(rank, ch.rank["pp"], ch.rank["vs"], ch.rank["m"])
        if self.vshape:  # DualPipeV's overlapped pairs
            share = np.where(ch.rank["pp"] > 1, dualpipe.merged_share(rank, ch.rank["pp"], ch.rank["m"]), share)
        share = np.where(ch.rank["ep_overlap"] > 0, share, 0)
        out[ROW["ep"]] = sums[_CHUNK["ep"]] - share * (sums[_CHUNK["ep"]] - sums[_CHUNK["ep_ov"]])
        te = ch.rank["te"] > 0
        for row, saved in (("fwd", "te_f"), ("bwd", "te_b"), ("rc", "te_rc")):  # what TE's attention saves
            out[ROW[row]] -= np.where(te, sums[_CHUNK[saved]], 0.0)
        out[ROW["live"]] = np.where(ch.rank["full"] > 0, live * b, 0.0)  # a layer recomputed: full or per-op SAC
        out[ROW["ppbuf"]] = np.where(ch.rank["pp"] > 1, 2.0 * buf * b, 0.0)  # pipeline receive buffers
        if self.tied is not None:
            self._tied_rows(out, ch)
        return np.split(out, ch.rank_start[1:-1], axis=1)

    def _pipeline_seconds(self, ch: Chunks) -> np.ndarray:
        """Per chunk: one micro-batch's pipeline traffic, every spec's transfers priced in one
        ``collective_times_keyed`` call."""
        c = ch.chunk
        pp_bytes = ch.block_arrays[2]
        whole_out = np.where(ch.ends < self.nblocks, pp_bytes[ch.block_base + np.maximum(ch.ends - 1, 0)] * c["b"], 0.0)
        whole_in = np.where(ch.starts > 0, pp_bytes[ch.block_base + np.maximum(ch.starts - 1, 0)] * c["b"], 0.0)
        whole_out, whole_in = np.where(ch.turn[0], 0.0, whole_out), np.where(ch.turn[1], 0.0, whole_in)
        sent, received = whole_out / c["send_div"], whole_in / c["send_div"]
        sizes = np.stack((sent, received, np.where(sent > 0, c["meta"], 0.0), np.where(received > 0, c["meta"], 0.0),
                          whole_out, whole_in))
        keys, which = _pipeline_keys(ch)
        # Only the rows with something to price: meta tensors and TP gathers are DeepSpeed's.
        used = (which >= 0).any(axis=1)
        p = np.zeros_like(sizes)
        if used.any():
            p[used] = collective_times_keyed(self.ctx.cluster, keys, which[used], sizes[used])
        # No meta tensor or gather: its rows priced at zero seconds, added exactly.
        send = (p[0] + p[2]) * c["transfers"] + c["gather_out"] * p[4]
        recv = (p[1] + p[3]) * c["transfers"] + c["gather_in"] * p[5]
        return send + recv

    def _tied_rows(self, out: np.ndarray, ch: Chunks) -> None:
        """Where a tied embedding's copy sits on another rank than the embedding, the head's rank
        holds it on the dense row, and both ranks mark the pair."""
        head, embed, _ = self.tied  # type: ignore[misc]
        heads, embeds = (ch.column[(ch.starts <= i) & (i < ch.ends)] for i in (head, embed))  # a chunk per spec
        apart = heads != embeds
        heads, embeds = heads[apart], embeds[apart]
        copy = out[ROW["tied"], heads] = out[ROW["tied"], embeds] = ch.rank["tied_copy"][heads]
        out[ROW["dense"], heads] += copy  # the head's copy of the embedding, on the dense row


def _pipeline_keys(ch: Chunks) -> tuple[list[tuple[str, GroupShape]], np.ndarray]:
    """The (op, shape) pairs of every spec's pipeline transfers and, per row of
    ``_pipeline_seconds``' sizes and chunk, the pair that prices it (-1: nothing). The send of
    a chunk on rank r takes hop r, its receive hop r - 1 (placement.pipeline_hops)."""
    pairs: dict[tuple[str, GroupShape], int] = {}
    per_spec, crosses = [], []
    for s in ch.specs:
        if s.layout.pp.size > 1:
            hops, near = s.layout.pp_hops
            far = pairs.setdefault(("p2p", s.layout.pp), len(pairs))
            near_key = far if near is None else pairs.setdefault(("p2p", near), len(pairs))
            gather = -1 if s.gathers == (0, 0) else pairs.setdefault(("allgather", s.layout.tp), len(pairs))
            per_spec.append((far, near_key, gather))
            crosses.append(hops)
        else:
            per_spec.append((-1, -1, -1))
            crosses.append(np.zeros(s.pp, dtype=bool))
    far, near, gather = np.repeat(np.array(per_spec).T, ch.counts, axis=1)
    hop = np.concatenate(crosses)
    send, recv = np.where(hop[ch.send_hop], far, near), np.where(hop[ch.recv_hop], far, near)
    return list(pairs), np.stack((send, recv, send, recv, gather, gather))
