"""How far the closed-form pipeline model is from Megatron's schedule replayed op by op.

    python benchmarks/bench_pipeline_schedule.py

The cost model prices a pipeline as m x T_w + (S - T_w) / v (planner/cost/step_time.py
``pipeline``: T_w the slowest rank's micro-batch over all its chunks, S the sum over ranks, m
micro-batches per step, v virtual stages). That is exact for equal ranks
(tests/test_interleaved_schedule.py); with unequal chunks it is an approximation. This script
takes the best pipelined plan ``dsplan suggest`` finds for a set of cases (pp of 2 to 64), prices each of its
chunks from the search's block tables (forward; backward with recomputation; TP and EP
traffic split evenly between the two), and compares the model's compute-plus-bubble time with
the makespan of Megatron's own op order over those chunks (planner/cost/schedule_replay.py,
sends free). Positive: the model is slower (pessimistic) than the replay. The DualPipeV cases
(``--pp-schedule dualpipev``, torchtitan) compare its closed form (planner/cost/dualpipe.py) with
PyTorch's ScheduleDualPipeV order replayed the same way.
"""

from __future__ import annotations

import dataclasses
import sys

from planner.cost.block_times import BlockTables
from planner.cost.efficiency import device
from planner.cost.memory import microbatch_group
from planner.cost.schedule_check import chunk_times, formula_and_replay
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.space import Constraints
from planner.search.suggest import suggest

PIPELINES = (2, 4, 8, 16, 32, 64)  # the pipeline depths a case without a pp pin searches
DUALPIPEV = {"pp_schedule": "dualpipev"}
# (model, nodes, global batch or None for the default, constraints[, suggest's keywords])
CASES = [
    ("vl2", 8, None, Constraints(pp=(4,))),
    ("llama-3.1-405b", 64, None, None),
    ("llama-3.1-405b", 256, None, None),
    ("deepseek-v3", 128, None, None),
    ("mixtral-8x22b", 16, None, None),
    ("llama-3-70b", 8, None, None),
    ("gpt3-175b", 128, None, None),
    ("gpt3-175b", 64, 1536, None),
    ("qwen2.5-72b", 48, None, None),
    ("llama-3.1-70b", 16, None, Constraints(framework=("megatron",), virtual_stages=(2, 3, 4))),
    ("llama-3.1-8b", 1, 6, Constraints(pp=(4,), virtual_stages=(2,), framework=("megatron",), micro_batch=(1,),
                                       tp=(2,))),
    ("deepseek-v3", 256, 4096, Constraints(pp=(8, 16)),
     {**DUALPIPEV, "hardware": "h800", "mtp_layers": 0, "seq_len": 4096}),
    ("deepseek-v2-lite", 4, 256, Constraints(pp=(2, 4)), {**DUALPIPEV, "hardware": "dgx-h100", "seq_len": 4096}),
    ("llama-3.1-70b", 16, None, None, DUALPIPEV),
]


def main() -> int:
    print(f"{'case':<34} {'layout':<16} {'m':>4} {'G':>3} {'rank spread ms':>17} {'model s':>9} {'replay s':>9} "
          f"{'model/replay':>13}")
    errors = []
    for name, nodes, gb, cons, *keywords in CASES:
        # The best plan with a pipeline: FSDP and activation-offload plans, which win some of
        # these cases outright, run without one.
        cons = cons or Constraints()
        cons = dataclasses.replace(cons, pp=cons.pp or PIPELINES, activation_offload=False)
        res = suggest(name, nodes=nodes, global_batch=gb, top=1, constraints=cons, **(keywords[0] if keywords else {}))
        plan = res.plans[0].plan
        c = plan.cfg
        if c.pp == 1:
            print(f"{name + ' on ' + str(nodes):<34} no pipeline")
            continue
        cluster = Cluster.build(load_profile(plan.hardware), plan.nodes)
        tables = BlockTables(load_model(plan.model), cluster, plan.workload,
                             device(cluster.profile, plan.workload.precision))
        fwd, bwd, _ = chunk_times(tables, c, plan.partition)
        m, v = c.grad_accum, c.virtual_stages
        dual = plan.workload.pp_schedule == "dualpipev"
        g = microbatch_group(c.pp, m) if v > 1 and not dual else c.pp
        times = formula_and_replay(tables, c, plan.partition)
        if times is None:
            print(f"{name + ' on ' + str(nodes):<34} schedule too long to replay")
            continue
        model_s, replay_s = times
        totals = [(sum(f) + sum(b)) * 1e3 for f, b in zip(fwd, bwd)]
        err = model_s / replay_s - 1
        errors.append(err)
        label = f"{name} on {nodes}" + (f", batch {gb}" if gb else "")
        layout = f"pp {c.pp}" + (" DualPipeV" if dual else f" x v {v}" if v > 1 else " (1F1B)")
        group = g if v > 1 and not dual else "-"
        print(f"{label:<34} {layout:<16} {m:>4} {group:>3} {min(totals):>8.1f}-{max(totals):<8.1f} "
              f"{model_s:>9.3f} {replay_s:>9.3f} {err:>+13.2%}")
    print(f"model vs replay: {min(errors):+.2%} to {max(errors):+.2%} over {len(errors)} pipelined plans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
