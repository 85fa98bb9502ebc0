"""Build ``Plan`` objects from the vectorised evaluation.

The plans the search returns must be the cost model's own ``Plan`` (the same structure and
numbers ``estimate`` gives for that configuration and partition: tests/test_suggest.py
re-estimates and compares). Building them from the twin's per-rank parts instead of calling
``estimate`` again saves the scalar per-GEMM walk, which costs more than the whole search on
a 126-layer model.
"""

from __future__ import annotations

import itertools

from planner.cost import memory as mem
from planner.cost.memory import MemoryBreakdown
from planner.cost.plan import Plan, StagePlan
from planner.cost.step_time import MicroBatchTime, StepTime
from planner.model.spec import ModelSpec
from planner.search.evaluate import RANK_FIELDS, Evaluator, Prepared


def build_plan(ev: Evaluator, prep: Prepared, i: int) -> tuple[Plan, tuple[float, float]]:
    """Candidate ``i`` as a Plan, plus its (greedy, optimal) balancer bottlenecks."""
    return build_plans(ev, prep, [i])[0]


def build_plans(ev: Evaluator, prep: Prepared, rows: list[int]) -> list[tuple[Plan, tuple[float, float]]]:
    """``build_plan`` of many candidates, their parts assembled together (Evaluator.candidates)."""
    facts = _block_facts(ev.model)
    return [_plan(ev, prep, i, facts, *detail) for i, detail in zip(rows, ev.candidate_parts(prep, rows))]


BlockFacts = tuple[list[int], list[tuple[int, str]]]


def _block_facts(model: ModelSpec) -> BlockFacts:
    """The runs of blocks of one kind, as (end, kind), and the run of each block, so a
    stage's counts come from the few runs its chunks overlap rather than a walk over its
    blocks."""
    run_of: list[int] = []
    runs: list[tuple[int, str]] = []
    for kind, same in itertools.groupby(b.kind for b in model.blocks):
        run_of.extend(itertools.repeat(len(runs), sum(1 for _ in same)))
        runs.append((len(run_of), kind))
    return run_of, runs


def _kind_counts(facts: BlockFacts, chunks: list[tuple[int, int]]) -> dict[str, int]:
    """Blocks per kind over ``chunks``, keyed in the order the kinds first appear (as a Counter
    over the chunks' blocks in turn would list them): each chunk walks the runs it overlaps."""
    run_of, runs = facts
    counts: dict[str, int] = {}
    for a, e in chunks:
        j = run_of[a] if a < e else 0
        while a < e:
            end, kind = runs[j]
            stop = end if end < e else e
            counts[kind] = counts.get(kind, 0) + stop - a
            a, j = stop, j + 1
    return counts


# The rank-table rows of a MicroBatchTime, in its field order.
_TIME_ROWS = [RANK_FIELDS.index(k) for k in ("fwd", "bwd", "rc", "tp", "ep", "pp")]


def _plan(ev: Evaluator, prep: Prepared, i: int, facts: BlockFacts, parts, ranks, d, n: int,
          bottlenecks) -> tuple[Plan, tuple[float, float]]:
    """Candidate ``i`` as a Plan from its rank table and its row ``n`` of ``assemble``'s detail."""
    cfg = prep.space.config(i)
    model, pp, m = ev.model, cfg.pp, cfg.grad_accum
    # Per rank as plain floats: one conversion per array, not one numpy scalar per number.
    memory_rows = zip(*(d[k][n].tolist() for k in ("weights", "grads", "optimizer", "activations", "buffers",
                                                   "overhead", "cpu_per_node")))
    time_rows = zip(*ranks[_TIME_ROWS].tolist())
    inflight = d["inflight"][n].tolist()
    stages = []
    for r, memory, mb in zip(range(pp), memory_rows, time_rows):
        chunks = list(map(tuple, parts[r::pp]))
        kinds = _kind_counts(facts, chunks)
        stages.append(StagePlan(r, chunks, kinds.get("decoder", 0), kinds,  # DecoderBlock.kind: its layers
                                MemoryBreakdown(*memory), MicroBatchTime(*mb), float(inflight[r])))
    w = stages[int(d["worst"][n])].microbatch
    time = StepTime(compute=m * (w.fwd + w.bwd), recompute=m * w.recompute, tp_comm=m * w.tp,
                    pp_bubble=float(d["bubble"][n]), pp_comm=m * w.pp, dp_comm=float(d["dp"][n].max()),
                    ep_comm=m * w.ep, optimizer=float(d["opt"][n].max()))
    cluster = ev.cluster
    plan = Plan(model=model.name, hardware=cluster.profile.name, nodes=cluster.nodes,
                gpus_per_node=cluster.gpus_per_node, cfg=cfg, workload=ev.workload, partition=list(parts),
                stages=stages, time=time, capacity_bytes=cluster.profile.gpu.memory_bytes,
                host_capacity_bytes=mem.host_capacity_bytes(cluster.profile.node.host_memory_GiB),
                model_flops_per_step=ev.flops_per_step(), peak_flops=ev.dev.peak_flops)
    return plan, bottlenecks
