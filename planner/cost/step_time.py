"""Step time over [candidate x pipeline rank] arrays: the pipeline, exposed data-parallel
traffic and the optimizer step.

1. The pipeline: ``T = m * T_max + (sum_r T_r - T_max) / v`` for m micro-batches over p ranks
   with v chunks each, T_r rank r's micro-batch over all its chunks (rank_tables.py): 1F1B's
   (m + p - 1) T for equal stages; interleaving divides the bubble by v (Narayanan et al. 2021
   Sec 2.2). Unequal stages run at the pace of the slowest.
2. Data parallelism: gradient reduction per rank (all-reduce; ZeRO / the distributed
   optimizer: reduce-scatter and an all-gather of the updated 16-bit weights; DeepSpeed's
   ZeRO-1/2 all-reduce their buckets), started during the last micro-batch's backward where
   the runtime buckets it (not in DeepSpeed's PipelineEngine, which reduces after the drain),
   and hidden by the pipeline cool-down too: after rank r's last backward the gradient still
   runs back through ranks r-1 .. 0 (their last chunk, 1/v of a micro-batch's backward each).
   The weight all-gather hides behind the next step's first forward on Megatron
   (--overlap-param-gather) and nowhere on DeepSpeed. DeepSpeed's PipelineEngine first
   all-reduces a tied embedding's gradient between the two ranks holding it
   (ReduceTiedGrads), which leaves those ranks no cool-down. DeepSpeed's ZeRO-2 reduces every
   micro-batch's gradients in that micro-batch's backward (zero/stage_1_and_2.py
   reduce_ready_partitions_and_remove_grads), ZeRO-1 once per step. ZeRO-3 gathers each
   block's weights in every forward and backward and reduce-scatters its gradients per
   micro-batch, prefetched under compute: only the excess shows.
3. The optimizer: fused Adam over the local shard from HBM, or on the host when offloading
   (DeepSpeedCPUAdam plus the PCIe copies; Megatron-Core's HybridDeviceOptimizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost.candidates import dp_ranks, expert_shard_ranks, shard_ranks
from planner.cost.collectives import collective_times_numbered
from planner.cost.context import CostContext
from planner.cost.parallel import FRAMEWORKS, OFFLOADS
from planner.cost.precision import gathers_fp8_params
from planner.cost.runtime_copies import flat_copy_seconds, grad_reduction_copies
from planner.cost.zero3_fetch import keeps_stage_gathered
from planner.hardware.placement import GroupShape


@dataclass(frozen=True, slots=True)
class MicroBatchTime:
    """One pipeline rank, one micro-batch (all of its chunks), seconds."""

    fwd: float
    bwd: float
    recompute: float
    tp: float
    ep: float
    pp: float
    cp: float = 0.0  # exposed context-parallel attention traffic

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp + self.ep + self.pp + self.cp


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float
    recompute: float
    tp_comm: float
    pp_bubble: float
    pp_comm: float
    dp_comm: float
    ep_comm: float
    optimizer: float
    cp_comm: float = 0.0
    act_offload: float = 0.0  # activation copies to and from host memory left exposed (activation_offload.py)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_bubble + self.pp_comm + self.dp_comm
                + self.ep_comm + self.optimizer + self.cp_comm + self.act_offload)


# -- the pipeline ----------------------------------------------------------------------------


def pipeline(total: np.ndarray, depth: np.ndarray, vs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: (the slowest rank, the bubble) of 1F1B / interleaved 1F1B, from each
    rank's micro-batch seconds ``total`` ([candidate x rank], zero past a candidate's ``depth``
    ranks) and the virtual stages ``vs``."""
    worst = np.argmax(total, axis=1)
    slowest = total[np.arange(len(total)), worst]
    return worst, (_rank_sums(total, depth) - slowest) / vs


def depths(depth: np.ndarray, width: int) -> list[int]:
    """The pipeline depths among the candidates (``width`` alone when every one is that deep)."""
    if not len(depth) or bool((depth == width).all()):
        return [width]
    return sorted(set(depth.tolist()))


def _rank_sums(x: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Each row's sum over its own ranks: per depth over [rows x depth], the very sum a table
    of that depth gives (numpy sums a longer row in another order)."""
    found = depths(depth, x.shape[1])
    if len(found) == 1:
        return x.sum(axis=1)
    out = np.empty(len(x))
    for p in found:
        rows = depth == p
        out[rows] = x[rows, :p].sum(axis=1)
    return out


# -- data parallelism ------------------------------------------------------------------------

# The DP collectives of a layout, in the order ``layout_keys`` numbers them (op k: keys 3k,
# 3k + 1 over the DP and expert-DP groups, 3k + 2 over the outer hybrid-sharding group; key 2
# is the pipeline's p2p).
DP_OPS = ("reducescatter", "allreduce", "allgather")
_TRAITS = [fw.traits(f) for f in FRAMEWORKS]
_ALLREDUCE = np.array([t.zero_grad_allreduce for t in _TRAITS])  # ZeRO-1/2 gradients all-reduced
_PIPE_ENGINE = np.array([t.pipe_engine for t in _TRAITS])
_OVERLAPS = np.array([[[fw.grad_reduce_overlaps(t, pp, zero) for t in _TRAITS] for zero in (1, 0)]
                      for pp in (1, 2)])  # [deep, no ZeRO, framework]
_EVERY_MICROBATCH = np.array([t.zero2_reduces_every_microbatch for t in _TRAITS])
_FLAT_COPIES = np.array([t.flat_copies for t in _TRAITS])
_HSDP_EVERY_MICROBATCH = np.array([t.hsdp_allreduce_every_microbatch for t in _TRAITS])
MEGATRON = FRAMEWORKS.index("megatron")


def layout_keys(ctx: CostContext, col: dict[str, np.ndarray]) -> tuple[Callable[[int], tuple[str, GroupShape]],
                                                                          np.ndarray]:
    """Numbers for the (op, group shape) pairs each (tp, ep, dp, pp, rep, etp) layout among the rows
    may price, three per op of ``DP_OPS`` (k: 3k over the DP group, 3k + 1 over the expert-DP
    group, 3k + 2 over the outer hybrid-sharding group; 2: the pp group's p2p), as a lookup that
    builds only the shapes asked for, and each row's layout number."""
    dp = dp_ranks(col)
    code = (col["tp"] * (col["ep"].max() + 1) + col["ep"]) * (dp.max() + 1) + dp
    code = (code * (col["pp"].max() + 1) + col["pp"]) * (col["rep"].max() + 1) + col["rep"]
    code = code * 2 + (col["etp"] < col["tp"])
    _, first, layout_of = np.unique(code, return_index=True, return_inverse=True)
    layouts = [(int(col["tp"][i]), int(col["ep"][i]), int(dp[i]), int(col["pp"][i]), int(col["rep"][i]),
                int(col["etp"][i])) for i in first.tolist()]

    def key_of(k: int) -> tuple[str, GroupShape]:
        layout, slot = divmod(k, 3 * len(DP_OPS))
        shapes = ctx.layout(*layouts[layout])
        if slot == 2:
            return "p2p", shapes.pp
        return DP_OPS[slot // 3], (shapes.dp, shapes.edp, shapes.outer)[slot % 3]

    return key_of, layout_of.reshape(-1)


def fp8_param_gather(ctx: CostContext, col: dict[str, np.ndarray]) -> np.ndarray:
    """Per candidate ([candidate x 1]), whether its weights of the recipe's GEMMs are kept only
    in FP8 and all-gathered so (precision.gathers_fp8_params, asked per runtime, ZeRO stage and offload)."""
    w = ctx.workload
    table = np.array([[[gathers_fp8_params(w.recipe, w.fp8_param_gather, f, z, o) for o in OFFLOADS] for z in range(4)]
                      for f in FRAMEWORKS])
    return table[col["framework"], col["zero"], col["offload"]][:, None]


def dp_collectives(ctx: CostContext, col: dict[str, np.ndarray],
                   r: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: seconds of the gradient reduction, of the ZeRO-1/2 weight all-gather (dense
    parameters over the DP group plus routed experts over the expert-DP group) and of
    DeepSpeed's ReduceTiedGrads, every collective of every row priced in one pass. Under hybrid
    sharding the DP groups are one sharding group each, and the reduction adds the all-reduce
    of the rank's gradient shard across the groups (outer group; for ZeRO-3 it is all the
    reduction this returns: the per-block reduce-scatters are in the rank tables)."""
    zero, fwi = col["zero"], col["framework"]
    gbytes = np.array([ctx.grad_bytes(f) for f in range(len(FRAMEWORKS))], dtype=float)[fwi][:, None]
    dense, expert = r["dense"], r["expert"]
    dp = shard_ranks(col)
    hybrid = (col["rep"] > 1) & ((zero == 1) | (zero == 3))
    shard_gbytes = np.array([[ctx.grad_bytes(f, z) for z in range(4)] for f in range(len(FRAMEWORKS))],
                            dtype=float)[fwi, zero][:, None]
    edp = expert_shard_ranks(col)
    shard = shard_gbytes * (dense / dp[:, None] + expert / np.maximum(edp, 1)[:, None])
    engine = _PIPE_ENGINE[fwi] & (col["pp"] > 1)
    z12 = (zero == 1) | (zero == 2)
    # Per row, the op that reduces its gradients (ZeRO-1/2 reduce-scatter or all-reduce, ZeRO-0
    # all-reduce; none under ZeRO-3) and whether it gathers 16-bit weights (ZeRO-1/2).
    red_op = np.where(zero == 0, 1, np.where(z12, np.where(_ALLREDUCE[fwi], 1, 0), -1))
    key_of, layout_of = layout_keys(ctx, col)
    has_dp, has_edp = dp > 1, edp > 1
    ops = len(DP_OPS)
    # [request x row] key numbers of ``key_of`` (-1: nothing to price): dense parameters over the DP
    # group, expert parameters over the expert-DP group; ReduceTiedGrads over the pp group.
    which = np.stack((
        np.where(has_dp & (red_op >= 0), layout_of * 3 * ops + 3 * np.maximum(red_op, 0), -1),
        np.where(has_edp & (red_op >= 0), layout_of * 3 * ops + 3 * np.maximum(red_op, 0) + 1, -1),
        np.where(has_dp & z12, layout_of * 3 * ops + 3 * 2, -1),
        np.where(has_edp & z12, layout_of * 3 * ops + 3 * 2 + 1, -1),
        np.where(engine & (r["tied"] > 0).any(axis=1), layout_of * 3 * ops + 2, -1),  # ReduceTiedGrads, whatever dp
        np.where(hybrid, layout_of * 3 * ops + 3 * 1 + 2, -1),  # the shards' all-reduce over the outer group
    ))
    # The updated weights are gathered in the working precision (fp32 runs gather fp32: DeepSpeed's
    # "bit16" groups are then the fp32 parameters); the FP8 parameters' all-gather moves 1 byte
    # each (a dense model's: which of an MoE's are expert weights the rank table does not say).
    wbytes = ctx.workload.bytes_per_param
    gathered = wbytes * dense - np.where(fp8_param_gather(ctx, col) & (expert == 0), (wbytes - 1) * r["low"], 0.0)
    sizes = np.stack((gbytes * dense, gbytes * expert, gathered, wbytes * expert, gbytes * r["tied"], shard))
    t_red, e_red, t_gat, e_gat, tied, outer = collective_times_numbered(ctx.cluster, key_of, which[..., None], sizes)
    single = (dp == 1) & (col["ep"] == 1)  # nothing to reduce or gather
    reduce = np.where((~single & (red_op >= 0))[:, None],
                      np.where(has_edp[:, None], t_red + np.where(gbytes * expert > 0, e_red, 0.0), t_red), 0.0)
    reduce = reduce + np.where(hybrid[:, None], outer, 0.0)
    flat = _FLAT_COPIES[fwi] & (red_op >= 0)
    if flat.any():  # DeepSpeed's copies into flat buffers and back around each reduction, made
        # with a DP group of one too (engine.py allreduce_gradients flattens whatever the group)
        copies = grad_reduction_copies(ctx.dev, gbytes * (dense + expert), dp[:, None], zero[:, None])
        reduce = reduce + np.where(flat[:, None], copies, 0.0)
    gather = np.where((~single & z12)[:, None],
                      np.where(has_edp[:, None], t_gat + np.where(expert > 0, e_gat, 0.0), t_gat), 0.0)
    return reduce, gather, tied


def dp_exposed(col: dict[str, np.ndarray], r: dict[str, np.ndarray], reduce: np.ndarray, gather: np.ndarray,
               tied: np.ndarray, overlap_share: float = 1.0, host_is_device: bool = False) -> np.ndarray:
    """Per rank: the data-parallel traffic (``dp_collectives``' seconds) the backward pass, the
    pipeline cool-down and the first forward do not hide; ``overlap_share`` of that compute
    hides it (the profile's calibration.overlap: 1.0, all of it, unless fitted). ZeRO-3's host
    hook time counts here too, where it outlasts the device's work (``host_is_device``: a CPU
    profile, where nothing runs beside it)."""
    zero, fwi = col["zero"], col["framework"]
    if host_is_device:  # a CPU rank's cores run its collectives too (gloo, blocking calls): nothing hides
        overlap_share = 0.0
    m = col["grad_accum"][:, None].astype(float)
    vs = col["vs"][:, None].astype(float)
    deep = col["pp"] > 1
    engine = _PIPE_ENGINE[fwi] & deep
    fwd, bwd = r["fwd"] * overlap_share, (r["bwd"] + r["rc"]) * overlap_share
    overlap = _OVERLAPS[deep.astype(int), (zero == 0).astype(int), fwi][:, None]
    # The earlier ranks' backward of the last micro-batch (1/v of it each), none on the ranks a
    # PipelineEngine's ReduceTiedGrads holds until rank 0 is done.
    cooldown = np.where(engine[:, None] & (r["tied"] > 0), 0.0, (np.cumsum(bwd, axis=1) - bwd) / vs)
    first_fwd = np.where((fwi == MEGATRON)[:, None], fwd, 0.0)
    window = np.where(overlap, bwd, 0.0) + cooldown
    hide = np.where((gather > 0) & overlap, first_fwd, 0.0)
    out = tied + np.maximum(0.0, reduce - window) + np.maximum(0.0, gather - hide)
    every = _EVERY_MICROBATCH[fwi] & (zero == 2)
    if every.any():  # DeepSpeed's ZeRO-2: each earlier micro-batch reduced in its own backward
        out[every] += (m[every] - 1.0) * np.maximum(0.0, reduce[every] - np.where(overlap[every], bwd[every], 0.0))
    dp = dp_ranks(col)
    z3 = (zero == 3) & ((dp > 1) | (col["ep"] > 1))
    if z3.any():  # ZeRO-3: per-block gathers and reduce-scatters against compute, per micro-batch;
        # hybrid sharding's all-reduce of the shards (``reduce``) rides on the last micro-batch's
        # backward, or on every one's where the runtime runs it so (Traits)
        # ZeRO++'s hpZ gathers over the whole group only in the step's first forward (``first``).
        g3, r3, b3, a3 = r["z3_gather_rest"][z3], r["z3_reduce"][z3], bwd[z3], reduce[z3]
        plain = np.maximum(0.0, g3 - fwd[z3]) + np.maximum(0.0, g3 + r3 - b3)
        last = np.maximum(0.0, g3 - fwd[z3]) + np.maximum(0.0, g3 + r3 + a3 - b3)
        first = np.maximum(0.0, r["z3_gather"][z3] - fwd[z3]) - np.maximum(0.0, g3 - fwd[z3])
        every_mb = _HSDP_EVERY_MICROBATCH[fwi[z3]][:, None]
        out[z3] = np.where(every_mb, m[z3] * last, (m[z3] - 1.0) * plain + last) + first
        # FSDP2 under a pipeline: the stage gathered once (the first forward) and reduced once (the
        # last backward), whatever the micro-batches (zero3_fetch.keeps_stage_gathered).
        once = keeps_stage_gathered(col)[z3][:, None]
        out[z3] = np.where(once, np.maximum(0.0, r["z3_gather"][z3] - fwd[z3]) + np.maximum(0.0, r3 + a3 - b3),
                           out[z3])
        # DeepSpeed's fetch hooks run on the host beside the kernels they launch: what outlasts
        # the device's work per micro-batch shows (all of it where the host is the device).
        device = 0.0 if host_is_device else (r["fwd"] + r["bwd"] + r["rc"])[z3]
        out[z3] += m[z3] * np.maximum(0.0, r["z3_host"][z3] - device)
    alone = (dp == 1) & (col["ep"] == 1)
    out[alone] = tied[alone] + reduce[alone]  # nobody to talk to: only the runtime's own copies
    return out


# -- the optimizer ---------------------------------------------------------------------------


def optimizer_seconds(ctx: CostContext, col: dict[str, np.ndarray], dense: np.ndarray, expert: np.ndarray,
                      m: np.ndarray) -> np.ndarray:
    """The optimizer step of ranks holding ``dense`` and ``expert`` parameters ([candidate x
    rank]): fused Adam over HBM, or when offloading DeepSpeedCPUAdam (DeepSpeed engines) or
    Megatron-Core's HybridDeviceOptimizer (megatron). Linear in the parameters (the hybrid
    step is the larger of two terms proportional to them), so the mean rank's time bounds the
    slowest rank's (planner/search/bounds.py)."""
    sharded = (col["zero"] >= 1)[:, None]
    ranks = shard_ranks(col)
    dp = ranks[:, None].astype(float)
    edp = np.maximum(expert_shard_ranks(col), 1)[:, None].astype(float)
    local = dense / np.where(sharded, dp, 1.0) + expert / np.where(sharded, edp, 1.0)
    w = ctx.workload
    step_bytes = eff.SGD_STEP_BYTES if w.optimizer == "sgd" else eff.adam_step_bytes(**w.state_dtypes)
    out = eff.hbm_time(local * step_bytes, ctx.dev)
    flat = (_FLAT_COPIES[col["framework"]] & (col["zero"] >= 1))[:, None]
    if flat.any():  # DeepSpeed's step flattens the rank's gradient partition into a new fp32 tensor
        out = out + np.where(flat, flat_copy_seconds(ctx.dev, 4.0 * local), 0.0)
    # Each host term only where some row offloads that way (most spaces have no parameter offload).
    node = ctx.cluster.profile.node
    host = (ctx.cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.host_Bps)
    off = col["offload"][:, None]
    optimizer = off == OFFLOADS.index("optimizer")
    if optimizer.any():
        cpu_opt = cpu_optimizer_time(local, *host, False, m)
        megatron = (col["framework"] == MEGATRON)[:, None]
        if (megatron & optimizer).any():
            cpu_opt = np.where(megatron, hybrid_optimizer_time(local, *host), cpu_opt)
        out = np.where(optimizer, cpu_opt, out)
    params = off == OFFLOADS.index("optimizer+params")
    if params.any():
        out = np.where(params, cpu_optimizer_time(local, *host, True, m), out)
    return out


def cpu_optimizer_time(params_per_gpu, gpus_per_node: int, cpu_adam_bytes_per_s: float, pcie_bytes_per_s: float,
                       params_on_cpu: bool, microbatches):
    """DeepSpeedCPUAdam over the node's partitions (fp32 params/s of the host), plus copying
    the updated 16-bit weights back over PCIe (the 16-bit gradients go down during backward).
    With parameter offload every micro-batch also fetches its 16-bit weights twice.
    Elementwise over arrays."""
    cpu = 4.0 * params_per_gpu * gpus_per_node / cpu_adam_bytes_per_s
    h2d = 2.0 * params_per_gpu / pcie_bytes_per_s
    fetch = microbatches * 2 * 2.0 * params_per_gpu / pcie_bytes_per_s if params_on_cpu else 0.0
    return cpu + (0.0 if params_on_cpu else h2d) + fetch


def hybrid_optimizer_time(params_per_gpu, gpus_per_node: int, cpu_adam_bytes_per_s: float,
                          pcie_bytes_per_s: float):
    """Megatron-Core's HybridDeviceOptimizer with ``--overlap-cpu-optimizer-d2h-h2d``: one torch
    fused AdamW per parameter tensor, so copying the fp32 gradients down (4 bytes), stepping on
    the host and copying the updated weights up (converted to bf16 on the host first, as torch
    does for a cross-device copy that changes dtype: 2 bytes) run as a pipeline, and the
    slowest of the three sets the time (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py).

    The host rate is the profile's ``cpu_adam_GBps``: both kernels stream ~28-30 bytes per
    parameter, and on this project's 2-core host torch's fused AdamW stepped 1.3-1.45x faster
    than DeepSpeedCPUAdam (benchmarks/bench_cpu_adam.py), so the rate errs slow for it.
    Elementwise over arrays."""
    cpu = 4.0 * params_per_gpu * gpus_per_node / cpu_adam_bytes_per_s
    d2h = 4.0 * params_per_gpu / pcie_bytes_per_s  # the 2-byte upload on the other direction takes less
    return np.maximum(cpu, d2h)
