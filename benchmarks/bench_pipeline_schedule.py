"""How far the closed-form pipeline model is from Megatron's schedule replayed op by op.

    python benchmarks/bench_pipeline_schedule.py

The cost model prices a pipeline as m x T_w + (S - T_w) / v (planner/cost/step_time.py
``pipeline``: T_w the slowest rank's micro-batch over all its chunks, S the sum over ranks, m
micro-batches per step, v virtual stages). That is exact for equal ranks
(tests/test_interleaved_schedule.py); with unequal chunks it is an approximation. This script
takes the best pipelined plan ``dsplan suggest`` finds for a set of cases, prices each of its
chunks from the search's block tables (forward; backward with recomputation; TP and EP
traffic split evenly between the two), and compares the model's compute-plus-bubble time with
the makespan of Megatron's own op order over those chunks (planner/cost/schedule_replay.py,
sends free). Positive: the model is slower (pessimistic) than the replay.
"""

from __future__ import annotations

import sys

import numpy as np

from planner.cost.memory import microbatch_group
from planner.cost.parallel import RECOMPUTES
from planner.cost.schedule_replay import replay
from planner.cost.step_time import MicroBatchTime, pipeline
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.evaluate import Evaluator
from planner.search.space import Constraints
from planner.search.suggest import suggest

# (model, nodes, global batch or None for the default, constraints)
CASES = [
    ("vl2", 8, None, Constraints(pp=(4,))),
    ("llama-3.1-405b", 64, None, None),
    ("llama-3.1-405b", 256, None, None),
    ("deepseek-v3", 128, None, None),
    ("mixtral-8x22b", 16, None, None),
    ("llama-3-70b", 8, None, None),
    ("gpt3-175b", 128, None, None),
    ("gpt3-175b", 64, 1536, None),
    ("bloom-176b", 48, None, None),
    ("llama-3.1-70b", 16, None, Constraints(framework=("megatron",), virtual_stages=(2, 3, 4))),
    ("llama-3.1-8b", 1, 6, Constraints(pp=(4,), virtual_stages=(2,), framework=("megatron",), micro_batch=(1,),
                                       tp=(2,))),
]


def chunk_times(plan) -> tuple[list[list[float]], list[list[float]]]:
    """Per rank and chunk on it, one micro-batch's forward and backward seconds."""
    c = plan.cfg
    model = load_model(plan.model)
    ev = Evaluator(model, Cluster.build(load_profile(plan.hardware), plan.nodes), plan.workload)
    table = ev.table(c.tp, int(c.sequence_parallel), c.ep, c.dp, c.pp, (c.micro_batch,))
    bi, mode = table.b_index(c.micro_batch), RECOMPUTES.index(c.recompute)
    comm = (table.tp[mode, bi] + table.ep[mode, bi]) / 2
    f_block, b_block = table.fwd[bi] + comm, table.bwd[bi] + table.rc[mode, bi] + comm
    fwd = [[0.0] * c.virtual_stages for _ in range(c.pp)]
    bwd = [[0.0] * c.virtual_stages for _ in range(c.pp)]
    for k, (a, e) in enumerate(plan.partition):  # model chunk k runs on rank k mod pp as its chunk k // pp
        fwd[k % c.pp][k // c.pp] = float(np.sum(f_block[a:e]))
        bwd[k % c.pp][k // c.pp] = float(np.sum(b_block[a:e]))
    return fwd, bwd


def main() -> int:
    print(f"{'case':<34} {'layout':<16} {'m':>4} {'G':>3} {'rank spread ms':>17} {'model s':>9} {'replay s':>9} {'model/replay':>13}")
    errors = []
    for name, nodes, gb, cons in CASES:
        res = suggest(name, nodes=nodes, global_batch=gb, top=1, constraints=cons)
        plan = res.plans[0].plan
        c = plan.cfg
        if c.pp == 1:
            print(f"{name + ' on ' + str(nodes):<34} no pipeline")
            continue
        fwd, bwd = chunk_times(plan)
        ranks = [MicroBatchTime(fwd=sum(f), bwd=sum(b), recompute=0.0, tp=0.0, ep=0.0, pp=0.0) for f, b in zip(fwd, bwd)]
        m, v = c.grad_accum, c.virtual_stages
        worst, bubble = pipeline(ranks, m, v)
        model_s = m * ranks[worst].total + bubble
        g = microbatch_group(c.pp, m) if v > 1 else c.pp
        replay_s, _ = replay(c.pp, v, m, g, fwd, bwd)
        totals = [r.total * 1e3 for r in ranks]
        err = model_s / replay_s - 1
        errors.append(err)
        label = f"{name} on {nodes}" + (f", batch {gb}" if gb else "")
        layout = f"pp {c.pp}" + (f" x v {v}" if v > 1 else " (1F1B)")
        print(f"{label:<34} {layout:<16} {m:>4} {g if v > 1 else '-':>3} {min(totals):>8.1f}-{max(totals):<8.1f} "
              f"{model_s:>9.3f} {replay_s:>9.3f} {err:>+13.2%}")
    print(f"model vs replay: {min(errors):+.2%} to {max(errors):+.2%} over {len(errors)} pipelined plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
