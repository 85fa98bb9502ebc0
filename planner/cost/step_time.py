"""Step time: per-stage micro-batch times, the pipeline schedule, DP traffic, the optimizer.

Assembly (all functions pure; ``Comms`` carries the collective timings of this placement):

1. per pipeline rank and micro-batch: forward, backward and recompute compute (efficiency.py),
   TP collectives (forward + backward, again for a recomputed forward), EP all-to-alls, and
   the point-to-point sends at its chunk boundaries. Nothing of these overlaps by default:
   Megatron's TP all-reduces sit between dependent GEMMs, DeepSpeed MoE's all-to-alls too,
   and 1F1B's sends are on the critical path (DeepSpeed's PipelineEngine makes two blocking
   transfers per neighbour where Megatron's batched exchange makes one).
2. the pipeline: ``T = m * T_max + (sum_r T_r - T_max) / v`` for m micro-batches over p ranks
   with v chunks each (1F1B: (m + p - 1) T for equal stages; interleaving divides the bubble
   by v, Narayanan et al. 2021 Sec 2.2). Unequal stages run at the pace of the slowest.
3. data parallelism: gradient reduction per rank (all-reduce; ZeRO/distributed optimizer:
   reduce-scatter + all-gather of the updated 16-bit weights; DeepSpeed's ZeRO-1/2
   all-reduce), overlapped with the last micro-batch's backward where the runtime buckets it
   (not in DeepSpeed's PipelineEngine), and with the cool-down of the pipeline (rank r
   finishes r backward chunks before rank 0; not for ranks a tied-weight all-reduce with
   rank 0 holds back). ZeRO-3 all-gathers the
   weights per layer in every forward and backward and reduce-scatters gradients per
   micro-batch, overlapped with compute by prefetching; only the excess shows.
4. the optimizer: fused Adam over the local shard from HBM, or DeepSpeedCPUAdam on the host
   plus the PCIe copies when offloading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from planner.cost import efficiency as eff
from planner.cost.layers import AttnCore, LayerCost

CommFn = Callable[[str, float], float]  # (collective, bytes per rank) -> seconds


@dataclass(frozen=True)
class Comms:
    """Collective timings for one placement: tp, ep, dp (dense grads), edp (experts), pp."""

    tp: CommFn
    ep: CommFn
    dp: CommFn
    edp: CommFn
    pp: Callable[[float], float]  # point-to-point send of bytes between adjacent stages
    # The same send between stages on one node (placement.pipeline_hops), where the pp group
    # spans nodes but not every hop does; None: every hop is priced by ``pp``.
    pp_near: Callable[[float], float] | None = None

    def hop(self, crosses: bool) -> Callable[[float], float]:
        return self.pp if crosses or self.pp_near is None else self.pp_near


@dataclass(frozen=True, slots=True)
class MicroBatchTime:
    """One pipeline rank, one micro-batch (all of its chunks), seconds."""

    fwd: float
    bwd: float
    recompute: float
    tp: float
    ep: float
    pp: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.recompute + self.tp + self.ep + self.pp


# -- compute -------------------------------------------------------------------------------


def attention_time(core: AttnCore, b: int, dev: eff.Device, backward: bool = False) -> float:
    """FlashAttention, or the unfused score and value GEMMs (their softmax is HBM traffic)."""
    if core.seqs == 0 or core.seq == 0:
        return 0.0
    if core.flash:
        return float(eff.flash_time(core.flops * b, core.qk_dim, core.causal, dev, backward))
    batch = core.heads * core.seqs * b
    fwd = float(eff.gemm_time(core.seq, core.seq, core.qk_dim, dev, batch) + eff.gemm_time(core.seq, core.v_dim, core.seq, dev, batch))
    return 2.0 * fwd if backward else fwd


def forward_time(c: LayerCost, b: int, dev: eff.Device) -> float:
    t = sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)
    if c.attn is not None:
        t += attention_time(c.attn, b, dev)
    return t + float(eff.hbm_time(c.hbm_fwd * b, dev))


def backward_time(c: LayerCost, b: int, dev: eff.Device) -> float:
    """Data and weight gradients: two GEMMs of each forward shape, twice the HBM traffic."""
    t = 2.0 * sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)
    if c.attn is not None:
        t += attention_time(c.attn, b, dev, backward=True)
    return t + 2.0 * float(eff.hbm_time(c.hbm_fwd * b, dev))


def recompute_time(c: LayerCost, b: int, dev: eff.Device, mode: str) -> float:
    """Full: the checkpointed layer's forward again. Selective (Korthikanti Sec 4.1): the
    attention core (scores, softmax, dropout, values)."""
    if mode == "full" and c.checkpointed:
        return forward_time(c, b, dev)
    if mode == "selective" and c.attn is not None:
        return attention_time(c.attn, b, dev) + float(eff.hbm_time(c.extra.get("score_hbm", 0.0) * b, dev))
    return 0.0


def tp_time(c: LayerCost, b: int, comms: Comms, recompute: str) -> float:
    ops = c.tp_fwd + c.tp_bwd + (c.tp_fwd if (recompute == "full" and c.checkpointed) else ())
    return sum(comms.tp(op, n * b) for op, n in ops)


def ep_time(c: LayerCost, b: int, comms: Comms, recompute: str) -> float:
    if not c.ep_a2a_count:
        return 0.0
    passes = 2 + (1 if (recompute == "full" and c.checkpointed) else 0)
    return passes * c.ep_a2a_count * comms.ep("alltoall", c.ep_a2a * b)


def rank_time(costs: list[LayerCost], chunks: list[tuple[int, int]], b: int, dev: eff.Device, comms: Comms,
              recompute: str, pp_send_divisor: int, last_block: int,
              boundary_gathers: tuple[int, int] = (0, 0), crossing: tuple[bool, bool] = (True, True),
              transfers: int = 1, meta_bytes: float = 0.0) -> MicroBatchTime:
    """One pipeline rank's work for one micro-batch across its chunks. ``boundary_gathers``:
    TP all-gathers of a whole boundary tensor on the sending and receiving side of each
    boundary (frameworks.pp_boundary_gathers), counted with the pipeline's communication.
    ``crossing``: whether the hop to the next rank and the one from the previous leave the
    node (placement.pipeline_hops). ``transfers``: transfers per neighbour and micro-batch on
    each side of a boundary (frameworks.pp_transfers), each preceded by a ``meta_bytes``
    transfer where the runtime sends one (frameworks.pp_meta_bytes)."""
    f = bw = rc = tp = ep = pp = 0.0
    send, recv = comms.hop(crossing[0]), comms.hop(crossing[1])

    def hop(fn: Callable[[float], float], nbytes: float) -> float:
        return transfers * (fn(nbytes) + (fn(meta_bytes) if meta_bytes else 0.0))
    for first, last in chunks:
        for c in costs[first:last]:
            f += forward_time(c, b, dev)
            bw += backward_time(c, b, dev)
            rc += recompute_time(c, b, dev, recompute)
            tp += tp_time(c, b, comms, recompute)
            ep += ep_time(c, b, comms, recompute)
        # Each chunk boundary costs one transfer per micro-batch on each side: the activation
        # sent forward after the chunk (unless it ends the model) and the gradient sent back
        # before it (unless it starts the model). Megatron pairs a send with the opposite
        # receive (send_forward_recv_backward), so a pair costs one transfer on a full-duplex
        # link; DeepSpeed's PipelineEngine sends and receives one after the other (transfers 2).
        if last < last_block:
            pp += hop(send, costs[last - 1].pp_bytes * b / pp_send_divisor)
            if boundary_gathers[0]:
                pp += boundary_gathers[0] * comms.tp("allgather", costs[last - 1].pp_bytes * b)
        if first > 0:
            pp += hop(recv, costs[first - 1].pp_bytes * b / pp_send_divisor)
            if boundary_gathers[1]:
                pp += boundary_gathers[1] * comms.tp("allgather", costs[first - 1].pp_bytes * b)
    return MicroBatchTime(f, bw, rc, tp, ep, pp)


# -- the step ------------------------------------------------------------------------------


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

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_bubble + self.pp_comm + self.dp_comm
                + self.ep_comm + self.optimizer)


def pipeline(ranks: list[MicroBatchTime], microbatches: int, virtual: int) -> tuple[int, float]:
    """(bottleneck rank, bubble seconds) of 1F1B / interleaved 1F1B."""
    totals = [r.total for r in ranks]
    worst = max(range(len(ranks)), key=totals.__getitem__)
    bubble = (sum(totals) - totals[worst]) / virtual
    return worst, bubble


def dp_exposed(reduce_s: float, gather_s: float, overlap: bool, last_bwd_s: float, first_fwd_s: float,
               cooldown_s: float) -> float:
    """Gradient reduction (and the ZeRO/distributed-optimizer weight all-gather) left exposed.

    Bucketed reduction starts during the last micro-batch's backward and may also run during
    the pipeline cool-down this rank does not take part in; the all-gather of updated weights
    overlaps the next step's first forward (Megatron --overlap-param-gather, DeepSpeed's
    allgather after step is not overlapped).
    """
    window = (last_bwd_s if overlap else 0.0) + cooldown_s
    return max(0.0, reduce_s - window) + max(0.0, gather_s - (first_fwd_s if overlap and gather_s else 0.0))


def earlier_microbatch_reductions(reduce_s: float, overlap: bool, bwd_s: float, microbatches: int) -> float:
    """What DeepSpeed's ZeRO-2 leaves exposed by reducing the gradients of each of the first
    m - 1 micro-batches in that micro-batch's own backward (Traits.zero2_reduces_every_microbatch;
    the last one is ``dp_exposed``'s)."""
    return (microbatches - 1) * max(0.0, reduce_s - (bwd_s if overlap else 0.0))


def tied_allreduce_time(p2p: Callable[[float], float], nbytes: float) -> float:
    """All-reduce of a tied weight's gradient (``nbytes`` per GPU) between the two pipeline
    ranks holding its copies: a two-rank ring sends half the tensor each way in its
    reduce-scatter and again in its all-gather, ``nbytes`` per direction in all, as one
    point-to-point transfer of ``nbytes`` on a full-duplex link does."""
    return p2p(nbytes) if nbytes else 0.0


def zero3_exposed(gather_s: float, reduce_s: float, fwd_s: float, bwd_s: float, microbatches: int) -> float:
    """ZeRO-3 per micro-batch: weights gathered for the forward and again for the backward,
    gradients reduce-scattered during it; prefetching hides what fits under compute."""
    per_mb = max(0.0, gather_s - fwd_s) + max(0.0, gather_s + reduce_s - bwd_s)
    return microbatches * per_mb


def gpu_optimizer_time(local_params: float, dev: eff.Device, sgd: bool = False) -> float:
    return float(eff.hbm_time(local_params * (eff.SGD_STEP_BYTES if sgd else eff.ADAM_STEP_BYTES), dev))


def cpu_optimizer_time(params_per_gpu: float, gpus_per_node: int, cpu_adam_bytes_per_s: float,
                       pcie_bytes_per_s: float, params_on_cpu: bool, microbatches: int) -> float:
    """DeepSpeedCPUAdam over the node's partitions (fp32 params/s of the host), plus copying
    the updated 16-bit weights back over PCIe (the 16-bit gradients go down during backward).
    With parameter offload every micro-batch also fetches its 16-bit weights twice."""
    cpu = 4.0 * params_per_gpu * gpus_per_node / cpu_adam_bytes_per_s
    h2d = 2.0 * params_per_gpu / pcie_bytes_per_s
    fetch = microbatches * 2 * 2.0 * params_per_gpu / pcie_bytes_per_s if params_on_cpu else 0.0
    return cpu + (0.0 if params_on_cpu else h2d) + fetch


def hybrid_optimizer_time(params_per_gpu: float, gpus_per_node: int, cpu_adam_bytes_per_s: float,
                          pcie_bytes_per_s: float) -> np.ndarray | float:
    """Megatron-Core's HybridDeviceOptimizer with ``--overlap-cpu-optimizer-d2h-h2d``: one torch
    fused AdamW per parameter tensor, so copying the fp32 gradients down (4 bytes), stepping on
    the host and copying the updated weights up (converted to bf16 on the host first, as torch
    does for a cross-device copy that changes dtype: 2 bytes) run as a pipeline, and the
    slowest of the three sets the time (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py).

    The host rate is the profile's ``cpu_adam_GBps``: both kernels stream ~28-30 bytes per
    parameter, and on this project's 2-core host torch's fused AdamW stepped 1.3-1.45x faster
    than DeepSpeedCPUAdam (benchmarks/bench_cpu_adam.py), so the rate errs slow for it.
    Works elementwise on arrays."""
    cpu = 4.0 * params_per_gpu * gpus_per_node / cpu_adam_bytes_per_s
    d2h = 4.0 * params_per_gpu / pcie_bytes_per_s  # the 2-byte upload on the other direction takes less
    return np.maximum(cpu, d2h)
