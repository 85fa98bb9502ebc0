"""Assemble memory and step time over [candidates x pipeline ranks] arrays.

The last step of the vectorised twin of ``planner.cost.estimate`` (see planner/cost/README.md,
"Assembly"): model states under ZeRO/offload, activations with the in-flight micro-batches,
buffers and allowances per rank; the pipeline (m T_max + bubble), exposed data-parallel
traffic and the optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost import step_time as st
from planner.cost.collectives import collective_times_numbered
from planner.cost.parallel import FRAMEWORKS, OFFLOADS
from planner.hardware.placement import GroupShape

if TYPE_CHECKING:
    from planner.search.evaluate import Evaluator


def assemble(ev: "Evaluator", col: dict[str, np.ndarray], r: dict[str, np.ndarray], pp: int, detail: bool = False):
    """Step time, worst-rank peak bytes and CPU bytes per node of candidates whose rank tables
    are ``pp`` wide (``detail``: as a dict, with every per-rank part as well, to build Plans
    from). Row by row: a candidate's numbers do not depend on which others are assembled with it.

    Candidates of several pipeline depths go together (one pass, not one per depth): a table
    shallower than ``pp`` is padded with zeros past its last rank. Padded ranks hold nothing,
    so their time, DP, optimizer and host parts are zero and never pass a real rank's (all
    non-negative); their peak (context and NCCL buffers) is masked out, and the bubble sums
    each depth's ranks alone, as a table of that depth would."""
    vs = col["vs"][:, None].astype(float)
    m = col["grad_accum"][:, None].astype(float)
    zero, fwi = col["zero"], col["framework"]
    n = len(vs)
    weights, grads, opt, cpu = _model_states(ev, col, r)
    rank = np.arange(pp)[None, :].astype(float)
    depths = _depths(col["pp"], pp)
    if pp == 1:
        inflight = np.ones((n, 1))
    else:
        depth = pp if len(depths) == 1 else col["pp"][:, None]
        inflight = mem.inflight_array(rank, depth, vs, m, mem.microbatch_groups(col["pp"], col["grad_accum"])[:, None])
        if 1 in depths:
            inflight = np.where(col["pp"][:, None] == 1, 1.0, inflight)
    acts = r["stored"] * inflight + r["live"]
    groups = sum((col[k] > 1).astype(float) for k in ("tp", "pp", "dp", "ep"))[:, None]
    stage_params = r["dense"] + r["expert"]
    buckets = np.zeros((n, pp))
    zb = np.array([fw.traits(f).zero_buckets for f in FRAMEWORKS])[fwi][:, None]
    z12 = zb & ((zero == 1) | (zero == 2))[:, None]
    z3 = zb & (zero == 3)[:, None]
    buckets = np.where(z12, fw.OVERLAP_COMM_FACTOR * 2 * (np.minimum(fw.REDUCE_BUCKET_SIZE, stage_params)
                                                        + np.minimum(fw.ALLGATHER_BUCKET_SIZE, stage_params)), buckets)
    buckets = np.where(z3, 2 * np.minimum(fw.STAGE3_PREFETCH_BUCKET_SIZE, stage_params)
                       + 2 * np.minimum(fw.REDUCE_BUCKET_SIZE, stage_params), buckets)
    buffers = mem.NCCL_BYTES_PER_GROUP * groups + r["ppbuf"] + buckets
    allocated = weights + grads + opt + acts + buffers
    peak = allocated + mem.CUDA_CONTEXT_BYTES + mem.FRAGMENTATION * allocated
    rows = np.arange(n)
    # host memory must fit on every node: the rank offloading the most (Plan.cpu_bytes_per_node)
    cpu_node = cpu.max(axis=1) * ev.cluster.gpus_per_node * mem.CPU_BUFFER_FACTOR

    total = r["fwd"] + r["bwd"] + r["rc"] + r["tp"] + r["ep"] + r["pp"]
    worst = np.argmax(total, axis=1)
    tw = total[rows, worst]
    bubble = (_rank_sums(total, col["pp"], depths) - tw) / vs[:, 0]
    mb = m[:, 0]
    body = mb * tw
    dp_t = _dp_exposed(ev, col, r, pp, m, vs)
    opt_t = _optimizer(ev, col, r, pp, m)
    step = body + bubble + dp_t.max(axis=1) + opt_t.max(axis=1)
    if len(depths) > 1:  # padded ranks: context and NCCL buffers only, never a candidate's peak
        peak = np.where(rank < col["pp"][:, None], peak, -np.inf)
    if detail:
        return {"weights": weights, "grads": grads, "optimizer": opt, "activations": acts, "buffers": buffers,
                "overhead": mem.CUDA_CONTEXT_BYTES + mem.FRAGMENTATION * allocated,
                "cpu_per_node": cpu * ev.cluster.gpus_per_node * mem.CPU_BUFFER_FACTOR, "inflight": inflight,
                "worst": worst, "bubble": bubble, "dp": dp_t, "opt": opt_t,
                "step_time": step, "peak_bytes": peak.max(axis=1), "cpu_bytes": cpu_node}
    return step, peak.max(axis=1), cpu_node


def _model_states(ev: "Evaluator", col, r) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: weights, gradients, optimizer states and host bytes of the model states
    (estimate: memory.model_states), dense parameters sharded over dp, experts over dp / ep.

    ``mem.bytes_per_param`` is called once per distinct (framework, ZeRO, offload, group size)
    among the rows, on Python numbers: the same divisions numpy would do, without numpy's
    cost per call on a few rows at a time. (bounds._state_bytes does the same for every
    candidate of a space at once with a [setting x size] table: there numpy's per-call cost is
    spread over thousands of rows, here a table costs more than the rows.)"""
    w = ev.workload
    factors: dict[tuple[int, int, int, int], tuple[float, float, float, float]] = {}

    def per_param(f: int, z: int, o: int, size: int) -> tuple[float, float, float, float]:
        hit = factors.get((f, z, o, size))
        if hit is None:
            hit = factors[f, z, o, size] = mem.bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], size, w.precision,
                                                                w.optimizer_moments)
        return hit

    dp = col["dp"]
    rows = [per_param(f, z, o, d) + per_param(f, z, o, e) for f, z, o, d, e in zip(
        col["framework"].tolist(), col["zero"].tolist(), col["offload"].tolist(), dp.tolist(),
        np.maximum(dp // col["ep"], 1).tolist())]
    wd, gd, od, cd, we, ge, oe, ce = np.array(rows, dtype=float).reshape(-1, 8).T[:, :, None]
    dense, expert = r["dense"], r["expert"]
    z3 = col["zero"] == 3
    live3 = np.where(z3[:, None], 2.0 * r["largest"], 0.0) if z3.any() else 0.0  # the gathered largest block
    return (wd * dense + we * expert + live3, gd * dense + ge * expert + live3, od * dense + oe * expert,
            cd * dense + ce * expert)


def _depths(depth: np.ndarray, pp: int) -> list[int]:
    """The pipeline depths among the candidates (``pp`` alone when every table is that wide)."""
    if not len(depth) or bool((depth == pp).all()):
        return [pp]
    return sorted(set(depth.tolist()))


def _rank_sums(x: np.ndarray, depth: np.ndarray, depths: list[int]) -> np.ndarray:
    """Each row's sum over its own ranks: per depth over [rows x depth], the very sum a table
    of that depth gives (numpy sums a longer row in another order)."""
    if len(depths) == 1:
        return x.sum(axis=1)
    out = np.empty(len(x))
    for p in depths:
        rows = depth == p
        out[rows] = x[rows, :p].sum(axis=1)
    return out


def _dp_exposed(ev: "Evaluator", col, r, pp: int, m, vs) -> np.ndarray:
    """Per rank: the data-parallel traffic the backward pass does not hide (estimate.dp_exposed).

    Each row names its collectives by (tp, ep, dp, pp) layout and op (its DP, expert-DP and
    pp group shapes), all priced in one pass (collective_times_numbered), and the rest is
    elementwise over every candidate at once."""
    zero, fwi = col["zero"], col["framework"]
    gbytes = np.array([ev._grad_bytes(f) for f in range(len(FRAMEWORKS))], dtype=float)[fwi][:, None]
    dense, expert = r["dense"], r["expert"]
    traits = [fw.traits(f) for f in FRAMEWORKS]
    allreduce = np.array([t.zero_grad_allreduce for t in traits])[fwi]  # ZeRO-1/2 grads all-reduced
    deep = col["pp"] > 1
    engine = np.array([t.pipe_engine for t in traits])[fwi] & deep  # DeepSpeed's PipelineEngine
    z12 = (zero == 1) | (zero == 2)
    # Per row, the op that reduces its gradients (ZeRO-1/2 reduce-scatter or all-reduce, ZeRO-0
    # all-reduce; none under ZeRO-3) and whether it gathers 16-bit weights (ZeRO-1/2).
    red_op = np.where(zero == 0, 1, np.where(z12, np.where(allreduce, 1, 0), -1))
    key_of, layout_of = layout_keys(ev, col)
    has_dp, has_edp = col["dp"] > 1, col["dp"] // col["ep"] > 1
    ops = len(DP_OPS)
    # [request x row] key numbers of ``key_of`` (-1: nothing to price): dense parameters over the DP
    # group, expert parameters over the expert-DP group; ReduceTiedGrads over the pp group.
    which = np.stack((
        np.where(has_dp & (red_op >= 0), layout_of * 3 * ops + 3 * np.maximum(red_op, 0), -1),
        np.where(has_edp & (red_op >= 0), layout_of * 3 * ops + 3 * np.maximum(red_op, 0) + 1, -1),
        np.where(has_dp & z12, layout_of * 3 * ops + 3 * 2, -1),
        np.where(has_edp & z12, layout_of * 3 * ops + 3 * 2 + 1, -1),
        np.where(engine & (r["tied"] > 0).any(axis=1), layout_of * 3 * ops + 2, -1),  # ReduceTiedGrads, whatever dp
    ))
    sizes = np.stack((gbytes * dense, gbytes * expert, 2 * dense, 2 * expert, gbytes * r["tied"]))
    t_red, e_red, t_gat, e_gat, tied_t = collective_times_numbered(ev.cluster, key_of, which[..., None], sizes)
    single = (col["dp"] == 1) & (col["ep"] == 1)  # nothing to reduce or gather
    reduce = np.where((~single & (red_op >= 0))[:, None],
                      np.where(has_edp[:, None], t_red + np.where(gbytes * expert > 0, e_red, 0.0), t_red), 0.0)
    gather = np.where((~single & z12)[:, None],
                      np.where(has_edp[:, None], t_gat + np.where(2 * expert > 0, e_gat, 0.0), t_gat), 0.0)
    fwd, bwd = r["fwd"], r["bwd"] + r["rc"]
    overlap = np.where(deep, np.array([fw.grad_reduce_overlaps(t, 2) for t in traits])[fwi],
                       np.array([fw.grad_reduce_overlaps(t, 1) for t in traits])[fwi])[:, None]
    # estimate._dp_time: the earlier ranks' backward of the last micro-batch (1/v of it each),
    # none on the ranks a PipelineEngine's ReduceTiedGrads holds until rank 0 is done
    cooldown = np.where(engine[:, None] & (r["tied"] > 0), 0.0, (np.cumsum(bwd, axis=1) - bwd) / vs)
    first_fwd = np.where((fwi == FRAMEWORKS.index("megatron"))[:, None], fwd, 0.0)
    window = np.where(overlap, bwd, 0.0) + cooldown
    hide = np.where((gather > 0) & overlap, first_fwd, 0.0)
    out = tied_t + np.maximum(0.0, reduce - window) + np.maximum(0.0, gather - hide)
    # DeepSpeed's ZeRO-2 also reduces each earlier micro-batch in its own backward
    # (step_time.earlier_microbatch_reductions)
    every = np.array([t.zero2_reduces_every_microbatch for t in traits])[fwi] & (zero == 2)
    if every.any():
        out[every] += (m[every] - 1.0) * np.maximum(0.0, reduce[every] - np.where(overlap[every], bwd[every], 0.0))
    z3 = (zero == 3) & ((col["dp"] > 1) | (col["ep"] > 1))
    if z3.any():  # ZeRO-3: per-block gathers and reduce-scatters against compute
        g3, r3 = r["z3_gather"][z3], r["z3_reduce"][z3]
        out[z3] = m[z3] * (np.maximum(0.0, g3 - fwd[z3]) + np.maximum(0.0, g3 + r3 - bwd[z3]))
    alone = (col["dp"] == 1) & (col["ep"] == 1)
    out[alone] = tied_t[alone]
    return out


# The DP collectives of a layout, in the order ``layout_keys`` lists them (op k: keys 3k,
# 3k + 1 over the DP and expert-DP groups; key 2 is the pipeline's p2p).
DP_OPS = ("reducescatter", "allreduce", "allgather")


def layout_keys(ev: "Evaluator", col) -> tuple[Callable[[int], tuple[str, GroupShape]], np.ndarray]:
    """Numbers for the (op, group shape) pairs each (tp, ep, dp, pp) layout among the rows may
    price, three per op of ``DP_OPS`` (k: 3k over the DP group, 3k + 1 over the expert-DP
    group; 2: the pp group's p2p), as a lookup that builds only the shapes asked for, and each
    row's layout number."""
    code = (col["tp"] * (col["ep"].max() + 1) + col["ep"]) * (col["dp"].max() + 1) + col["dp"]
    code = code * (col["pp"].max() + 1) + col["pp"]
    _, first, layout_of = np.unique(code, return_index=True, return_inverse=True)
    layouts = [tuple(int(col[k][i]) for k in ("tp", "ep", "dp", "pp")) for i in first.tolist()]

    def key_of(k: int) -> tuple[str, GroupShape]:
        layout, slot = divmod(k, 3 * len(DP_OPS))
        shapes = ev.shapes(*layouts[layout])
        if slot == 2:
            return "p2p", shapes.pp
        return DP_OPS[slot // 3], shapes.edp if slot % 3 else shapes.dp

    return key_of, layout_of.reshape(-1)


def _optimizer(ev: "Evaluator", col, r, pp: int, m) -> np.ndarray:
    return optimizer_seconds(ev, col, r["dense"], r["expert"], m)


def optimizer_seconds(ev: "Evaluator", col, dense: np.ndarray, expert: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The optimizer step of ranks holding ``dense`` and ``expert`` parameters ([candidate x
    rank]): fused Adam over HBM, or when offloading DeepSpeedCPUAdam (DeepSpeed engines) or
    Megatron-Core's HybridDeviceOptimizer (megatron). Linear in the parameters (the hybrid
    step is the larger of two terms proportional to them), so the mean rank's time bounds the
    slowest rank's (planner/search/bounds.py)."""
    w = ev.workload
    sharded = (col["zero"] >= 1)[:, None]
    dp = col["dp"][:, None].astype(float)
    edp = np.maximum(col["dp"] // col["ep"], 1)[:, None].astype(float)
    local = dense / np.where(sharded, dp, 1.0) + expert / np.where(sharded, edp, 1.0)
    step_bytes = eff.SGD_STEP_BYTES if w.optimizer == "sgd" else eff.ADAM_STEP_BYTES
    gpu = eff.hbm_time(local * step_bytes, ev.dev)
    # Each host term only where some row offloads that way (most spaces have no parameter offload).
    node = ev.cluster.profile.node
    host = (ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9)
    off = col["offload"][:, None]
    out = gpu
    optimizer = off == OFFLOADS.index("optimizer")
    if optimizer.any():
        cpu_opt = st.cpu_optimizer_time(local, *host, False, m)
        megatron = (col["framework"] == FRAMEWORKS.index("megatron"))[:, None]
        if (megatron & optimizer).any():
            cpu_opt = np.where(megatron, st.hybrid_optimizer_time(local, *host), cpu_opt)
        out = np.where(optimizer, cpu_opt, out)
    params = off == OFFLOADS.index("optimizer+params")
    if params.any():
        out = np.where(params, st.cpu_optimizer_time(local, *host, True, m), out)
    return out
