"""The fast path (bounds + branch and bound + the array cost model) ranks first the plan that an
exhaustive scalar search ranks first: the scalar oracle (tests/scalar_oracle.py) called on
every candidate of the space."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost.activation_offload import AUTO
from planner.cost.parallel import FRAMEWORKS, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.bounds import lower_bounds
from planner.search.context_splits import context_splits
from planner.search.evaluate import evaluate_keys
from planner.search.expert_tp import expert_tp_choices
from planner.search.request import candidate_space
from planner.search.space import Constraints
from planner.search.suggest import _scalar_key, suggest
from tests.scalar_oracle import oracle_estimate
from tests.search_cases import case_of, prepared

CASES = [
    # (model, nodes, global batch, seq, constraints, objective)
    ("gpt3-350m", 1, 64, 2048, Constraints(micro_batch=(2,), virtual_stages=(1, 2), recompute=("none", "full")),
     "throughput"),
    ("llama-3.1-8b", 2, 64, 4096, Constraints(tp=(2, 4, 8), pp=(1, 2), micro_batch=(1,), recompute=("none", "full")),
     "throughput"),
    ("deepseek-vl2-tiny", 1, 32, 4096, Constraints(micro_batch=(1,), recompute=("none", "full"), zero=(1, 3),
                                                   virtual_stages=(1,)), "throughput"),
    ("llama-3.1-8b", 1, 32, 8192, Constraints(micro_batch=(1,), virtual_stages=(1,), recompute=("full",),
                                              zero=(0, 1, 3)), "memory"),
    ("llama-3.1-8b", 1, 32, 8192, Constraints(micro_batch=(1,), virtual_stages=(1,), recompute=("selective",)), "cost"),
    # a 30-minute MTBF: checkpoint stalls and restarts weigh, and the runtimes' save layouts differ
    ("llama-3.1-8b", 2, 64, 4096, Constraints(tp=(1, 2, 8), pp=(1, 2), micro_batch=(1,), recompute=("none", "full")),
     "goodput"),
    # 36 samples: micro-batch counts pp does not divide (9 on pp 2, 18 on pp 4, 36 on pp 8), which
    # interleave with a larger micro-batch group, over 1 to 6 virtual stages of 24 layers.
    ("gpt3-350m", 1, 36, 2048, Constraints(micro_batch=(1,), virtual_stages=(1, 2, 3, 4, 6), framework=("megatron",),
                                           recompute=("none", "selective")), "throughput"),
]


@pytest.mark.parametrize(("name", "nodes", "gb", "seq", "cons", "objective"), CASES)
def test_fast_path_ranks_first_what_exhaustive_search_ranks_first(name, nodes, gb, seq, cons, objective) -> None:
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    images, tiles = (1, 2) if model.is_vlm else (0, 0)
    mtbf = 0.5 if objective == "goodput" else None
    workload = Workload(global_batch=gb, seq_len=seq, images_per_sample=images, tiles_per_image=tiles, mtbf_hours=mtbf)
    fast = suggest(model, nodes=nodes, global_batch=gb, seq_len=seq, images_per_sample=images if model.is_vlm else None,
                   tiles_per_image=tiles if model.is_vlm else None, constraints=cons, objective=objective, top=1,
                   mtbf_hours=mtbf)

    # Exhaustive: every candidate of every context-parallel split and expert-TP choice the search
    # tries through the scalar oracle, with the balancer's partition.
    plans, evaluated = [], 0
    searches = [(split, etp) for split in context_splits(cons, model, seq, True, cluster.num_gpus)
                for etp in expert_tp_choices(cons, model)]
    for split, (etp, tp1) in searches:
        space = candidate_space(model, cluster, workload, cons, cp=split, etp=etp, tp1=tp1)
        case = case_of(model, cluster, workload, space)
        res = evaluate_keys(case.p, case.ks)
        evaluated += len(space)
        for j, i in enumerate(res.rows):
            plan = oracle_estimate(model, cluster, workload, space.config(int(i)),
                                   partition=case.p.splits.all[res.split_id[j]],
                                   auto_offload=space.columns["aoff"][i] == AUTO)
            if plan.fits:
                plans.append(plan)
    assert plans, "the case must have plans that fit"
    best = min(plans, key=lambda p: _scalar_key(objective, p, cluster.num_gpus))
    got = fast.plans[0].plan
    # Equal up to summation order (the array model and the scalar walk add the same terms differently).
    assert _scalar_key(objective, got, cluster.num_gpus) == pytest.approx(
        _scalar_key(objective, best, cluster.num_gpus), rel=1e-12)
    if objective != "cost":
        assert got.to_json()["step_time_s"] == pytest.approx(best.step_time_s, rel=1e-12)
    assert fast.evaluated == evaluated


def test_pruning_actually_prunes() -> None:
    res = suggest("llama-3.1-8b", nodes=2, global_batch=64, seq_len=4096, top=1)
    assert res.pruned > 0
    assert res.fully_evaluated + res.pruned < res.evaluated or res.rejected["out_of_memory"] > 0


@pytest.mark.parametrize(("name", "nodes", "cons"), [
    ("llama-3.1-8b", 2, Constraints(micro_batch=(1, 2), virtual_stages=(1, 2))),
    ("deepseek-vl2-tiny", 1, Constraints(micro_batch=(1,), virtual_stages=(1,))),
    ("mixtral-8x7b", 2, Constraints(micro_batch=(1,), recompute=("full",), virtual_stages=(1,))),
])
def test_lower_bounds_never_exceed_any_candidates_evaluation(name, nodes, cons) -> None:
    """Every candidate's time and memory bounds (compute, pipeline, optimizer step) are at or
    below its full evaluation: ZeRO 0-3, offloads, pipelines, interleaving, experts."""
    case = prepared(name, nodes, cons)
    space = case.space
    time_lb, mem_lb = lower_bounds(case.p, case.ks)
    res = evaluate_keys(case.p, case.ks)
    rows = res.rows
    assert len(rows) == len(space) > 300
    c = space.columns
    # DeepSpeed's MoE layers refuse ZeRO-3; Megatron-FSDP (megatron, ZeRO-3) shards Megatron-Core's
    assert set(c["zero"][rows].tolist()) == {0, 1, 2, 3}
    if case.model.is_moe:
        assert set(c["framework"][rows][c["zero"][rows] == 3].tolist()) == {FRAMEWORKS.index("megatron")}
    assert (c["offload"][rows] > 0).any() and (c["pp"] > 1).any()
    assert np.all(time_lb[rows] <= res.step_time * (1 + 1e-12))
    assert np.all(mem_lb[rows] <= res.peak_bytes * (1 + 1e-12))
    # The optimizer term makes the bound bite: within 10% of the step somewhere.
    assert np.any(time_lb[rows] >= 0.9 * res.step_time)


def test_gather_bound_is_the_mean_ranks_exposed_weight_gather() -> None:
    """The exposed ZeRO-1/2 all-gather bound: for runtimes that do not hide it (DeepSpeed
    engines, Megatron-DeepSpeed) the all-gather of the mean rank's 16-bit weights over the DP
    group, at or below the slowest rank's exposed DP time in full evaluation; zero where
    Megatron hides it behind the first forward, and for ZeRO-0/3."""
    from planner.cost.collectives import collective_time
    from planner.cost.layout import layout
    from planner.search.bounds import base_bounds, gather_bound
    from planner.search.evaluate import evaluate_rows

    case = prepared("llama-3.1-8b", 4, Constraints(tp=(2,), pp=(4,), micro_batch=(1,), virtual_stages=(1,),
                                                    recompute=("none",), offload=("none",)))
    space = case.space
    c = space.columns
    _, _, dense, expert = base_bounds(case.p, case.ks)
    bound = gather_bound(case.p.ctx, c, dense, expert)
    megatron = c["framework"] == 2
    z12 = (c["zero"] == 1) | (c["zero"] == 2)
    assert (z12 & ~megatron).any() and (z12 & megatron).any()
    assert np.all(bound[megatron | ~z12] == 0.0)
    i = int(np.flatnonzero(z12 & ~megatron)[0])
    dp_shape = layout(case.cluster, 2, 1, int(c["dp"][i]), 4).dp
    expected = collective_time(case.cluster, "allgather", dp_shape, 2 * dense[i] / 4).time_s
    assert bound[i] == pytest.approx(expected, rel=1e-8) and expected > 1e-3
    # At or below what the full evaluation exposes on its slowest DP rank
    rows = np.flatnonzero(z12 & ~megatron).tolist()
    from planner.search.evaluate import candidate_details

    details = candidate_details(case.p, case.ks, rows, {}, {})
    assert np.all(bound[rows] <= [d.asm.dp[d.n].max() for d in details])
    assert evaluate_rows(case.p, case.ks, rows[:1], {})[rows[0]][0] > bound[rows[0]]


def test_spread_bound_counts_units_per_rank() -> None:
    """Some rank holds ceil(j / pp) of the j largest units: five equal units over two ranks
    take three units' time (S / pp says 2.5), and one large unit bounds a deep pipeline
    (5 over four ranks, where S / pp says 2.5)."""
    from planner.search.bounds import spread_bound

    units = np.array([[2.0, 2.0, 2.0, 2.0, 2.0, 0.0], [5.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = spread_bound(units, np.array([2, 4]))
    assert got == pytest.approx([6.0, 5.0], rel=1e-8)
    assert np.all(got < [6.0, 5.0])  # shaded below, so rounding never lifts it over the exact rank time


def test_spread_bound_binds_where_one_unit_outweighs_a_stage() -> None:
    """DeepSeek-VL2-tiny in 8 stages: its largest unit outweighs S / pp, and the time bound
    uses it (still below every candidate's evaluation: the soundness test above)."""
    from planner.search.bounds import base_bounds

    case = prepared("deepseek-vl2-tiny", 1, Constraints(pp=(8,), tp=(1,), micro_batch=(1,), virtual_stages=(1,),
                                                        recompute=("none",), zero=(1,), offload=("none",),
                                                        framework=("megatron",)))
    p, ks = case.p, case.ks
    time_lb, _, _, _ = base_bounds(p, ks)
    res = evaluate_keys(p, ks)
    rows = res.rows
    key = ks.key(0)
    pp = key.pp
    costs = p.splits.unit_costs(p.table(ks, key), key.recompute, key.micro_batch)
    assert max(costs) > sum(costs) / pp  # the case is one where the largest unit binds
    m = int(case.space.columns["grad_accum"][rows[0]])
    assert np.all(time_lb[rows] >= (m - 1) * max(costs) * (1 - 1e-6))
    assert np.all(time_lb[rows] <= res.step_time * (1 + 1e-12))


def test_with_the_overlaps_off_the_bounds_take_the_whole_collectives_and_still_hold() -> None:
    """A workload that turns the TP and EP overlaps off has every runtime pay those collectives
    whole, so the time bound takes them whole too (it took the overlapped ones, which left most
    MoE candidates within reach of the best and priced in full): still at or below every
    candidate's evaluation, and above the bound the overlapped seconds give."""
    from planner.search.evaluate import Pricing
    from tests.search_cases import group_by_key

    model = load_model("mixtral-8x7b")
    cluster = Cluster.build(load_profile("dgx-h100"), 2)
    cons = Constraints(micro_batch=(1,), recompute=("none",), virtual_stages=(1,), framework=("megatron",))
    bounds = {}
    for overlap in (True, False):
        workload = Workload(global_batch=64, seq_len=4096, ep_comm_overlap=overlap, tp_comm_overlap=overlap)
        space = candidate_space(model, cluster, workload, cons)
        p = Pricing.of(model, cluster, workload, "optimal")
        ks = group_by_key(space)
        time_lb, _ = lower_bounds(p, ks)
        bounds[overlap] = time_lb
        if not overlap:
            res = evaluate_keys(p, ks)
            assert len(res.rows) > 100 and (space.columns["ep"][res.rows] > 1).any()
            assert np.all(time_lb[res.rows] <= res.step_time * (1 + 1e-12))
    assert np.all(bounds[False] >= bounds[True] * (1 - 1e-12)) and np.any(bounds[False] > 1.05 * bounds[True])
