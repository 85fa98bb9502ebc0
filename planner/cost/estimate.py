"""``estimate``: the cost model applied to one parallel configuration of a model on a cluster.

Checks every rule (degrees, model divisibility, framework limits, batch split), then prices
the configuration as a set of one candidate through the same functions the search applies to
thousands: block tables (block_times.py), the rank table of its split (rank_tables.py),
memory and step time (assemble.py), and the Plan (plans.py).
"""

from __future__ import annotations

from planner.cost import frameworks as fw
from planner.cost import pipeline_sends as ps
from planner.cost.assemble import assemble
from planner.cost.block_times import BlockTables
from planner.cost.candidates import columns_of
from planner.cost.context import CostContext
from planner.cost.context_parallel import check_context_parallel, cp_groups
from planner.cost.degrees import check_world
from planner.cost.framework_rules import check_framework_for
from planner.cost.paid import paid
from planner.cost.parallel import FRAMEWORKS, RECOMPUTES, ParallelConfig, Workload, check_against_model
from planner.cost.partition import Partition, check_partition, default_partition
from planner.cost.plan import Plan
from planner.cost.plans import BlockKinds, build_plan
from planner.cost.rank_tables import RankSpec, RankTables, rank_fields
from planner.cost.run_model import RunModel
from planner.errors import UserError, arg
from planner.hardware.cluster import Cluster
from planner.model.spec import ModelSpec


def estimate(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
             partition: Partition | None = None, pp_send: str | None = None,
             tp_backward_overlap: bool = True) -> Plan:
    """Memory per GPU and step time of ``cfg`` training ``model`` on ``cluster``.

    ``partition``: ``pp x virtual stages`` block ranges (default: Megatron's even split).
    ``pp_send`` overrides how the runtime sends across pipeline stages (pipeline_sends.PP_SENDS;
    the Table 1 benchmark models 2021 Megatron-LM's scatter/gather with it). ``tp_backward_overlap``
    False prices the backward's TP reductions exposed where the runtime overlaps them
    (frameworks.Traits.tp_backward_overlap): Megatron-LM before Sep 2021, as Table 1 ran."""
    model, workload = workload.trained(model), workload.resolved(model)
    check_plan(model, cluster, workload, cfg)
    if pp_send is not None and pp_send not in ps.PP_SENDS:
        raise ValueError(f"pp_send {pp_send!r}: one of {', '.join(ps.PP_SENDS)}")
    stages = cfg.pp * cfg.virtual_stages
    parts = (default_partition(model, stages) if partition is None
             else check_partition(partition, len(model.blocks), stages))
    ctx = CostContext.of(cluster, workload)
    tables = BlockTables(model, cluster, workload, ctx.dev, cfg.cp, cfg.cp_comm, cfg.expert_tp)
    sp = int(cfg.sequence_parallel)
    table = tables.table(cfg.tp, fw.tp_style(cfg.framework, cfg.tp, cfg.sequence_parallel), cfg.ep,
                         (cfg.micro_batch,))
    how = paid(ctx, cfg.framework, bool(sp), cfg.tp, cfg.ep, cfg.dp_ranks, cfg.pp, cfg.virtual_stages)
    spec = RankSpec.build(table, parts, mode=RECOMPUTES.index(cfg.recompute), b=cfg.micro_batch, pp=cfg.pp,
                          vs=cfg.virtual_stages, tp=cfg.tp, sp=bool(sp), ep=cfg.ep, dp=cfg.dp_ranks,
                          framework=FRAMEWORKS.index(cfg.framework),
                          layout=ctx.layout(cfg.tp, cfg.ep, cfg.dp_ranks, cfg.pp, cfg.dp_replicate, cfg.expert_tp),
                          zero3=cfg.zero_stage == 3, send=pp_send,
                          paid=how._replace(tp_async=how.tp_async and tp_backward_overlap), rep=cfg.dp_replicate,
                          m=cfg.grad_accum)
    (ranks,) = RankTables(model, ctx).tables([spec])
    asm = assemble(ctx, columns_of([cfg]), rank_fields(ranks[None]), cfg.pp)
    return build_plan(model, ctx, cfg, parts, ranks, asm, 0, tables.runs.flops_per_step(), BlockKinds(model))


def check_plan(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig) -> None:
    """Every rule a plan must satisfy, each failure a UserError naming the rule."""
    check_world(cluster, cfg.dp, cfg.tp, cfg.pp, cfg.cp)
    if cfg.samples_per_step != workload.global_batch:
        raise UserError(f"global batch {workload.global_batch} != micro-batch {cfg.micro_batch} x grad accumulation "
                        f"{cfg.grad_accum} x dp {cfg.dp} = {cfg.samples_per_step}")
    check_against_model(cfg, heads=model.attention_heads, kv_heads=model.kv_heads, routed_experts=model.routed_experts,
                        blocks=model.num_layers)
    check_framework_for(cfg, model, optimizer=workload.optimizer, precision=workload.precision_name,
                        precision_aware_optimizer=workload.precision_aware_optimizer, zero_pp=workload.zero_pp,
                        ep_overlap=workload.ep_comm_overlap, dispatcher=workload.moe_dispatcher,
                        modules=workload.recompute_modules, pp_schedule=workload.pp_schedule,
                        compiled=workload.compile)
    check_context_parallel(cp=cfg.cp, comm=cfg.cp_comm, seq_len=workload.seq_len, heads=model.attention_heads,
                           kv_heads=model.kv_heads, tp=cfg.tp,
                           a2a_ranks=cp_groups(cluster, cfg.tp, cfg.cp, cfg.cp_comm).a2a_size,
                           flash_attention=workload.flash_attention, is_vlm=model.is_vlm)
    if workload.seq_len > model.max_seq_len:
        raise UserError(f"{arg('seq_len')} {workload.seq_len} exceeds {model.name}'s maximum context "
                        f"of {model.max_seq_len}")


def model_flops(model: ModelSpec, workload: Workload) -> float:
    """Model FLOPs of one step (block_times.RunModel.flops_per_step)."""
    return RunModel(model, workload).flops_per_step()
