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
    (``detail``: as a dict, with every per-rank part as well, to build Plans from). Row by row:
    a candidate's numbers do not depend on which others are assembled with it."""
    w = ev.workload
    dp, ep, tp, vs = (col[k][:, None].astype(float) for k in ("dp", "ep", "tp", "vs"))
    m = col["grad_accum"][:, None].astype(float)
    zero, off, fwi = col["zero"], col["offload"], col["framework"]
    edp_n = np.maximum(col["dp"] // col["ep"], 1)[:, None].astype(float)
    n = len(dp)
    weights, grads, opt, cpu = (np.zeros((n, pp)) for _ in range(4))
    code = (zero * 8 + off) * 8 + fwi
    for value in np.flatnonzero(np.bincount(code)).tolist():  # the codes present, ascending (< 256)
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
        inflight = mem.inflight_array(rank, pp, vs, m, mem.microbatch_groups(col["pp"], col["grad_accum"])[:, None])
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
                "worst": worst, "bubble": bubble, "dp": dp_t, "opt": opt_t,
                "step_time": step, "peak_bytes": peak.max(axis=1), "cpu_bytes": cpu_node}
    return step, peak.max(axis=1), cpu_node

def _dp_exposed(ev: "Evaluator", col, r, pp: int, m, vs) -> np.ndarray:
    """Per rank: the data-parallel traffic the backward pass does not hide (estimate.dp_exposed).

    The collectives are listed per (tp, ep, dp) layout (its DP and expert-DP group shapes),
    priced together (collective_times: one call per op and shape), and the rest is
    elementwise over every candidate at once."""
    n = len(m)
    zero, fwi = col["zero"], col["framework"]
    gbytes = np.array([ev._grad_bytes(f) for f in range(len(FRAMEWORKS))], dtype=float)[fwi][:, None]
    dense, expert = r["dense"], r["expert"]
    reduce, gather, tied_t = np.zeros((n, pp)), np.zeros((n, pp)), np.zeros((n, pp))
    traits = [fw.traits(f) for f in FRAMEWORKS]
    allreduce = np.array([t.zero_grad_allreduce for t in traits])[fwi]  # ZeRO-1/2 grads all-reduced
    engine = np.array([t.pipe_engine and pp > 1 for t in traits])[fwi]  # DeepSpeed's PipelineEngine
    z12 = (zero == 1) | (zero == 2)
    code = (col["tp"] * (col["ep"].max() + 1) + col["ep"]) * (col["dp"].max() + 1) + col["dp"]
    requests: list[tuple[str, object, np.ndarray]] = []
    fills = []  # (target array, rows, dense request, expert request, expert bytes)
    for value in sorted(set(code.tolist())):  # a handful of layouts: no np.unique
        s = code == value
        i = int(np.argmax(s))
        tp, ep, dp = int(col["tp"][i]), int(col["ep"][i]), int(col["dp"][i])
        shapes = ev.shapes(tp, ep, dp, pp)
        if (s & engine).any() and r["tied"][s & engine].any():  # estimate: ReduceTiedGrads, whatever dp
            rows = s & engine
            requests.append(("p2p", shapes.pp, gbytes[rows] * r["tied"][rows]))
            fills.append((tied_t, rows, len(requests) - 1, None, np.zeros_like(dense[rows])))
        if dp == 1 and ep == 1:
            continue
        for rows, op, target, d, e in (
            (s & z12 & ~allreduce, "reducescatter", reduce, gbytes * dense, gbytes * expert),
            (s & z12 & allreduce, "allreduce", reduce, gbytes * dense, gbytes * expert),
            (s & z12, "allgather", gather, 2 * dense, 2 * expert),  # 16-bit weights
            (s & (zero == 0), "allreduce", reduce, gbytes * dense, gbytes * expert),
        ):
            if not rows.any():
                continue
            e_rows = e[rows]
            # dense parameters over the DP group, expert parameters over the expert-DP group
            di = ei = None
            if dp > 1:
                di = len(requests)
                requests.append((op, shapes.dp, d[rows]))
            if dp // ep > 1:
                ei = len(requests)
                requests.append((op, shapes.edp, e_rows))
            fills.append((target, rows, di, ei, e_rows))
    priced = collective_times(ev.cluster, requests)
    for target, rows, di, ei, e_rows in fills:
        t = priced[di] if di is not None else np.zeros_like(e_rows)
        target[rows] = t + np.where(e_rows > 0, priced[ei], 0.0) if ei is not None else t
    fwd, bwd = r["fwd"], r["bwd"] + r["rc"]
    overlap = np.array([fw.grad_reduce_overlaps(t, pp) for t in traits])[fwi][:, None]
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
    if not col["offload"].any():  # no offload (index 0) among them: the host terms are not needed
        return gpu
    node = ev.cluster.profile.node
    off = np.array(OFFLOADS)[col["offload"]][:, None]
    cpu_opt = st.cpu_optimizer_time(local, ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9,
                                    False, m)
    cpu_par = st.cpu_optimizer_time(local, ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9,
                                    True, m)
    hybrid = st.hybrid_optimizer_time(local, ev.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9)
    cpu_opt = np.where((col["framework"] == FRAMEWORKS.index("megatron"))[:, None], hybrid, cpu_opt)
    return np.where(off == "none", gpu, np.where(off == "optimizer", cpu_opt, cpu_par))
