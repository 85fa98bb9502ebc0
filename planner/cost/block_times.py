"""Per-block time, parameters and activations for many micro-batch sizes at once.

The cost model's per-block terms, written once over a (micro-batch x block) grid: for one
(tp, sequence parallel, ep) group, ``layer_costs`` gives each block's GEMM shapes, attention
core, memory-bound bytes and collectives per sample, and this module prices them with
planner/cost/efficiency.py's kernels and the collective model at every micro-batch size:

- forward: the block's GEMMs, its attention core (FlashAttention, or the unfused score and
  value GEMMs whose softmax is HBM traffic) and its HBM-bound work;
- backward: two GEMMs of each forward shape (data and weight gradients), the attention
  core's backward, twice the HBM traffic;
- recompute: under full recomputation the checkpointed block's forward again; under
  selective recomputation (Korthikanti et al. 2022 Sec 4.1) the attention core (scores,
  softmax, dropout, values); under torchtitan's per-op SAC ("op") the block's forward but its
  attention core and the GEMMs whose outputs it keeps (transformer_layers.op_sac), its TP
  all-gathers again (the reduce-scatters' outputs are kept);
- TP collectives forward and backward (again for a recomputed forward), EP all-to-alls
  (2 per pass, 3 when recomputed), exposed as they are and as a runtime that overlaps them
  leaves them (``overlapped_tp``, ``overlapped_ep``); a plan's ``Paid`` picks one.

``estimate`` builds one table for its configuration's group and micro-batch; the search
builds one per group over every micro-batch size it tries (``BlockTables`` keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from planner.cost import efficiency as eff
from planner.cost.collectives import collective_times_keyed
from planner.cost.comm_overlap import async_backward_tp, overlapped_ep, overlapped_tp
from planner.cost.context import workload_device
from planner.cost.context_parallel import CpGroups, cp_groups, cp_seconds
from planner.cost.kernel_times import attention_seconds, gemm_seconds
from planner.cost.layers import LayerCost, layer_costs
from planner.cost.measured_blocks import LayerProfile, as_measured, measured_act, measured_for, measured_ratios
from planner.cost.moe_dispatch import flex_jobs, flex_sm_share, tp_ep_shape
from planner.cost.paid import Paid
from planner.cost.parallel import RECOMPUTES, Workload
from planner.cost.run_model import RunModel
from planner.cost.zero3_fetch import fetch_calls, tensor_count
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, strided_shape
from planner.model.spec import ModelSpec


@dataclass(frozen=True)
class BlockTable:
    """Per-block arrays of one (tp, sp, ep) group; time arrays are [recompute, micro-batch, block]."""

    micro_batches: tuple[int, ...]
    fwd: np.ndarray  # [b, block]
    bwd: np.ndarray  # [b, block]
    rc: np.ndarray  # [mode, b, block]
    tp: np.ndarray  # [mode, b, block]
    tp_ov: np.ndarray  # [mode, b, block]: TP seconds left exposed when overlapped with the GEMMs (overlapped_tp)
    tp_async: np.ndarray  # [mode, b, block]: with the backward's reductions under the wgrad GEMMs (async_backward_tp)
    # Seconds TE's attention saves over FlashAttention-2 (frameworks.Traits.te_attention; zero
    # where the two level off alike): forward and backward [b, block], recomputed [mode, b, block].
    te_f: np.ndarray
    te_b: np.ndarray
    te_rc: np.ndarray
    ep: np.ndarray  # [mode, b, block]
    ep_ov: np.ndarray  # [mode, b, block]: EP seconds left exposed in a merged micro-batch pair (overlapped_ep)
    cp: np.ndarray  # [mode, b, block]: exposed context-parallel attention traffic (context_parallel.py)
    wg: np.ndarray  # [b, block]: the backward's weight-gradient GEMMs (the forward GEMMs' shapes; dualpipe.py)
    params: np.ndarray  # params_rank per block
    expert: np.ndarray  # expert_params_rank per block
    low: np.ndarray  # LayerCost.low_params per block (the recipe's quantized weights)
    z3_calls: np.ndarray  # all-gathers DeepSpeed's ZeRO-3 fetches the block in (zero3_fetch.fetch_calls)
    z3_tensors: np.ndarray  # its fetched weight tensors (zero3_fetch.tensor_count: qgZ's all-to-alls)
    act: np.ndarray  # [mode, block] stored bytes per sample
    act_live: np.ndarray  # per sample, 0 for blocks that are not checkpointed
    pp_bytes: np.ndarray  # per sample
    # The [group, ...] arrays this table is row ``[1]`` of, when built beside others by one
    # ``block_tables`` call (``stacked`` hands them back rather than stacking the rows again).
    batch: tuple[dict[str, np.ndarray], int] | None = field(default=None, compare=False, repr=False)

    def b_index(self, b: int) -> int:
        return self.micro_batches.index(b)

    def total(self, mode: int, bi: int, paid: Paid = Paid()) -> np.ndarray:
        """Seconds of one micro-batch per block: what the balancer balances, as a runtime pays
        them (``paid``: TP overlapped, TE's attention)."""
        tp = (self.tp_ov if paid.overlap else self.tp_async if paid.tp_async else self.tp)[mode, bi]
        ep = (self.ep_ov if paid.ep_overlap else self.ep)[mode, bi]
        out = self.fwd[bi] + self.bwd[bi] + self.rc[mode, bi] + tp + ep + self.cp[mode, bi]
        return out - (self.te_f[bi] + self.te_b[bi] + self.te_rc[mode, bi]) if paid.te else out


def _comm(cluster: Cluster, jobs: list[tuple[GroupShape, list[list[tuple[str, float]]]]],
          bs: np.ndarray) -> np.ndarray:
    """[job, b, block] seconds of each job: a group shape and each block's list of (collective,
    bytes per sample).

    Every distinct (shape, collective, bytes) of every job is priced at every micro-batch in
    one ``collective_times_keyed`` call: the time is elementwise in the size, so this equals
    one call per size, and the dozens of (tp, sp, ep) tables of a search share a handful of
    TP and EP shapes. The sums per block are one ``bincount`` over every (job, micro-batch,
    block) cell, which adds a block's collectives in the order their (collective, bytes) first
    appear in its job, as one addition per distinct size would.
    """
    n_blocks = len(jobs[0][1]) if jobs else 0
    pairs: dict[tuple[str, GroupShape], int] = {}  # (op, shape) -> its number in the pricing call
    rows: dict[tuple[int, float], int] = {}  # (pair, bytes) -> row of the priced sizes
    cell: list[int] = []  # (job, block) of each addition, in adding order
    row: list[int] = []  # the priced row it adds
    for job, (shape, ops) in enumerate(jobs):
        if shape.size <= 1:
            continue
        distinct: dict[tuple[str, float], list[int]] = {}
        for j, block_ops in enumerate(ops):
            for op, nbytes in block_ops:
                distinct.setdefault((op, float(nbytes)), []).append(j)  # a block may list an op twice
        for (op, nbytes), blocks in distinct.items():
            r = rows.setdefault((pairs.setdefault((op, shape), len(pairs)), nbytes), len(rows))
            cell += [job * n_blocks + j for j in blocks]
            row += [r] * len(blocks)
    times = np.zeros((0, len(bs)))
    if rows:
        which = np.fromiter((p for p, _ in rows), dtype=np.int64, count=len(rows))[:, None]
        sizes = np.fromiter((nbytes for _, nbytes in rows), dtype=float, count=len(rows))
        times = collective_times_keyed(cluster, list(pairs), which, sizes[:, None] * bs[None, :])
    at = (np.arange(len(bs))[:, None] * (len(jobs) * n_blocks) + np.array(cell, dtype=np.int64)[None, :]).ravel()
    per_size = times[np.array(row, dtype=np.int64)].T.ravel()  # [b, adds]
    # Cells ordered (b, job, block), each summed in adding order: then [job, b, block].
    sums = np.bincount(at, weights=per_size, minlength=len(bs) * len(jobs) * n_blocks)
    return sums.reshape(len(bs), len(jobs), n_blocks).transpose(1, 0, 2)


def block_tables(groups: list[tuple[list[LayerCost], GroupShape, GroupShape]], micro_batches: tuple[int, ...],
                 dev: eff.Device, cluster: Cluster, runs: np.ndarray | None = None,
                 cp: list[CpGroups] | None = None, measured: np.ndarray | None = None) -> list[BlockTable]:
    """One table per (layer costs, TP shape, EP shape) group, over the same micro-batches.

    The groups list the same blocks (one model under different tp, sp, ep). Every quantity is
    elementwise in (group, micro-batch, block), so all groups go through the kernels side by
    side as [group x micro-batch x block] arrays (a search needs dozens of groups); the
    collectives, which depend on each group's process-group shapes, are priced once per
    (shape, collective). ``runs``: how many consecutive blocks of the tables each priced block
    stands for (runs of identical blocks are priced once, then widened here: ``_widen``).
    ``cp``: per group, the context-parallel groups its attention talks over (none: cp 1).
    ``measured``: [forward, backward, recompute, activations] x block ratios of measured to
    analytic (measured_blocks.measured_ratios), which scale every group's compute and stored bytes."""
    bs = np.asarray(micro_batches, dtype=float)
    n_groups, n_blocks = len(groups), len(groups[0][0])
    if any(len(group) != n_blocks for group, _, _ in groups):
        raise ValueError("block_tables: every group must list the same blocks")
    costs = [c for group, _, _ in groups for c in group]

    def per_block(values) -> np.ndarray:  # [group, block]
        return np.array(values, dtype=float).reshape(n_groups, n_blocks)

    ckpt = per_block([c.checkpointed for c in costs]) > 0
    has_attn = per_block([c.attn is not None and c.extra.get("sel_attn", 1.0) > 0 for c in costs]) > 0  # core_attn
    op_sac = per_block([c.extra.get("op_sac", 0.0) for c in costs]) > 0  # op_sac prices the block's own ops
    fwd, bwd, rc, gemm, te, attn = _compute_times(costs, (n_groups, n_blocks), bs, dev, ckpt, has_attn, op_sac)
    if measured is not None:
        fwd, bwd, rc, gemm, te, attn = as_measured(measured, fwd, bwd, rc, gemm, te, attn)
    tp, ep, reduced = _collective_times(groups, cluster, bs, ckpt, per_block([c.ep_a2a_count for c in costs]), op_sac)
    cp_t = np.zeros_like(tp)
    if cp is not None:
        for g, cp_groups_g in enumerate(cp):
            extra = [[c.extra.get(k, 0.0) for c in groups[g][0]] for k in ("cp_kv", "cp_qkv", "cp_o")]
            kv, qkv, out = (np.outer(bs, x) for x in extra)
            f, b = cp_seconds(cluster, cp_groups_g, kv, qkv, out, attn[0][g], attn[1][g])
            cp_t[g] = f + b  # the recomputed forward (full or selective: the attention runs again) adds f
            cp_t[g, RECOMPUTES.index("full")] += np.where(ckpt[g], f, 0.0)
            cp_t[g, RECOMPUTES.index("selective")] += np.where(has_attn[g], f, 0.0)
            cp_t[g, RECOMPUTES.index("op")] += np.where(ckpt[g] & ~op_sac[g], f, 0.0)  # per-op SAC keeps SDPA's
    sizes = np.array([tp_shape.size for _, tp_shape, _ in groups], dtype=float)
    share = flex_sm_share(per_block(["flex_topk" in c.extra for c in costs]) > 0, cluster, dev.sms)
    fields = {
        "fwd": fwd, "bwd": bwd, "rc": rc, "tp": tp, "ep": ep, "cp": cp_t, "tp_ov": overlapped_tp(tp, gemm, ckpt, sizes),
        "ep_ov": overlapped_ep(ep, fwd - te["te_f"], bwd - te["te_b"], share), **te,
        "tp_async": async_backward_tp(tp, reduced, gemm),
        "params": per_block([c.params_rank for c in costs]), "expert": per_block([c.expert_params_rank for c in costs]),
        "low": per_block([c.low_params for c in costs]), "wg": gemm,
        "z3_calls": per_block([fetch_calls(c) for c in costs]), "z3_tensors": per_block(list(map(tensor_count, costs))),
        "act": np.array([[c.act[m] for c in costs] for m in RECOMPUTES], dtype=float)
                 .reshape(len(RECOMPUTES), n_groups, n_blocks).transpose(1, 0, 2),
        "act_live": per_block([c.act_live if c.checkpointed else 0.0 for c in costs]),
        "pp_bytes": per_block([c.pp_bytes for c in costs]),
    }
    if measured is not None:  # the stored bytes at the layer profile's level
        fields["act"], fields["act_live"] = measured_act(measured, fields["act"], fields["act_live"])
    if runs is not None:
        fields = {k: _widen(v, runs) for k, v in fields.items()}
    return [BlockTable(tuple(micro_batches), **{k: v[g] for k, v in fields.items()}, batch=(fields, g))
            for g in range(n_groups)]


def _compute_times(costs: list[LayerCost], shape: tuple[int, int], bs: np.ndarray, dev: eff.Device,
                   ckpt: np.ndarray, has_attn: np.ndarray,
                   op_sac: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray],
                                                tuple[np.ndarray, np.ndarray]]:
    """Forward and backward seconds ([group, b, block]), recompute seconds ([group, mode, b,
    block]), forward GEMM seconds ([group, b, block]) of the blocks ``costs`` (groups x blocks,
    flat), what TE's attention saves of each (``te_f``, ``te_b``, ``te_rc``), and the attention
    core's seconds forward and backward as TE runs it ([group, b, block]: what a context-parallel
    ring hides its transfers under).

    The kernels run once per distinct cost: groups share the blocks that their (tp, sp, ep) do
    not change (one LayerCost object from layer_costs' memo), then each column is copied out."""
    n_groups, n_blocks = shape
    index: dict[int, int] = {}
    inv = [index.setdefault(id(c), len(index)) for c in costs]
    uniq = list({id(c): c for c in costs}.values())

    def spread(a: np.ndarray) -> np.ndarray:  # [b, distinct cost] -> [group, b, block]
        a = a if len(uniq) == len(costs) else a[:, inv]
        return a.reshape(len(bs), n_groups, n_blocks).transpose(1, 0, 2)

    gemm = gemm_seconds(uniq, bs, dev)
    kept = gemm_seconds(uniq, bs, dev, "sac_saved")  # what per-op SAC does not run again
    def hbm(values: list[float]) -> np.ndarray:  # [b, distinct cost]: seconds of per-sample bytes
        return eff.hbm_time(np.array(values)[None, :] * bs[:, None], dev)

    hbm_t = hbm([c.hbm_fwd for c in uniq])
    attn_f, attn_b = attention_seconds(uniq, bs, dev)
    # Eager kernels' bytes beyond the fused price (eager_kernels.py), forward and backward.
    eager_f, eager_b = (hbm([c.extra.get(k, 0.0) for c in uniq]) for k in ("eager_fwd", "eager_bwd"))
    fwd = spread(gemm + attn_f + hbm_t + eager_f)
    bwd = spread(2.0 * gemm + attn_b + 2.0 * hbm_t + eager_b)
    score = spread(hbm([c.extra.get("score_hbm", 0.0) for c in uniq]))
    rc = np.zeros((n_groups, len(RECOMPUTES), len(bs), n_blocks))
    rc[:, RECOMPUTES.index("full")] = np.where(ckpt[:, None, :], fwd, 0.0)
    # Megatron's selective recompute: the attention core where its modules name it, and what the
    # other chosen modules run again (LayerCost.rerun: their GEMMs and memory-bound work).
    again = spread(gemm_seconds(uniq, bs, dev, "rerun_gemms")
                   + hbm([c.rerun.traffic for c in uniq]))
    rc[:, RECOMPUTES.index("selective")] = np.where(has_attn[:, None, :], spread(attn_f) + score, 0.0) + again
    rc[:, RECOMPUTES.index("op")] = np.where(op_sac[:, None, :], fwd - spread(attn_f + kept),
                                             rc[:, RECOMPUTES.index("full")])
    save_f, save_b = np.zeros_like(attn_f), np.zeros_like(attn_b)
    if dev.flash is not None or dev.flash_speed != 1.0:
        # FlashAttention-2 levels off below the GPU's MAMF on Hopper, and FlashAttention-1 below
        # FlashAttention-2 everywhere; TE's attention does neither
        te_f, te_b = attention_seconds(uniq, bs, replace(dev, flash=None, flash_speed=1.0))
        save_f, save_b = np.maximum(attn_f - te_f, 0.0), np.maximum(attn_b - te_b, 0.0)
    te_rc = np.zeros_like(rc)
    te_rc[:, RECOMPUTES.index("full")] = np.where(ckpt[:, None, :], spread(save_f), 0.0)
    te_rc[:, RECOMPUTES.index("selective")] = np.where(has_attn[:, None, :], spread(save_f), 0.0)
    te_rc[:, RECOMPUTES.index("op")] = np.where(op_sac[:, None, :], 0.0, te_rc[:, RECOMPUTES.index("full")])
    return (fwd, bwd, rc, spread(gemm), {"te_f": spread(save_f), "te_b": spread(save_b), "te_rc": te_rc},
            (spread(attn_f - save_f), spread(attn_b - save_b)))


def _collective_times(groups: list[tuple[list[LayerCost], GroupShape, GroupShape]], cluster: Cluster, bs: np.ndarray,
                      ckpt: np.ndarray, count: np.ndarray,
                      op_sac: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TP and EP seconds per [group, mode, b, block]: the TP collectives forward and backward,
    again forward for a block recomputed in full (under per-op SAC its all-gathers only; under
    selective recompute those of the checkpointed MLPs, LayerCost.rerun); ``count`` all-to-alls
    per pass, 2 passes, 3 when recomputed (whole, or its MoE layer under selective "moe"); and per
    [group, b, block] the backward's input-gradient reductions (comm_overlap.async_backward_tp)."""
    jobs, flex = [], []
    for group, tp_shape, ep_shape in groups:
        legs = flex_jobs(group, ep_shape)
        flex.append([bool(ops) for ops in legs[0][1]])  # the blocks whose dispatch runs in two legs
        gather = ["ep_gather" in c.extra for c in group]  # the allgather dispatcher, over the experts' TP x EP
        a2a_ops = [[("alltoall", c.ep_a2a)] if c.ep_a2a_count and not g else [] for c, g in zip(group, gather)]
        gather_ops = [[("allgather", c.ep_a2a), ("reducescatter", c.ep_a2a)] if g else []
                      for c, g in zip(group, gather)]
        jobs += [(tp_shape, [list(c.tp_fwd + c.tp_bwd) for c in group]), (tp_shape, [list(c.tp_fwd) for c in group]),
                 (tp_shape, [[op for op in c.tp_fwd if op[0] == "allgather"] for c in group]),
                 (ep_shape, a2a_ops), *legs, (tp_ep_shape(cluster, ep_shape) if any(gather) else ep_shape, gather_ops),
                 (tp_shape, [list(c.rerun.tp) for c in group]),
                 (tp_shape, [[op for op in c.tp_bwd if op[0] != "allgather"] for c in group])]
    comms = _comm(cluster, jobs, bs)
    base_tp, again_tp, gathers, a2a, rail, node, gathered, rerun, reduced = (comms[k::9] for k in range(9))
    a2a = np.where(np.array(flex)[:, None, :], np.maximum(rail, node), a2a) + gathered  # flex: the legs pipelined
    # [group, mode, 1, block]: the blocks whose forward, collectives included, runs again.
    again = np.zeros((len(groups), len(RECOMPUTES), 1, ckpt.shape[1]), dtype=bool)
    again[:, RECOMPUTES.index("full"), 0] = again[:, RECOMPUTES.index("op"), 0] = ckpt
    tp = base_tp[:, None] + np.where(again, again_tp[:, None], 0.0)
    tp[:, RECOMPUTES.index("op")] = np.where(op_sac[:, None, :], base_tp + gathers, tp[:, RECOMPUTES.index("op")])
    tp[:, RECOMPUTES.index("selective")] += rerun
    ep = (2.0 + again) * count[:, None, None, :] * a2a[:, None]
    again_sel = np.array([[c.rerun.a2a for c in group] for group, _, _ in groups], dtype=float)
    ep[:, RECOMPUTES.index("selective")] += (again_sel * count)[:, None, :] * a2a
    return tp, ep, reduced


def _widen(a: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """``a`` with its last (block) axis entry ``j`` repeated ``runs[j]`` times, laid out
    block-major (the block axis outermost in memory), so that sums over blocks downstream
    (bounds.py) add block by block, in the order a per-block walk does."""
    block_first = a.transpose(a.ndim - 1, *range(a.ndim - 1))
    return block_first.repeat(runs, axis=0).transpose(*range(1, a.ndim), 0)


def stacked(tables: list[BlockTable], name: str) -> np.ndarray:
    """``np.stack`` of field ``name`` over ``tables``: the arrays they were cut from when they
    are, in order, every table of one ``block_tables`` call (no copy)."""
    whole, rows = table_rows(tables, name)
    if len(whole) == len(rows) and all(r == g for g, r in enumerate(rows.tolist())):
        return whole
    return whole[rows]


def table_rows(tables: list[BlockTable], name: str) -> tuple[np.ndarray, np.ndarray]:
    """An array whose rows hold field ``name`` of ``tables`` (repeats allowed), and each
    table's row in it: the [group, ...] array of their ``block_tables`` call when they all
    come from one, so that a per-table reduction runs once over it, not once per table."""
    batch = tables[0].batch
    if batch is not None and all(t.batch is not None and t.batch[0] is batch[0] for t in tables):
        return batch[0][name], np.array([t.batch[1] for t in tables], dtype=np.int64)
    return np.stack([getattr(t, name) for t in tables]), np.arange(len(tables))


class BlockTables:
    """The block tables of one (model, cluster, workload, context-parallel split, expert-TP
    choice ``etp``: None for the attention's tp, 1 for experts folded out of it), one per (tp,
    TP style, ep) group (the style: frameworks.TP_STYLES, sequence parallelism or AutoTP's
    whole vocabulary; ``sp`` in the keys below), each covering every micro-batch size asked for so far (the kernels are
    elementwise in the size, so a wider table holds the same numbers for the sizes a group uses)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, workload: Workload, dev: eff.Device, cp: int = 1,
                 cp_comm: str = "p2p", etp: int | None = None) -> None:
        self.cluster, self.dev, self.cp, self.cp_comm = cluster, dev, cp, cp_comm
        self.runs = RunModel(model, workload, cp, etp)
        self._tables: dict[tuple[int, int, int], BlockTable] = {}
        profile = workload.layer_profile
        self.measured = self._measured_ratios(profile) if profile is not None else None

    def _measured_ratios(self, profile: LayerProfile) -> np.ndarray:
        """measured_blocks.measured_ratios of the run model's blocks: the profiled spec priced at the
        profile's micro-batch, sequence and dtype, unsharded, on this cluster's device."""
        index = measured_for(profile, self.runs.short, self.cluster.profile.name)
        at = self.runs.workload.model_copy(update={"seq_len": profile.seq_len, "precision": profile.dtype,
                                                   "recipe": None, "layer_profile": None})
        one = strided_shape(self.cluster, 1, 1, "tp")
        t = block_tables([(layer_costs(profile.profiled_spec, at), one, one)], (profile.micro_batch,),
                         workload_device(self.cluster, at), self.cluster)[0]
        return measured_ratios(profile, index, t.fwd[0], t.bwd[0], t.rc[RECOMPUTES.index("full"), 0],
                               t.act[RECOMPUTES.index("none")])

    def table(self, tp: int, sp: int, ep: int, micro: tuple[int, ...]) -> BlockTable:
        """The table of (tp, sp, ep) covering the micro-batch sizes ``micro``."""
        t = self._tables.get((tp, sp, ep))
        if t is not None and (t.micro_batches == micro or set(micro) <= set(t.micro_batches)):
            return t
        mbs = tuple(sorted(set(micro) | set(t.micro_batches if t else ())))
        t = self._tables[tp, sp, ep] = self._build([(tp, sp, ep)], mbs)[0]
        return t

    def prepare(self, groups: dict[tuple[int, int, int], tuple[int, ...]]) -> None:
        """Build the missing tables of many (tp, sp, ep) groups (to the micro-batch sizes each
        needs) in one pass; every table built covers the union of the sizes."""
        todo = [key for key, micro in groups.items()
                if key not in self._tables or not set(micro) <= set(self._tables[key].micro_batches)]
        if not todo:
            return
        mbs = tuple(sorted({b for micro in groups.values() for b in micro}))
        for key, table in zip(todo, self._build(todo, mbs)):
            self._tables[key] = table

    def _build(self, keys: list[tuple[int, int, int]], mbs: tuple[int, ...]) -> list[BlockTable]:
        """``block_tables`` of the run model's layer costs per (tp, sp, ep): the TP group is the
        innermost tp ranks, the CP and the EP group the next cp and ep after the expert-TP ranks
        (cost/layout.py), whatever dp and pp are."""
        groups = [(self.runs.layer_costs(tp, sp, ep), strided_shape(self.cluster, 1, tp, "tp"),
                   strided_shape(self.cluster, self.runs.expert_tp(tp), ep, "ep")) for tp, sp, ep in keys]
        cp = [cp_groups(self.cluster, tp, self.cp, self.cp_comm) for tp, _, _ in keys] if self.cp > 1 else None
        return block_tables(groups, mbs, self.dev, self.cluster, runs=self.runs.runs, cp=cp, measured=self.measured)
