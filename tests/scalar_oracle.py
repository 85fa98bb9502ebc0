"""The cost model as a scalar walk, one block and one pipeline rank at a time: an oracle for tests.

planner/cost is array-first: every formula is written once over numpy arrays of candidates,
and ``estimate`` is that model applied to one. This module is the scalar walk the model was
before that (per GEMM, per block, per rank, per collective call), kept frozen under tests/ so
the array model (``estimate`` and the search alike) is checked against an independent
computation of the same physics: tests/test_suggest.py, tests/test_cost_worked_cases.py and
others compare the two to 1e-9. A term added to planner/cost is added here only where a test
checks it against this walk.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from planner.cost import dualpipe
from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost import pipeline_sends as ps
from planner.cost.candidates import columns_of
from planner.cost.efficiency import Device, device
from planner.cost.estimate import check_plan
from planner.cost.goodput import plan_checkpoint
from planner.cost.layers import AttnCore, LayerCost, layer_costs
from planner.cost.memory import ModelStates, bytes_per_param, inflight_microbatches
from planner.cost.parallel import ParallelConfig, Workload
from planner.cost.partition import Partition, check_partition, default_partition
from planner.cost.plan import Plan, StagePlan
from planner.cost.step_time import MicroBatchTime, StepTime, cpu_optimizer_time, hybrid_optimizer_time
from planner.hardware.cluster import Cluster
from planner.model.spec import DecoderBlock, EmbeddingBlock, LMHeadBlock, ModelSpec, MTPBlock

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
    # The experts' TP x EP group (the allgather dispatcher's); None: the EP group's own.
    tp_ep: CommFn | None = None
    # Context parallelism: the ring's p2p and its size, the all-to-all's (context_parallel.py).
    cp_ring: Callable[[float], float] = lambda nbytes: 0.0
    cp_ring_size: int = 1
    cp_a2a: Callable[[float], float] = lambda nbytes: 0.0

    def hop(self, crosses: bool) -> Callable[[float], float]:
        return self.pp if crosses or self.pp_near is None else self.pp_near


# -- compute -------------------------------------------------------------------------------


def attention_time(core: AttnCore, b: int, dev: eff.Device, backward: bool = False) -> float:
    """FlashAttention, or the unfused score and value GEMMs (their softmax is HBM traffic)."""
    if core.seqs == 0 or core.seq == 0:
        return 0.0
    if core.flash:
        return float(eff.flash_time(core.flops * b, core.qk_dim, core.causal, dev, backward))
    batch = core.heads * core.seqs * b
    fwd = float(eff.gemm_time(core.seq, core.seq, core.qk_dim, dev, batch)
                + eff.gemm_time(core.seq, core.v_dim, core.seq, dev, batch))
    return 2.0 * fwd if backward else fwd


def forward_time(c: LayerCost, b: int, dev: eff.Device, attn_dev: eff.Device | None = None) -> float:
    """``attn_dev``: the device attention runs on (TE's attention: no FlashAttention-2 ceiling)."""
    t = sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)
    if c.attn is not None:
        t += attention_time(c.attn, b, attn_dev or dev)
    return t + float(eff.hbm_time((c.hbm_fwd + c.extra.get("eager_fwd", 0.0)) * b, dev))


def backward_time(c: LayerCost, b: int, dev: eff.Device, attn_dev: eff.Device | None = None) -> float:
    """Data and weight gradients: two GEMMs of each forward shape, twice the HBM traffic."""
    t = 2.0 * sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)
    if c.attn is not None:
        t += attention_time(c.attn, b, attn_dev or dev, backward=True)
    return t + float(eff.hbm_time((2.0 * c.hbm_fwd + c.extra.get("eager_bwd", 0.0)) * b, dev))


def recompute_time(c: LayerCost, b: int, dev: eff.Device, mode: str, attn_dev: eff.Device | None = None) -> float:
    """Full: the checkpointed layer's forward again. Selective (Korthikanti Sec 4.1): the
    attention core (scores, softmax, dropout, values)."""
    if mode == "full" and c.checkpointed:
        return forward_time(c, b, dev, attn_dev)
    if mode == "op" and c.checkpointed:  # torchtitan's per-op SAC: all but SDPA and the kept matmuls
        if not c.extra.get("op_sac"):
            return forward_time(c, b, dev, attn_dev)
        kept = sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.sac_saved)
        return forward_time(c, b, dev, attn_dev) - attention_time(c.attn, b, attn_dev or dev) - kept
    if mode == "selective":  # the attention core if its modules name it, and the other modules' reruns
        t = sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.rerun.gemms)
        t += float(eff.hbm_time(c.rerun.traffic * b, dev))
        if c.attn is not None and c.extra.get("sel_attn", 1.0):
            score = float(eff.hbm_time(c.extra.get("score_hbm", 0.0) * b, dev))
            t += attention_time(c.attn, b, attn_dev or dev) + score
        return t
    return 0.0


def tp_time(c: LayerCost, b: int, comms: Comms, recompute: str, overlap_tp: int = 0,
            dev: eff.Device | None = None, async_bwd: bool = False) -> float:
    """The block's TP seconds; ``overlap_tp`` (the TP degree, 0: none): overlapped with the
    block's GEMMs, forward, twice backward, again when recomputed, one of tp chunks exposed;
    ``async_bwd``: else the backward's all-reduces and reduce-scatters (the column-parallel input
    gradients) hidden up to the block's weight-gradient GEMMs."""
    again = recompute in ("full", "op") and c.checkpointed
    rerun = c.tp_fwd
    if recompute == "op" and c.extra.get("op_sac"):  # the reduce-scatters' outputs are kept
        rerun = tuple(op for op in c.tp_fwd if op[0] == "allgather")
    ops = c.tp_fwd + c.tp_bwd + (rerun if again else ()) + (c.rerun.tp if recompute == "selective" else ())
    t = sum(comms.tp(op, n * b) for op, n in ops)
    if overlap_tp and t > 0:
        assert dev is not None
        gemm = sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)
        t = max(t - (3 + again) * gemm, t / overlap_tp)
    elif async_bwd and t > 0:
        assert dev is not None
        reduced = sum(comms.tp(op, n * b) for op, n in c.tp_bwd if op != "allgather")
        t -= min(reduced, gemm_seconds(c, b, dev))
    return t


def cp_time(c: LayerCost, b: int, comms: Comms, recompute: str, attn_dev: eff.Device) -> float:
    """Context-parallel exchange of one attention: each of the ring's n - 1 sending steps hides
    under 1/n of the attention (TE's kernels), backward passes K/V and their gradients; the
    all-to-alls of Q, K, V and the output show whole; a recomputed attention exchanges again."""
    if "cp_kv" not in c.extra or c.attn is None:
        return 0.0
    n = comms.cp_ring_size
    fa, ba = attention_time(c.attn, b, attn_dev), attention_time(c.attn, b, attn_dev, backward=True)
    a2a = comms.cp_a2a(c.extra["cp_qkv"] * b) + comms.cp_a2a(c.extra["cp_o"] * b)
    f = a2a + ((n - 1) * max(0.0, comms.cp_ring(c.extra["cp_kv"] * b) - fa / n) if n > 1 else 0.0)
    bw = a2a + ((n - 1) * max(0.0, comms.cp_ring(2 * c.extra["cp_kv"] * b) - ba / n) if n > 1 else 0.0)
    again = ((recompute == "full" and c.checkpointed) or (recompute == "selective" and c.extra.get("sel_attn", 1.0))
             or (recompute == "op" and c.checkpointed and not c.extra.get("op_sac")))
    return f + bw + (f if again else 0.0)


def ep_time(c: LayerCost, b: int, comms: Comms, recompute: str) -> float:
    if not c.ep_a2a_count:
        return 0.0
    passes = 2 + (1 if (recompute in ("full", "op") and c.checkpointed) else 0)
    passes += c.rerun.a2a if recompute == "selective" else 0  # "moe": the MoE layer's forward again
    if "ep_gather" in c.extra:  # the allgather dispatcher: gather and reduce-scatter over the experts' TP x EP
        group = comms.tp_ep or comms.ep
        return passes * (group("allgather", c.ep_a2a * b) + group("reducescatter", c.ep_a2a * b))
    return passes * c.ep_a2a_count * comms.ep("alltoall", c.ep_a2a * b)


def rank_time(costs: list[LayerCost], chunks: list[tuple[int, int]], b: int, dev: eff.Device, comms: Comms,
              recompute: str, pp_send_divisor: int, last_block: int,
              boundary_gathers: tuple[int, int] = (0, 0), crossing: tuple[bool, bool] = (True, True),
              transfers: int = 1, meta_bytes: float = 0.0, overlap_tp: int = 0,
              attn_dev: eff.Device | None = None, ep_share: float = 0.0,
              chunk_hops: list[tuple[bool | None, bool | None]] | None = None,
              async_bwd: bool = False) -> MicroBatchTime:
    """One pipeline rank's work for one micro-batch across its chunks. ``boundary_gathers``:
    TP all-gathers of a whole boundary tensor on the sending and receiving side of each
    boundary (pipeline_sends.pp_boundary_gathers), counted with the pipeline's communication.
    ``crossing``: whether the hop to the next rank and the one from the previous leave the
    node (placement.pipeline_hops). ``transfers``: transfers per neighbour and micro-batch on
    each side of a boundary (pipeline_sends.pp_transfers), each preceded by a ``meta_bytes``
    transfer where the runtime sends one (pipeline_sends.pp_meta_bytes). ``ep_share``: the share
    of the rank's passes whose all-to-alls hide under another micro-batch's compute (as TE runs
    it) where Megatron's EP overlap applies (0: none). ``chunk_hops``: per chunk, whether its send
    and its receive leave the node, None where that transfer stays on the rank (DualPipeV's turn);
    default ``crossing`` for every chunk."""
    f = bw = rc = tp = ep = pp = cp = 0.0
    cp_dev = dataclasses.replace(dev, flash=None)

    def hop(fn: Callable[[float], float], nbytes: float) -> float:
        return transfers * (fn(nbytes) + (fn(meta_bytes) if meta_bytes else 0.0))
    for k, (first, last) in enumerate(chunks):
        out_hop, in_hop = chunk_hops[k] if chunk_hops else crossing
        send, recv = comms.hop(bool(out_hop)), comms.hop(bool(in_hop))
        for c in costs[first:last]:
            f += forward_time(c, b, dev, attn_dev)
            bw += backward_time(c, b, dev, attn_dev)
            rc += recompute_time(c, b, dev, recompute, attn_dev)
            tp += tp_time(c, b, comms, recompute, overlap_tp, dev, async_bwd)
            e = ep_time(c, b, comms, recompute)
            if ep_share and recompute != "full":
                hidden = min(e, forward_time(c, b, dev, cp_dev) + backward_time(c, b, dev, cp_dev))
                e -= ep_share * hidden
            ep += e
            cp += cp_time(c, b, comms, recompute, cp_dev)
        # Each chunk boundary costs one transfer per micro-batch on each side: the activation
        # sent forward after the chunk (unless it ends the model) and the gradient sent back
        # before it (unless it starts the model). Megatron pairs a send with the opposite
        # receive (send_forward_recv_backward), so a pair costs one transfer on a full-duplex
        # link; DeepSpeed's PipelineEngine sends and receives one after the other (transfers 2).
        if last < last_block and out_hop is not None:
            pp += hop(send, costs[last - 1].pp_bytes * b / pp_send_divisor)
            if boundary_gathers[0]:
                pp += boundary_gathers[0] * comms.tp("allgather", costs[last - 1].pp_bytes * b)
        if first > 0 and in_hop is not None:
            pp += hop(recv, costs[first - 1].pp_bytes * b / pp_send_divisor)
            if boundary_gathers[1]:
                pp += boundary_gathers[1] * comms.tp("allgather", costs[first - 1].pp_bytes * b)
    return MicroBatchTime(f, bw, rc, tp, ep, pp, cp)


# -- the step ------------------------------------------------------------------------------


def pipeline(ranks: list[MicroBatchTime], microbatches: int, virtual: int,
             wgrad: list[float] | None = None) -> tuple[int, float]:
    """(bottleneck rank, bubble seconds) of 1F1B / interleaved 1F1B, or with ``wgrad`` (each rank's
    weight-gradient GEMM seconds) DualPipeV's: per other rank and chunk (half the rank's), DeepSeek's
    F&B + B - 3W with F&B = F + B, at least the warm-up's 2F."""
    totals = [r.total for r in ranks]
    worst = max(range(len(ranks)), key=totals.__getitem__)
    if wgrad is None:
        return worst, (sum(totals) - totals[worst]) / virtual
    bubble = 0.0
    for r, (t, w) in enumerate(zip(ranks, wgrad)):
        comm = (t.tp + t.ep + t.pp + t.cp) / 2
        f, b = (t.fwd + comm) / 2, (t.bwd + t.recompute + comm) / 2
        bubble += 0.0 if r == worst else max(2 * f, f + 2 * b - 3 * w / 2)
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


# -- memory (scalar) --


def model_states(dense_params: float, expert_params: float, *, framework: str, zero: int, offload: str,
                 dp: int, edp: int, precision: str = "bf16", moments: int = 2,
                 live_layer_params: float = 0.0) -> ModelStates:
    """Model states on one GPU: dense parameters shard over dp, routed experts over their
    ``edp`` replicas (dp / ep, or tp x dp / ep with the experts folded out of TP).

    ``live_layer_params``: with ZeRO-3 the largest layer is gathered whole (weights and
    gradients, 4 bytes per parameter) while it runs, as in DeepSpeed's estimator.
    """
    wd, gd, od, cd = bytes_per_param(framework, zero, offload, dp, precision, moments)
    we, ge, oe, ce = bytes_per_param(framework, zero, offload, max(edp, 1), precision, moments)
    weights = wd * dense_params + we * expert_params
    grads = gd * dense_params + ge * expert_params
    if zero == 3:  # Megatron-FSDP double-buffers: the unit computing and the one prefetched
        units = 2 if framework == "megatron" else 1
        weights += 2 * units * live_layer_params
        grads += 2 * units * live_layer_params
    return ModelStates(weights, grads, od * dense_params + oe * expert_params, cd * dense_params + ce * expert_params)


def buffer_bytes(framework: str, zero: int, stage_params: float, groups: int, pp_buffer: float = 0.0) -> float:
    """Communication buffers: DeepSpeed's ZeRO buckets, ZeRO-3 prefetch, NCCL, PP receive buffers."""
    t = fw.traits(framework)
    out = mem.NCCL_BYTES_PER_GROUP * groups + pp_buffer
    if t.zero_buckets and zero in (1, 2):
        buckets = min(fw.REDUCE_BUCKET_SIZE, stage_params) + min(fw.ALLGATHER_BUCKET_SIZE, stage_params)
        out += fw.OVERLAP_COMM_FACTOR * 2 * buckets  # 16-bit elements
    elif t.zero_buckets and zero == 3:
        out += 2 * min(fw.STAGE3_PREFETCH_BUCKET_SIZE, stage_params) + 2 * min(fw.REDUCE_BUCKET_SIZE, stage_params)
    return out


def activation_bytes(stored_per_mb: float, live_extra_per_mb: float, inflight: float) -> float:
    """Activations at the peak: in-flight micro-batches plus one layer being recomputed."""
    return stored_per_mb * inflight + live_extra_per_mb


def overhead_bytes(allocated: float) -> float:
    return mem.CUDA_CONTEXT_BYTES + mem.FRAGMENTATION * allocated


# -- the walk --


def oracle_estimate(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
                    partition: Partition | None = None, pp_send: str | None = None,
                    auto_offload: bool = False, tp_backward_overlap: bool = True) -> Plan:
    """Memory per GPU and step time of ``cfg`` training ``model`` on ``cluster``.

    ``pp_send`` overrides how the runtime sends across pipeline stages (pipeline_sends.PP_SENDS;
    the Table 1 benchmark models 2021 Megatron-LM's scatter/gather with it). ``auto_offload``: a
    plan out of GPU memory offloads the activations of the fewest decoder layers that make it fit
    (the search's activation_offload.AUTO), where up to all but one layer would do."""
    plan = _walk(model, cluster, workload, cfg, partition, pp_send, tp_backward_overlap)
    if not auto_offload or plan.memory.peak <= plan.capacity_bytes:
        return plan
    need = math.ceil((plan.memory.peak - plan.capacity_bytes) / (mem.GROWTH * _layer_bytes(model, workload, cfg))
                     - 1e-9)
    if not 0 < need <= model.num_layers - 1:
        return plan
    return _walk(model, cluster, workload, cfg.model_copy(update={"activation_offload": need}), partition, pp_send,
                 tp_backward_overlap)


def _layer_bytes(model: ModelSpec, workload: Workload, cfg: ParallelConfig) -> float:
    """One decoder layer's stored activations per micro-batch, the mean over the model's."""
    model = workload.trained(model)
    costs = layer_costs(model, workload.resolved(model), cfg.tp, cfg.sequence_parallel, cfg.ep, cp=cfg.cp,
                        etp=cfg.etp, vocab_parallel=fw.traits(cfg.framework).vocab_parallel)
    decoders = [c for c, b in zip(costs, model.blocks) if isinstance(b, DecoderBlock)]
    return sum(c.act[cfg.recompute] for c in decoders) * cfg.micro_batch / len(decoders)


def offload_exposed(k: int, layers: int, layer_bytes: float, fwd: float, bwd: float, host_Bps: float) -> float:
    """Activation offload's exposed copies per micro-batch, one case at a time (TE's schedule:
    planner/cost/activation_offload.py's docstring)."""
    if k == 0:
        return 0.0
    copies = k * layer_bytes / host_Bps
    if layers - k < 2:
        return 2 * copies
    return max(0.0, copies - fwd * (layers - 1) / layers) + max(0.0, copies - bwd * (layers - 2) / layers)


def _walk(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
          partition: Partition | None = None, pp_send: str | None = None, tp_backward_overlap: bool = True) -> Plan:
    """``oracle_estimate`` of ``cfg`` as it is."""
    model, workload = workload.trained(model), workload.resolved(model)  # its multi-token-prediction depths
    check_plan(model, cluster, workload, cfg)
    stages = cfg.pp * cfg.virtual_stages
    parts = (default_partition(model, stages) if partition is None
             else check_partition(partition, len(model.blocks), stages))
    costs = layer_costs(model, workload, cfg.tp, cfg.sequence_parallel, cfg.ep, cp=cfg.cp, etp=cfg.etp,
                        vocab_parallel=fw.traits(cfg.framework).vocab_parallel)
    dev = device(cluster.profile, "bf16" if workload.precision == "bf16" else workload.precision)
    comms = build_comms(cluster, cfg)
    traits = fw.traits(cfg.framework)
    dual = workload.pp_schedule == "dualpipev" and cfg.pp > 1
    # rank r runs virtual stages r, r + pp, ...; DualPipeV's rank r chunks r and 2 pp - 1 - r
    chunks = [[parts[r], parts[2 * cfg.pp - 1 - r]] if dual else parts[r::cfg.pp] for r in range(cfg.pp)]
    b, m = cfg.micro_batch, cfg.grad_accum
    send = pp_send or traits.pp_send
    if send not in ps.PP_SENDS:
        raise ValueError(f"pp_send {send!r}: one of {', '.join(ps.PP_SENDS)}")
    send_div = ps.pp_send_divisor(send, cfg.tp, cfg.sequence_parallel)
    gathers = ps.pp_boundary_gathers(send, cfg.tp)
    transfers, meta = ps.pp_transfers(traits), ps.pp_meta_bytes(send, cfg.tp)
    crosses = pp_hops(cluster, cfg)
    overlap = (workload.tp_comm_overlap and traits.tp_comm_overlap and cfg.sequence_parallel
               and 1 < cfg.tp <= cluster.gpus_per_node)
    attn_dev = dataclasses.replace(dev, flash=None) if workload.te_attention and traits.te_attention else dev
    times = [rank_time(costs, ch, b, dev, comms, cfg.recompute, send_div, len(model.blocks), gathers,
                       (crosses[r], crosses[r - 1]), transfers, meta, cfg.tp if overlap else 0, attn_dev,
                       _ep_share(cfg, workload, r), _v_hops(crosses, r) if dual else None,
                       traits.tp_backward_overlap and cfg.tp > 1 and not overlap and tp_backward_overlap)
             for r, ch in enumerate(chunks)]
    wgrad = [sum(gemm_seconds(c, b, dev) for a, e in ch for c in costs[a:e]) for ch in chunks] if dual else None
    worst, bubble = pipeline(times, m, cfg.virtual_stages, wgrad)
    tied_copy = _tied_embedding_copy(model, chunks, cfg.tp)
    tied_ranks = _tied_group(model, chunks, cfg.tp)

    stage_plans, dp_exposed, opt_time = [], [], []
    for r, ch in enumerate(chunks):
        blocks = [c for a, e in ch for c in costs[a:e]]
        dense = sum(c.params_rank for c in blocks) + tied_copy[r]
        expert = sum(c.expert_params_rank for c in blocks)
        stage_plans.append(_stage_plan(model, r, ch, blocks, dense, expert, cfg, workload, cluster, times[r]))
        # After rank r's last backward, the gradient still runs back through ranks r-1 .. 0
        # (their last chunk, 1/v of a micro-batch's backward each): that cool-down hides rank
        # r's reduction.
        cooldown = sum(t.bwd + t.recompute for t in times[:r]) / cfg.virtual_stages
        tied = 0.0
        if traits.pipe_engine and r in tied_ranks:
            # DeepSpeed's ReduceTiedGrads: the two copies' gradients all-reduced before ReduceGrads,
            # which waits for rank 0's last backward: no cool-down left to hide this rank's reduction.
            tied_bytes = _grad_comm_bytes(cfg, workload, traits) * tied_ranks[r]
            tied, cooldown = tied_allreduce_time(comms.pp, tied_bytes), 0.0
        dp_exposed.append(tied + _dp_time(dense, expert, cfg, workload, traits, comms, times[r], cooldown, blocks,
                                          dev))
        opt_time.append(_optimizer_time(dense, expert, cfg, workload, cluster, dev))

    t = times[worst]
    k = cfg.activation_offload
    offload = m * offload_exposed(k, model.num_layers, _layer_bytes(model, workload, cfg) if k else 0.0,
                                  times[0].fwd, times[0].bwd,
                                  cluster.profile.node.pcie_GBps * 1e9 / cluster.profile.node.gpus_per_host_link)
    time = StepTime(compute=m * (t.fwd + t.bwd), recompute=m * t.recompute, tp_comm=m * t.tp, pp_bubble=bubble,
                       pp_comm=m * t.pp, dp_comm=max(dp_exposed), ep_comm=m * t.ep, optimizer=max(opt_time),
                       cp_comm=m * t.cp, act_offload=offload)
    return Plan(model=model.name, hardware=cluster.profile.name, nodes=cluster.nodes,
                gpus_per_node=cluster.gpus_per_node, cfg=cfg, workload=workload, partition=parts, stages=stage_plans,
                time=time,
                capacity_bytes=cluster.profile.gpu.memory_bytes,
                host_capacity_bytes=mem.host_capacity_bytes(cluster.profile.node.host_memory_GiB),
                model_flops_per_step=model_flops(model, workload),
                peak_flops=dev.peak_flops,
                # the production checkpoint model: the goodput formulas have their own tests
                # (tests/test_goodput.py); here it lets the exhaustive search rank by goodput
                checkpoint=plan_checkpoint(columns_of([cfg]), time.total, model, workload, cluster.profile,
                                           cluster.nodes))


def _ep_share(cfg: ParallelConfig, workload: Workload, rank: int) -> float:
    """The share of rank ``rank``'s passes Megatron's combined 1F1B merges: 0 off Megatron, without
    EP, or in a pipeline without virtual stages; (m - 1)/m without a pipeline; in an interleaved one,
    all but 2(pp - rank - 1) + (v - 1)pp warm-up passes of m x v. On torchtitan under DualPipeV, its
    overlapped forward-backward pairs among the rank's 2m chunk passes, counted in its op list."""
    m, v, pp = cfg.grad_accum, cfg.virtual_stages, cfg.pp
    if (workload.ep_comm_overlap and cfg.framework == "torchtitan" and cfg.ep > 1 and pp > 1
            and workload.pp_schedule == "dualpipev"):
        return sum(op[0] == "FB" for op in dualpipe.rank_ops(rank, pp, m)) / (2 * m)
    if not (workload.ep_comm_overlap and cfg.framework == "megatron" and cfg.ep > 1):
        return 0.0
    if pp == 1:
        return (m - 1) / m
    if v == 1:
        return 0.0
    return max(0.0, 1 - min(2 * (pp - rank - 1) + (v - 1) * pp, m * v) / (m * v))


def _v_hops(crosses: tuple[bool, ...], r: int) -> list[tuple[bool | None, bool | None]]:
    """DualPipeV's rank r: its first chunk sends over hop r (none from the last rank, where the V
    turns) and receives over hop r - 1; its second sends over hop r - 1 and receives over hop r
    (none on the last rank)."""
    last = r == len(crosses) - 1
    return [(None if last else crosses[r], crosses[r - 1]), (crosses[r - 1], None if last else crosses[r])]


def gemm_seconds(c: LayerCost, b: int, dev: eff.Device) -> float:
    """The block's forward GEMMs: its weight gradients' shapes."""
    return sum(float(eff.gemm_time(g.tokens * b, g.n, g.k, dev, g.batch)) for g in c.gemms)


def v_held(rank: int, pp: int, m: int) -> tuple[int, int]:
    """DualPipeV's held (first, second) chunk activations at rank ``rank``'s peak, walking its ops:
    a forward holds one, a whole backward or a weight gradient frees it."""
    held, peak = [0, 0], (0, 0)
    for op in dualpipe.rank_ops(rank, pp, m):
        if op[0] == "FB":
            held[op[1][0]] += 1
            held[op[2][0]] -= 1
        elif op[0] in ("F", "B", "W"):
            held[op[1]] += 1 if op[0] == "F" else -1
        if sum(held) > sum(peak):
            peak = (held[0], held[1])
    return peak


def model_flops(model: ModelSpec, workload: Workload) -> float:
    """Model FLOPs of one step: 3x the forward (backward = 2x), no recomputation; attention
    at full s^2 (the Megatron/Korthikanti convention)."""
    costs = layer_costs(model, workload)
    return 3.0 * sum(c.fwd_flops for c in costs) * workload.global_batch


def _tied_owners(model: ModelSpec, chunks: list[list[tuple[int, int]]], tp: int) -> tuple[int, int, float] | None:
    """(rank of the embedding, rank of the tied LM head or MTP depth, which looks tokens up in the
    embedding, the copy's parameters per GPU after TP) when it sits on another pipeline rank
    than the embedding, else None."""
    heads = [i for i, blk in enumerate(model.blocks)
             if (isinstance(blk, LMHeadBlock) and blk.tied) or isinstance(blk, MTPBlock)]
    embeds = [i for i, blk in enumerate(model.blocks) if isinstance(blk, EmbeddingBlock)]
    if not heads or not embeds:
        return None
    owner = {i: r for r, ch in enumerate(chunks) for a, e in ch for i in range(a, e)}
    if owner[heads[0]] == owner[embeds[0]]:
        return None
    head = model.blocks[heads[0]]
    return owner[embeds[0]], owner[heads[0]], head.vocab * head.hidden / tp


def _tied_embedding_copy(model: ModelSpec, chunks: list[list[tuple[int, int]]], tp: int) -> list[float]:
    """A tied LM head on another pipeline rank keeps its own copy of the word embeddings
    (Megatron allocates it on the last stage and all-reduces the two gradients)."""
    out = [0.0] * len(chunks)
    tied = _tied_owners(model, chunks, tp)
    if tied is not None:
        out[tied[1]] = tied[2]
    return out


def _tied_group(model: ModelSpec, chunks: list[list[tuple[int, int]]], tp: int) -> dict[int, float]:
    """The pipeline ranks holding the two copies of a tied embedding when they differ (the
    embedding's and the LM head's), each with the copy's parameters per GPU (after TP)."""
    tied = _tied_owners(model, chunks, tp)
    return {} if tied is None else {tied[0]: tied[2], tied[1]: tied[2]}


def _stage_plan(model: ModelSpec, r: int, ch, blocks: list[LayerCost], dense: float, expert: float,
                cfg: ParallelConfig, w: Workload, cluster: Cluster, t: MicroBatchTime) -> StagePlan:
    b = cfg.micro_batch
    largest = max((c.params_rank + c.expert_params_rank for c in blocks), default=0.0)
    states = model_states(dense, expert, framework=cfg.framework, zero=cfg.zero_stage, offload=cfg.offload,
                              dp=cfg.dp_ranks, edp=_edp(cfg), precision=w.precision, moments=w.optimizer_moments,
                              live_layer_params=largest)
    stored = sum(c.act[cfg.recompute] for c in blocks) * b
    live = (max((c.act_live for c in blocks if c.checkpointed), default=0.0) * b
            if cfg.recompute in ("full", "op") else 0.0)
    inflight = inflight_microbatches(r, cfg.pp, cfg.virtual_stages, cfg.grad_accum)
    if w.pp_schedule == "dualpipev" and cfg.pp > 1:  # held chunks, in units of the whole stage
        first, second = v_held(r, cfg.pp, cfg.grad_accum)
        one = sum(cc.act[cfg.recompute] for cc in blocks[:ch[0][1] - ch[0][0]]) * b  # the first chunk's
        inflight = (first * one + second * (stored - one)) / stored if stored > 0 else (first + second) / 2
    if cfg.pp == 1 and cfg.recompute != "full" and _ep_share(cfg, w, r) > 0:
        inflight = 2.0  # the next forward runs before this backward frees its activations
    acts = activation_bytes(stored, live, inflight)
    decoders = [c for i, c in zip((i for a, e in ch for i in range(a, e)), blocks)
                if isinstance(model.blocks[i], DecoderBlock)]
    moved = cfg.activation_offload * sum(c.act[cfg.recompute] for c in decoders) * b / max(len(decoders), 1)
    acts -= moved  # the offloaded layers' activations, in host memory instead
    groups = sum(1 for d in (cfg.tp, cfg.pp, cfg.dp, cfg.ep, cfg.cp) if d > 1)
    pp_buffer = 2 * max(c.pp_bytes for c in blocks) * b if cfg.pp > 1 else 0.0
    buffers = buffer_bytes(cfg.framework, cfg.zero_stage, dense + expert, groups, pp_buffer)
    allocated = states.gpu + acts + buffers
    breakdown = mem.MemoryBreakdown(states.weights, states.grads, states.optimizer, acts, buffers,
                                    overhead_bytes(allocated),
                                    mem.cpu_bytes_per_node(states.cpu + moved, cluster.gpus_per_node))
    kinds = Counter(model.blocks[i].kind for a, e in ch for i in range(a, e))
    decoders = sum(1 for a, e in ch for i in range(a, e) if isinstance(model.blocks[i], DecoderBlock))
    return StagePlan(r, list(ch), decoders, dict(kinds), breakdown, t, inflight)


def _grad_comm_bytes(cfg: ParallelConfig, w: Workload, traits: fw.Traits) -> int:
    if w.precision == "fp32":
        return 4
    # Megatron's fp32 main_grad, except under Megatron-FSDP (its main-grads dtype "auto": bf16)
    fsdp = cfg.framework == "megatron" and cfg.zero_stage == 3
    return 4 if traits.fp32_grad_buffer and w.precision == "bf16" and not fsdp else 2


def _flat_copies(grad_bytes: float, dp: int, zero: int, dev: Device) -> float:
    """DeepSpeed's copies around one ZeRO 0-2 reduction: into a new flat tensor and back (all of
    it under ZeRO-0, the owned 1/dp under ZeRO-1/2), under ZeRO-2 also into the bucket and the
    owned share into the partition buffer; read plus write, and first touch of the new buffers."""
    copied = {0: 2.0, 1: 1.0 + 1.0 / dp, 2: 2.0 + 2.0 / dp}[zero] * grad_bytes
    fresh = (2.0 + 1.0 / dp if zero == 2 else 1.0) * grad_bytes
    return 2.0 * copied / dev.hbm_effective + fresh * dev.first_touch_s_per_byte


def _dp_time(dense: float, expert: float, cfg: ParallelConfig, w: Workload, traits: fw.Traits, comms: Comms,
             t: MicroBatchTime, cooldown: float, blocks: list[LayerCost], dev: Device) -> float:
    """Exposed data-parallel time of one pipeline rank (see step_time.dp_exposed)."""
    dp = cfg.dp_ranks  # context-parallel ranks reduce gradients with the data-parallel ones
    gb = _grad_comm_bytes(cfg, w, traits)
    copies = _flat_copies(gb * (dense + expert), dp, cfg.zero_stage, dev) \
        if traits.flat_copies and cfg.zero_stage <= 2 else 0.0
    if dp == 1 and cfg.ep == 1:
        return copies  # DeepSpeed flattens for a group of one too
    edp = _edp(cfg)
    wb = w.bytes_per_param

    def on(op: str, nbytes_dense: float, nbytes_expert: float) -> float:
        out = comms.dp(op, nbytes_dense) if dp > 1 else 0.0
        return out + (comms.edp(op, nbytes_expert) if (edp > 1 and nbytes_expert) else 0.0)

    if cfg.zero_stage == 3:
        # DeepSpeed ZeRO-3 gathers each layer's weights before it runs (forward, and again in
        # backward) and reduce-scatters its gradients after: one collective per block, so the
        # per-call latency counts once per layer, not once per stage.
        gather = sum(on("allgather", wb * c.params_rank, wb * c.expert_params_rank) for c in blocks)
        reduce = sum(on("reducescatter", gb * c.params_rank, gb * c.expert_params_rank) for c in blocks)
        if traits.flat_copies:  # gathered into new storage; the reduce-scatter's input flattened
            every = sum(c.params_rank + c.expert_params_rank for c in blocks)
            gather += wb * every * dev.first_touch_s_per_byte
            reduce += gb * every * (2.0 / dev.hbm_effective + dev.first_touch_s_per_byte)
        return zero3_exposed(gather, reduce, t.fwd, t.bwd + t.recompute, cfg.grad_accum)
    if cfg.zero_stage >= 1:
        reduce = on("allreduce" if traits.zero_grad_allreduce else "reducescatter", gb * dense, gb * expert)
        gather = on("allgather", wb * dense, wb * expert)
    else:
        reduce, gather = on("allreduce", gb * dense, gb * expert), 0.0
    reduce += copies
    first_fwd = t.fwd if cfg.framework == "megatron" else 0.0
    overlap = fw.grad_reduce_overlaps(traits, cfg.pp, cfg.zero_stage)
    exposed = dp_exposed(reduce, gather, overlap, t.bwd + t.recompute, first_fwd, cooldown)
    if cfg.zero_stage == 2 and traits.zero2_reduces_every_microbatch:
        exposed += earlier_microbatch_reductions(reduce, overlap, t.bwd + t.recompute, cfg.grad_accum)
    return exposed


def _edp(cfg: ParallelConfig) -> int:
    """Replicas of each routed expert: the stage's tp x dp x cp ranks over expert TP x EP."""
    return cfg.tp * cfg.dp_ranks // (cfg.etp * cfg.ep)


def _optimizer_time(dense: float, expert: float, cfg: ParallelConfig, w: Workload, cluster: Cluster,
                    dev: Device) -> float:
    sharded = cfg.zero_stage >= 1
    local = dense / (cfg.dp_ranks if sharded else 1) + expert / (max(_edp(cfg), 1) if sharded else 1)
    if cfg.offload == "none":
        # DeepSpeed's step flattens the rank's gradient partition into a new fp32 tensor first
        flat = local * 4.0 * (2.0 / dev.hbm_effective + dev.first_touch_s_per_byte) \
            if fw.traits(cfg.framework).flat_copies and sharded else 0.0
        return gpu_optimizer_time(local, dev, sgd=w.optimizer == "sgd") + flat
    node = cluster.profile.node
    if cfg.framework == "megatron":
        return float(hybrid_optimizer_time(local, cluster.gpus_per_node, node.cpu_adam_GBps * 1e9,
                                              node.pcie_GBps * 1e9 / node.gpus_per_host_link))
    return cpu_optimizer_time(local, cluster.gpus_per_node, node.cpu_adam_GBps * 1e9,
                              node.pcie_GBps * 1e9 / node.gpus_per_host_link,
                                 cfg.offload == "optimizer+params", cfg.grad_accum)


# -- collectives over this placement -------------------------------------------------------


def build_comms(cluster: Cluster, cfg: ParallelConfig) -> Comms:
    """Collective timings of the TP, EP, DP, expert-DP and PP groups of ``cfg`` on ``cluster``.

    Rank order is TP innermost, then EP, then the rest of DP, then PP (Megatron and DeepSpeed
    order); EP ranks are part of the DP group, so the dense DP group spans both.
    """
    return _comms_cached(cluster, cfg.tp, cfg.ep, cfg.dp_ranks, cfg.pp, cfg.cp, cfg.cp_comm, cfg.etp)


@lru_cache(maxsize=256)
def _comms_cached(cluster: Cluster, tp: int, ep: int, dp: int, pp: int, cp: int = 1, cp_comm: str = "p2p",
                  etp: int = 0) -> Comms:
    from planner.cost.collectives import collective_seconds
    from planner.hardware.placement import Placement, pipeline_hops

    etp = etp or tp  # the experts' ranks: expert TP innermost, then EP, then expert DP (Megatron's expert order)
    full = Placement(cluster, dims={"tp": etp, "ep": ep, "dp": tp * dp // (etp * ep), "pp": pp},
                     order=("tp", "ep", "dp", "pp"))
    dense = Placement(cluster, dims={"tp": tp, "dp": dp, "pp": pp}, order=("tp", "dp", "pp"))
    tp_ep = Placement(cluster, dims={"te": etp * ep, "dp": tp * dp // (etp * ep), "pp": pp}, order=("te", "dp", "pp"))
    shapes = {"tp": dense.group("tp"), "ep": full.group("ep"), "edp": full.group("dp"), "dp": dense.group("dp"),
              "pp": full.group("pp"), "tp_ep": tp_ep.group("te")}
    # hops inside a node of a pp group that spans nodes (placement.pipeline_hops)
    near = pipeline_hops(cluster, full.stride("pp"), pp)[1] if shapes["pp"].crosses_nodes else None
    if near is not None:
        shapes["pp_near"] = near

    def fn(dim: str):
        shape = shapes[dim]
        if shape.size == 1:
            return lambda op, nbytes: 0.0

        @lru_cache(maxsize=4096)
        def timed(op: str, nbytes: float) -> float:
            return float(collective_seconds(cluster, op, shape, nbytes))

        return timed

    # CP: the first cp of the dp x cp ranks after TP (Megatron's tp-cp-ep-dp-pp order); a2a+p2p
    # all-to-alls among the CP ranks one node holds and rings among the nodes.
    ring, a2a = 1, 1
    if cp > 1:
        whole = Placement(cluster, dims={"tp": tp, "cp": cp, "rest": dp // cp, "pp": pp},
                          order=("tp", "cp", "rest", "pp")).group("cp")
        inner = cp if cp_comm == "a2a" else (1 if cp_comm == "p2p" else whole.ranks_per_node)
        split = Placement(cluster, dims={"tp": tp, "inner": inner, "outer": cp // inner, "rest": dp // cp, "pp": pp},
                          order=("tp", "inner", "outer", "rest", "pp"))
        shapes["cp_ring"], shapes["cp_a2a"] = split.group("outer"), split.group("inner")
        ring, a2a = cp // inner, inner
    pp_fn = fn("pp")
    near_fn = fn("pp_near") if near is not None else None
    ring_fn = fn("cp_ring") if ring > 1 else None
    a2a_fn = fn("cp_a2a") if a2a > 1 else None
    return Comms(tp=fn("tp"), ep=fn("ep"), dp=fn("dp"), edp=fn("edp"), tp_ep=fn("tp_ep"),
                    pp=lambda nbytes: pp_fn("p2p", nbytes),
                    pp_near=None if near_fn is None else (lambda nbytes: near_fn("p2p", nbytes)),
                    cp_ring=(lambda nbytes: 0.0) if ring_fn is None else (lambda nbytes: ring_fn("p2p", nbytes)),
                    cp_ring_size=ring,
                    cp_a2a=(lambda nbytes: 0.0) if a2a_fn is None else (lambda nbytes: a2a_fn("alltoall", nbytes)))


def pp_hops(cluster: Cluster, cfg: ParallelConfig) -> tuple[bool, ...]:
    """Per pipeline rank, whether its hop to the next rank leaves the node (build_comms' layout:
    the pp stride is tp x dp)."""
    from planner.hardware.placement import pipeline_hops

    return pipeline_hops(cluster, cfg.tp * cfg.dp_ranks, cfg.pp)[0]
