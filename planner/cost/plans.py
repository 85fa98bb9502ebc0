"""``Plan`` objects from the cost model's arrays: one candidate's rank table and its row of an
``Assembly``. ``estimate`` and the search build their plans here, so a plan the search returns
is the one ``estimate`` gives for that configuration and split."""

from __future__ import annotations

import itertools

import numpy as np

from planner.cost import memory as mem
from planner.cost.assemble import Assembly
from planner.cost.candidates import columns_of
from planner.cost.context import CostContext
from planner.cost.dualpipe import rank_chunks
from planner.cost.goodput import plan_checkpoint
from planner.cost.memory import MemoryBreakdown
from planner.cost.parallel import ParallelConfig
from planner.cost.plan import Plan, StagePlan
from planner.cost.rank_chunks import Split
from planner.cost.rank_tables import TIME_ROWS
from planner.cost.step_time import MicroBatchTime, StepTime
from planner.model.spec import ModelSpec


class BlockKinds:
    """The runs of blocks of one kind, as (end, kind), and the run of each block, so a stage's
    counts come from the few runs its chunks overlap rather than a walk over its blocks."""

    def __init__(self, model: ModelSpec) -> None:
        self.run_of: list[int] = []
        self.runs: list[tuple[int, str]] = []
        for kind, same in itertools.groupby(b.kind for b in model.blocks):
            self.run_of.extend(itertools.repeat(len(self.runs), sum(1 for _ in same)))
            self.runs.append((len(self.run_of), kind))

    def counts(self, chunks: list[tuple[int, int]]) -> dict[str, int]:
        """Blocks per kind over ``chunks``, keyed in the order the kinds first appear (as a
        Counter over the chunks' blocks in turn would list them)."""
        counts: dict[str, int] = {}
        for a, e in chunks:
            j = self.run_of[a] if a < e else 0
            while a < e:
                end, kind = self.runs[j]
                stop = end if end < e else e
                counts[kind] = counts.get(kind, 0) + stop - a
                a, j = stop, j + 1
        return counts


def build_plan(model: ModelSpec, ctx: CostContext, cfg: ParallelConfig, parts: Split, ranks: np.ndarray,
               asm: Assembly, n: int, flops_per_step: float, kinds: BlockKinds) -> Plan:
    """The Plan of ``cfg`` split as ``parts``, from its [RANK_FIELDS x pp] rank table and row
    ``n`` of ``asm``."""
    pp, m = cfg.pp, cfg.grad_accum
    if cfg.activation_offload != asm.act_offload[n]:  # the layers the search chose to offload
        cfg = cfg.model_copy(update={"activation_offload": int(asm.act_offload[n])})
    # Per rank as plain floats: one conversion per array, not one numpy scalar per number.
    memory_rows = zip(*(a[n].tolist() for a in (asm.weights, asm.grads, asm.optimizer, asm.activations,
                                                asm.buffers, asm.overhead, asm.cpu_per_node)))
    time_rows = zip(*ranks[TIME_ROWS].tolist())
    inflight = asm.inflight[n].tolist()
    stages = []
    for r, memory, mb in zip(range(pp), memory_rows, time_rows):
        chunks = list(map(tuple, rank_chunks(parts, pp, cfg.virtual_stages, ctx.workload.pp_schedule, r)))
        counts = kinds.counts(chunks)
        stages.append(StagePlan(r, chunks, counts.get("decoder", 0), counts,  # DecoderBlock.kind: its layers
                                MemoryBreakdown(*memory), MicroBatchTime(*mb), float(inflight[r])))
    w = stages[int(asm.worst[n])].microbatch
    time = StepTime(compute=m * (w.fwd + w.bwd), recompute=m * w.recompute, tp_comm=m * w.tp,
                    pp_bubble=float(asm.bubble[n]), pp_comm=m * w.pp, dp_comm=float(asm.dp[n].max()),
                    ep_comm=m * w.ep, optimizer=float(asm.opt[n].max()), cp_comm=m * w.cp,
                    act_offload=float(asm.act_offload_s[n]))
    cluster = ctx.cluster
    checkpoint = plan_checkpoint(columns_of([cfg]), time.total, model, ctx.workload, cluster.profile, cluster.nodes)
    return Plan(model=model.name, hardware=cluster.profile.name, nodes=cluster.nodes,
                gpus_per_node=cluster.gpus_per_node, cfg=cfg, workload=ctx.workload, partition=list(parts),
                stages=stages, time=time, capacity_bytes=cluster.profile.gpu.memory_bytes,
                host_capacity_bytes=mem.host_capacity_bytes(cluster.profile.node.host_memory_GiB),
                model_flops_per_step=flops_per_step, peak_flops=ctx.dev.mfu_peak, checkpoint=checkpoint)
