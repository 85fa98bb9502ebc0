"""Assemble memory and step time over [candidates x pipeline ranks] arrays.

The last step of the vectorised twin of ``planner.cost.estimate`` (see planner/cost/README.md,
"Assembly"): model states under ZeRO/offload, activations with the in-flight micro-batches,
buffers and allowances per rank; the pipeline (m T_max + bubble), exposed data-parallel
traffic and the optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost import step_time as st
from planner.cost.collectives import collective_times
from planner.cost.parallel import FRAMEWORKS, OFFLOADS

if TYPE_CHECKING:
    from planner.search.evaluate import Evaluator


def assemble(ev: "Evaluator", col: dict[str, np.ndarray], r: dict[str, np.ndarray], pp: int, detail: bool = False):
    """Step time, worst-rank peak bytes and CPU bytes per node of candidates with ``pp`` ranks
    (``detail``: every per-rank part as well, to build Plans from)."""
    w = ev.workload
    dp, ep, tp, vs = (col[k][:, None].astype(float) for k in ("dp", "ep", "tp", "vs"))
    m = col["grad_accum"][:, None].astype(float)
    zero, off, fwi = col["zero"], col["offload"], col["framework"]
    edp_n = np.maximum(col["dp"] // col["ep"], 1)[:, None].astype(float)
    n = len(dp)
    weights, grads, opt, cpu = (np.zeros((n, pp)) for _ in range(4))
    code = (zero * 8 + off) * 8 + fwi
    for value in np.unique(code, return_counts=True)[0]:
        z, o, f = int(value // 64), int(value // 8 % 8), int(value % 8)
        s = code == value
        wd, gd, od, cd = mem.bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], dp[s], w.precision, w.optimizer_moments)
        we, ge, oe, ce = mem.bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], edp_n[s], w.precision, w.optimizer_moments)
        dense, expert = r["dense"][s], r["expert"][s]
        live3 = 2.0 * r["largest"][s] if z == 3 else 0.0
        weights[s] = wd * dense + we * expert + live3
        grads[s] = gd * dense + ge * expert + live3
        opt[s] = od * dense + oe * expert
        cpu[s] = cd * dense + ce * expert
    rank = np.arange(pp)[None, :].astype(float)
    if pp == 1:
        inflight = np.ones((n, 1))
    else:
        one_f1b = np.minimum(pp - rank, m)
        inter = np.minimum((pp - rank - 1) * 2 + (vs - 1) * pp + 1, m * vs) / vs
        inflight = np.where(vs == 1, one_f1b, inter)
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
    worst_mem = np.argmax(peak, axis=1)
    rows = np.arange(n)
    cpu_node = cpu[rows, worst_mem] * ev.cluster.gpus_per_node * mem.CPU_BUFFER_FACTOR

    total = r["fwd"] + r["bwd"] + r["rc"] + r["tp"] + r["ep"] + r["pp"]
    worst = np.argmax(total, axis=1)
    tw = total[rows, worst]
    bubble = (total.sum(axis=1) - tw) / vs[:, 0]
    mb = m[:, 0]
    body = mb * tw
    dp_t = _dp_exposed(ev, col, r, pp, m, vs)
    opt_t = _optimizer(ev, col, r, pp, m)
    step = body + bubble + dp_t.max(axis=1) + opt_t.max(axis=1)
    if detail:
        return {"weights": weights, "grads": grads, "optimizer": opt, "activations": acts, "buffers": buffers,
                "overhead": mem.CUDA_CONTEXT_BYTES + mem.FRAGMENTATION * allocated,
                "cpu_per_node": cpu * ev.cluster.gpus_per_node * mem.CPU_BUFFER_FACTOR, "inflight": inflight,
                "worst": worst, "bubble": bubble, "dp": dp_t, "opt": opt_t}
    return step, peak.max(axis=1), cpu_node

def _dp_exposed(ev: "Evaluator", col, r, pp: int, m, vs) -> np.ndarray:
    """Per rank: the data-parallel traffic the backward pass does not hide (estimate.dp_exposed).

    Two passes: every (tp, ep, dp, zero, framework) group lists the collectives it needs,
    they are priced together (collective_times: one call per op and process-group shape),
    then each group takes its share."""
    n = len(m)
    out = np.zeros((n, pp))
    keys = np.column_stack([col["tp"], col["ep"], col["dp"], col["zero"], col["framework"]])
    requests: list[tuple[str, object, np.ndarray]] = []
    plans = []
    for key in np.unique(keys, axis=0, return_counts=True)[0]:  # counts: numpy.ma is never imported
        tp, ep, dp, zero, fwi = (int(x) for x in key)
        if dp == 1 and ep == 1:
            continue
        s = np.all(keys == key, axis=1)
        if zero == 3:
            plans.append((s, zero, fwi, None))
            continue
        gbytes = ev._grad_bytes(fwi)
        shapes = ev.shapes(tp, ep, dp, pp)
        dense, expert = r["dense"][s], r["expert"][s]
        # (op, dense bytes, expert bytes): the reduction, then the 16-bit weight gather
        ops = ([("reducescatter", gbytes * dense, gbytes * expert), ("allgather", 2 * dense, 2 * expert)]
               if zero >= 1 else [("allreduce", gbytes * dense, gbytes * expert)])
        parts = []
        for op, d, e in ops:
            # dense parameters over the DP group, expert parameters over the expert-DP group
            di = len(requests) if dp > 1 else None
            if dp > 1:
                requests.append((op, shapes.dp, d))
            ei = len(requests) if dp // ep > 1 else None
            if dp // ep > 1:
                requests.append((op, shapes.edp, e))
            parts.append((di, ei, e))
        plans.append((s, zero, fwi, parts))
    priced = collective_times(ev.cluster, requests)

    def total(di, ei, e) -> np.ndarray:
        t = priced[di] if di is not None else np.zeros_like(e)
        return t + np.where(e > 0, priced[ei], 0.0) if ei is not None else t

    for s, zero, fwi, parts in plans:
        fwd, bwd = r["fwd"][s], r["bwd"][s] + r["rc"][s]
        if parts is None:  # ZeRO-3: per-block gathers and reduce-scatters against compute
            gather, reduce = r["z3_gather"][s], r["z3_reduce"][s]
            out[s] = m[s] * (np.maximum(0.0, gather - fwd) + np.maximum(0.0, gather + reduce - bwd))
            continue
        reduce = total(*parts[0])
        gather = total(*parts[1]) if len(parts) > 1 else np.zeros_like(reduce)
        traits = fw.traits(FRAMEWORKS[fwi])
        rank = np.arange(pp)[None, :]
        cooldown = rank * bwd / vs[s] if pp > 1 else np.zeros_like(bwd)
        first_fwd = fwd if FRAMEWORKS[fwi] == "megatron" else np.zeros_like(fwd)
        window = (bwd if traits.overlap_grad_reduce else 0.0) + cooldown
        hide = np.where((gather > 0) & traits.overlap_grad_reduce, first_fwd, 0.0)
        out[s] = np.maximum(0.0, reduce - window) + np.maximum(0.0, gather - hide)
    return out


def _optimizer(ev: "Evaluator", col, r, pp: int, m) -> np.ndarray:
    w = ev.workload
    sharded = (col["zero"] >= 1)[:, None]
    dp = col["dp"][:, None].astype(float)
    edp = np.maximum(col["dp"] // col["ep"], 1)[:, None].astype(float)
    local = r["dense"] / np.where(sharded, dp, 1.0) + r["expert"] / np.where(sharded, edp, 1.0)
    step_bytes = eff.SGD_STEP_BYTES if w.optimizer == "sgd" else eff.ADAM_STEP_BYTES
    gpu = eff.hbm_time(local * step_bytes, ev.dev)
    node = ev.cluster.profile.node
    off = np.array(OFFLOADS)[col["offload"]][:, None]
    cpu_opt = st.cpu_optimizer_time(local, ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9,
                                    False, m)
    cpu_par = st.cpu_optimizer_time(local, ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9,
                                    True, m)
    return np.where(off == "none", gpu, np.where(off == "optimizer", cpu_opt, cpu_par))
