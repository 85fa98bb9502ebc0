"""``estimate``: evaluate one parallel configuration of a model on a cluster.

Checks every rule (degrees, model divisibility, framework limits, batch split), builds the
layer cost profile once, then for each pipeline rank its memory at the peak and its
micro-batch time, and assembles the step (planner/cost/step_time.py).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from planner.cost import frameworks as fw
from planner.cost import memory as mem
from planner.cost import step_time as st
from planner.cost.efficiency import Device, device
from planner.cost.layers import LayerCost, layer_costs
from planner.cost.parallel import ParallelConfig, Workload, check_against_model
from planner.cost.partition import Partition, check_partition, default_partition, rank_chunks
from planner.cost.plan import Plan, StagePlan
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.model.spec import DecoderBlock, EmbeddingBlock, LMHeadBlock, ModelSpec


def estimate(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
             partition: Partition | None = None, pp_send: str | None = None) -> Plan:
    """Memory per GPU and step time of ``cfg`` training ``model`` on ``cluster``.

    ``pp_send`` overrides how the runtime sends across pipeline stages (frameworks.PP_SENDS;
    the Table 1 benchmark models 2021 Megatron-LM's scatter/gather with it)."""
    check_plan(model, cluster, workload, cfg)
    stages = cfg.pp * cfg.virtual_stages
    parts = default_partition(model, stages) if partition is None else check_partition(partition, len(model.blocks), stages)
    costs = layer_costs(model, workload, cfg.tp, cfg.sequence_parallel, cfg.ep)
    dev = device(cluster.profile, "bf16" if workload.precision == "bf16" else workload.precision)
    comms = build_comms(cluster, cfg)
    traits = fw.traits(cfg.framework)
    chunks = rank_chunks(parts, cfg.pp)
    b, m = cfg.micro_batch, cfg.grad_accum
    send = pp_send or traits.pp_send
    if send not in fw.PP_SENDS:
        raise ValueError(f"pp_send {send!r}: one of {', '.join(fw.PP_SENDS)}")
    send_div = fw.pp_send_divisor(send, cfg.tp, cfg.sequence_parallel)
    gathers = fw.pp_boundary_gathers(send, cfg.tp)
    transfers, meta = fw.pp_transfers(traits), fw.pp_meta_bytes(send, cfg.tp)
    crosses = pp_hops(cluster, cfg)
    times = [st.rank_time(costs, ch, b, dev, comms, cfg.recompute, send_div, len(model.blocks), gathers,
                          (crosses[r], crosses[r - 1]), transfers, meta) for r, ch in enumerate(chunks)]
    worst, bubble = st.pipeline(times, m, cfg.virtual_stages)
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
            tied, cooldown = st.tied_allreduce_time(comms.pp, tied_bytes), 0.0
        dp_exposed.append(tied + _dp_time(dense, expert, cfg, workload, traits, comms, times[r], cooldown, blocks))
        opt_time.append(_optimizer_time(dense, expert, cfg, workload, cluster, dev))

    t = times[worst]
    time = st.StepTime(compute=m * (t.fwd + t.bwd), recompute=m * t.recompute, tp_comm=m * t.tp, pp_bubble=bubble,
                       pp_comm=m * t.pp, dp_comm=max(dp_exposed), ep_comm=m * t.ep, optimizer=max(opt_time))
    return Plan(model=model.name, hardware=cluster.profile.name, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
                cfg=cfg, workload=workload, partition=parts, stages=stage_plans, time=time,
                capacity_bytes=cluster.profile.gpu.memory_bytes,
                host_capacity_bytes=mem.host_capacity_bytes(cluster.profile.node.host_memory_GiB), model_flops_per_step=model_flops(model, workload),
                peak_flops=dev.peak_flops)


def check_plan(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig) -> None:
    """Every rule a plan must satisfy, each failure a UserError naming the rule."""
    if cfg.world_size != cluster.num_gpus:
        raise UserError(f"dp x tp x pp = {cfg.dp} x {cfg.tp} x {cfg.pp} = {cfg.world_size} but the cluster has "
                        f"{cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {cluster.num_gpus}; make the degrees multiply to {cluster.num_gpus}")
    if cfg.samples_per_step != workload.global_batch:
        raise UserError(f"global batch {workload.global_batch} != micro-batch {cfg.micro_batch} x grad accumulation "
                        f"{cfg.grad_accum} x dp {cfg.dp} = {cfg.samples_per_step}")
    check_against_model(cfg, heads=model.attention_heads, kv_heads=model.kv_heads, routed_experts=model.routed_experts,
                        blocks=model.num_layers)
    fw.check_framework_for(cfg, model, optimizer=workload.optimizer, precision=workload.precision)
    if workload.seq_len > model.max_seq_len:
        raise UserError(f"--seq-len {workload.seq_len} exceeds {model.name}'s maximum context of {model.max_seq_len}")


def model_flops(model: ModelSpec, workload: Workload) -> float:
    """Model FLOPs of one step: 3x the forward (backward = 2x), no recomputation; attention
    at full s^2 (the Megatron/Korthikanti convention)."""
    costs = layer_costs(model, workload)
    return 3.0 * sum(c.fwd_flops for c in costs) * workload.global_batch


def _tied_owners(model: ModelSpec, chunks: list[list[tuple[int, int]]], tp: int) -> tuple[int, int, float] | None:
    """(rank of the embedding, rank of the tied LM head, the copy's parameters per GPU after TP)
    when a tied head sits on another pipeline rank than the embedding, else None."""
    heads = [i for i, blk in enumerate(model.blocks) if isinstance(blk, LMHeadBlock) and blk.tied]
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
                cfg: ParallelConfig, w: Workload, cluster: Cluster, t: st.MicroBatchTime) -> StagePlan:
    b = cfg.micro_batch
    largest = max((c.params_rank + c.expert_params_rank for c in blocks), default=0.0)
    states = mem.model_states(dense, expert, framework=cfg.framework, zero=cfg.zero_stage, offload=cfg.offload,
                              dp=cfg.dp, ep=cfg.ep, precision=w.precision, moments=w.optimizer_moments,
                              live_layer_params=largest)
    stored = sum(c.act[cfg.recompute] for c in blocks) * b
    live = max((c.act_live for c in blocks if c.checkpointed), default=0.0) * b if cfg.recompute == "full" else 0.0
    inflight = mem.inflight_microbatches(r, cfg.pp, cfg.virtual_stages, cfg.grad_accum)
    acts = mem.activation_bytes(stored, live, inflight)
    groups = sum(1 for d in (cfg.tp, cfg.pp, cfg.dp, cfg.ep) if d > 1)
    pp_buffer = 2 * max(c.pp_bytes for c in blocks) * b if cfg.pp > 1 else 0.0
    buffers = mem.buffer_bytes(cfg.framework, cfg.zero_stage, dense + expert, groups, pp_buffer)
    allocated = states.gpu + acts + buffers
    breakdown = mem.MemoryBreakdown(states.weights, states.grads, states.optimizer, acts, buffers,
                                    mem.overhead_bytes(allocated),
                                    mem.cpu_bytes_per_node(states.cpu, cluster.gpus_per_node))
    kinds = Counter(model.blocks[i].kind for a, e in ch for i in range(a, e))
    decoders = sum(1 for a, e in ch for i in range(a, e) if isinstance(model.blocks[i], DecoderBlock))
    return StagePlan(r, list(ch), decoders, dict(kinds), breakdown, t, inflight)


def _grad_comm_bytes(cfg: ParallelConfig, w: Workload, traits: fw.Traits) -> int:
    if w.precision == "fp32" or (traits.fp32_grad_buffer and w.precision == "bf16"):
        return 4
    return 2


def _dp_time(dense: float, expert: float, cfg: ParallelConfig, w: Workload, traits: fw.Traits, comms: st.Comms,
             t: st.MicroBatchTime, cooldown: float, blocks: list[LayerCost]) -> float:
    """Exposed data-parallel time of one pipeline rank (see step_time.dp_exposed)."""
    if cfg.dp == 1 and cfg.ep == 1:
        return 0.0
    gb = _grad_comm_bytes(cfg, w, traits)
    edp = cfg.dp // cfg.ep

    def on(op: str, nbytes_dense: float, nbytes_expert: float) -> float:
        out = comms.dp(op, nbytes_dense) if cfg.dp > 1 else 0.0
        return out + (comms.edp(op, nbytes_expert) if (edp > 1 and nbytes_expert) else 0.0)

    if cfg.zero_stage == 3:
        # DeepSpeed ZeRO-3 gathers each layer's weights before it runs (forward, and again in
        # backward) and reduce-scatters its gradients after: one collective per block, so the
        # per-call latency counts once per layer, not once per stage.
        gather = sum(on("allgather", 2 * c.params_rank, 2 * c.expert_params_rank) for c in blocks)
        reduce = sum(on("reducescatter", gb * c.params_rank, gb * c.expert_params_rank) for c in blocks)
        return st.zero3_exposed(gather, reduce, t.fwd, t.bwd + t.recompute, cfg.grad_accum)
    if cfg.zero_stage >= 1:
        reduce = on("allreduce" if traits.zero_grad_allreduce else "reducescatter", gb * dense, gb * expert)
        gather = on("allgather", 2 * dense, 2 * expert)
    else:
        reduce, gather = on("allreduce", gb * dense, gb * expert), 0.0
    first_fwd = t.fwd if cfg.framework == "megatron" else 0.0
    overlap = fw.grad_reduce_overlaps(traits, cfg.pp)
    exposed = st.dp_exposed(reduce, gather, overlap, t.bwd + t.recompute, first_fwd, cooldown)
    if cfg.zero_stage == 2 and traits.zero2_reduces_every_microbatch:
        exposed += st.earlier_microbatch_reductions(reduce, overlap, t.bwd + t.recompute, cfg.grad_accum)
    return exposed


def _optimizer_time(dense: float, expert: float, cfg: ParallelConfig, w: Workload, cluster: Cluster,
                    dev: Device) -> float:
    sharded = cfg.zero_stage >= 1
    local = dense / (cfg.dp if sharded else 1) + expert / (max(cfg.dp // cfg.ep, 1) if sharded else 1)
    if cfg.offload == "none":
        return st.gpu_optimizer_time(local, dev, sgd=w.optimizer == "sgd")
    node = cluster.profile.node
    if cfg.framework == "megatron":
        return float(st.hybrid_optimizer_time(local, cluster.gpus_per_node, node.cpu_adam_GBps * 1e9,
                                              node.pcie_GBps * 1e9))
    return st.cpu_optimizer_time(local, cluster.gpus_per_node, node.cpu_adam_GBps * 1e9, node.pcie_GBps * 1e9,
                                 cfg.offload == "optimizer+params", cfg.grad_accum)


# -- collectives over this placement -------------------------------------------------------


def build_comms(cluster: Cluster, cfg: ParallelConfig) -> st.Comms:
    """Collective timings of the TP, EP, DP, expert-DP and PP groups of ``cfg`` on ``cluster``.

    Rank order is TP innermost, then EP, then the rest of DP, then PP (Megatron and DeepSpeed
    order); EP ranks are part of the DP group, so the dense DP group spans both.
    """
    return _comms_cached(cluster, cfg.tp, cfg.ep, cfg.dp, cfg.pp)


@lru_cache(maxsize=256)
def _comms_cached(cluster: Cluster, tp: int, ep: int, dp: int, pp: int) -> st.Comms:
    from planner.cost.collectives import collective_seconds
    from planner.hardware.placement import Placement, pipeline_hops

    full = Placement(cluster, dims={"tp": tp, "ep": ep, "dp": dp // ep, "pp": pp}, order=("tp", "ep", "dp", "pp"))
    dense = Placement(cluster, dims={"tp": tp, "dp": dp, "pp": pp}, order=("tp", "dp", "pp"))
    shapes = {"tp": full.group("tp"), "ep": full.group("ep"), "edp": full.group("dp"), "dp": dense.group("dp"),
              "pp": full.group("pp")}
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

    pp_fn = fn("pp")
    near_fn = fn("pp_near") if near is not None else None
    return st.Comms(tp=fn("tp"), ep=fn("ep"), dp=fn("dp"), edp=fn("edp"),
                    pp=lambda nbytes: pp_fn("p2p", nbytes),
                    pp_near=None if near_fn is None else (lambda nbytes: near_fn("p2p", nbytes)))


def pp_hops(cluster: Cluster, cfg: ParallelConfig) -> tuple[bool, ...]:
    """Per pipeline rank, whether its hop to the next rank leaves the node (build_comms' layout:
    the pp stride is tp x dp)."""
    from planner.hardware.placement import pipeline_hops

    return pipeline_hops(cluster, cfg.tp * cfg.dp, cfg.pp)[0]
