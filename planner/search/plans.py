"""Build ``Plan`` objects from the vectorised evaluation.

The plans the search returns must be the cost model's own ``Plan`` (the same structure and
numbers ``estimate`` gives for that configuration and partition: tests/test_suggest.py
re-estimates and compares). Building them from the twin's per-rank parts instead of calling
``estimate`` again saves the scalar per-GEMM walk, which costs more than the whole search on
a 126-layer model.
"""

from __future__ import annotations

import itertools
from collections import Counter

from planner.cost import memory as mem
from planner.cost.memory import MemoryBreakdown
from planner.cost.plan import Plan, StagePlan
from planner.cost.step_time import MicroBatchTime, StepTime
from planner.model.spec import DecoderBlock, ModelSpec
from planner.search.evaluate import Evaluator, Prepared


def build_plan(ev: Evaluator, prep: Prepared, i: int) -> tuple[Plan, tuple[float, float]]:
    """Candidate ``i`` as a Plan, plus its (greedy, optimal) balancer bottlenecks."""
    return build_plans(ev, prep, [i])[0]


def build_plans(ev: Evaluator, prep: Prepared, rows: list[int]) -> list[tuple[Plan, tuple[float, float]]]:
    """``build_plan`` of many candidates, their parts assembled together (Evaluator.candidates)."""
    facts = _block_facts(ev.model)
    return [_plan(ev, prep, i, facts, *detail) for i, detail in zip(rows, ev.candidates(prep, rows))]


def _block_facts(model: ModelSpec) -> tuple[list[str], list[int]]:
    """Each block's kind, and how many decoder blocks come before each block (a prefix count),
    so a stage's counts are slices rather than a walk over its blocks' models."""
    kinds = [b.kind for b in model.blocks]
    decoders = [0, *itertools.accumulate(isinstance(b, DecoderBlock) for b in model.blocks)]
    return kinds, decoders


def _plan(ev: Evaluator, prep: Prepared, i: int, facts: tuple[list[str], list[int]], parts, ranks, d,
          bottlenecks) -> tuple[Plan, tuple[float, float]]:
    cfg = prep.space.config(i)
    model, pp, m = ev.model, cfg.pp, cfg.grad_accum
    kinds, decoders = facts
    # Per rank as plain floats: one conversion per array, not one numpy scalar per number.
    memory_rows = zip(*(d[k][0].tolist() for k in ("weights", "grads", "optimizer", "activations", "buffers",
                                                   "overhead", "cpu_per_node")))
    time_rows = zip(*(ranks[k].tolist() for k in ("fwd", "bwd", "rc", "tp", "ep", "pp")))
    inflight = d["inflight"][0].tolist()
    stages = []
    for r, memory, mb in zip(range(pp), memory_rows, time_rows):
        chunks = [tuple(c) for c in parts[r::pp]]
        counts = Counter(itertools.chain.from_iterable(kinds[a:e] for a, e in chunks))
        stages.append(StagePlan(r, list(chunks), sum(decoders[e] - decoders[a] for a, e in chunks), dict(counts),
                                MemoryBreakdown(*memory), MicroBatchTime(*mb), float(inflight[r])))
    w = stages[int(d["worst"][0])].microbatch
    time = StepTime(compute=m * (w.fwd + w.bwd), recompute=m * w.recompute, tp_comm=m * w.tp,
                    pp_bubble=float(d["bubble"][0]), pp_comm=m * w.pp, dp_comm=float(d["dp"][0].max()),
                    ep_comm=m * w.ep, optimizer=float(d["opt"][0].max()))
    cluster = ev.cluster
    plan = Plan(model=model.name, hardware=cluster.profile.name, nodes=cluster.nodes,
                gpus_per_node=cluster.gpus_per_node, cfg=cfg, workload=ev.workload, partition=list(parts),
                stages=stages, time=time, capacity_bytes=cluster.profile.gpu.memory_bytes,
                host_capacity_bytes=mem.host_capacity_bytes(cluster.profile.node.host_memory_GiB),
                model_flops_per_step=ev.flops_per_step(), peak_flops=ev.dev.peak_flops)
    return plan, bottlenecks
