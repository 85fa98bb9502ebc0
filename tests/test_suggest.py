"""suggest(): the array cost model agrees with the scalar oracle (tests/scalar_oracle.py) and with
estimate, returned plans are estimate's Plans, ranking, balancers, nothing-fits advice and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost.activation_offload import AUTO
from planner.cost.estimate import estimate
from planner.cost.parallel import Workload
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.evaluate import evaluate_keys
from planner.search.partition import greedy_partition
from planner.search.request import candidate_space
from planner.search.space import Constraints
from planner.search.splits import pipeline_units
from planner.search.suggest import NoPlanFits, suggest
from tests.scalar_oracle import oracle_estimate
from tests.search_cases import case_of


def _twin_vs_estimate(name: str, nodes: int, gb: int, seq: int, images: int = 0, tiles: int = 0,
                      profile: str = "dgx-a100-80g") -> int:
    model = load_model(name)
    cluster = Cluster.build(load_profile(profile), nodes)
    workload = Workload(global_batch=gb, seq_len=seq, images_per_sample=images, tiles_per_image=tiles)
    space = candidate_space(model, cluster, workload, Constraints())
    case = case_of(model, cluster, workload, space)
    res = evaluate_keys(case.p, case.ks)
    rows = res.rows
    c = {k: v[rows] for k, v in space.columns.items()}
    # One candidate per (framework, zero, offload, recompute, pp>1, vs>1, sp, ep>1) stratum.
    strata = np.column_stack([c["framework"], c["zero"], c["offload"], c["recompute"], c["pp"] > 1, c["vs"] > 1,
                              c["sp"], c["ep"] > 1])
    _, first = np.unique(strata, axis=0, return_index=True)
    for j in first:
        cfg = space.config(int(rows[j]))
        split = case.p.splits.all[res.split_id[j]]
        oracle = oracle_estimate(model, cluster, workload, cfg, partition=split, auto_offload=c["aoff"][j] == AUTO)
        cfg = oracle.cfg  # with the activation offload the search chose, if any
        assert res.step_time[j] == pytest.approx(oracle.step_time_s, rel=1e-9), cfg
        assert res.peak_bytes[j] == pytest.approx(oracle.memory.peak, rel=1e-9), cfg
        if cfg.offload != "none":
            assert res.cpu_bytes[j] == pytest.approx(oracle.cpu_bytes_per_node, rel=1e-9), cfg
        assert bool(res.fits[j]) == oracle.fits, cfg
        _same_plan(oracle.to_json(), estimate(model, cluster, workload, cfg, partition=split).to_json())
    return len(first)


def test_search_equals_oracle_dense() -> None:
    strata = _twin_vs_estimate("llama-3.1-8b", 2, 64, 4096)
    assert strata > 40  # every framework, ZeRO stage, offload, recompute, pipeline shape


def test_search_equals_oracle_on_hopper() -> None:
    """Hopper's lower FlashAttention level (gpu.flash_attention_efficiency) reaches both."""
    assert _twin_vs_estimate("llama-3.1-8b", 2, 64, 8192, profile="dgx-h100") > 40


def test_search_equals_oracle_moe_vision() -> None:
    strata = _twin_vs_estimate("deepseek-vl2-tiny", 2, 64, 4096, images=1, tiles=2)
    assert strata > 60


def test_returned_plans_are_estimates_and_ranked() -> None:
    res = suggest("llama-3.1-8b", nodes=2, top=4, global_batch=128)
    model = load_model("llama-3.1-8b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    assert len(res.plans) == 4 and [p.id for p in res.plans] == [1, 2, 3, 4]
    tps = [p.plan.tokens_per_s for p in res.plans]
    assert tps == sorted(tps, reverse=True)
    for rp in res.plans:
        again = estimate(model, cluster, rp.plan.workload, rp.plan.cfg, partition=rp.plan.partition)
        _same_plan(again.to_json(), rp.plan.to_json())
        oracle = oracle_estimate(model, cluster, rp.plan.workload, rp.plan.cfg, partition=rp.plan.partition)
        _same_plan(oracle.to_json(), rp.plan.to_json())
        assert rp.plan.fits
    # Every candidate is either evaluated in full, pruned by the time bound, or proven out of
    # memory by the memory bound (counted with out_of_memory).
    bounded_oom = res.evaluated - res.fully_evaluated - res.pruned
    assert bounded_oom >= 0 and res.rejected["out_of_memory"] >= bounded_oom
    assert res.why and "beats" in res.why


def _same_plan(a, b, path: str = "") -> None:
    """Equal structure and values (floats to 1e-9: the oracle sums in another order)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same_plan(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for j, (x, y) in enumerate(zip(a, b)):
            _same_plan(x, y, f"{path}[{j}]")
    elif isinstance(a, float) and not isinstance(b, bool):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


@pytest.mark.parametrize(("name", "nodes", "cons"), [
    ("vl2", 2, Constraints(pp=(2, 4), zero=(1,), recompute=("full",))),
    ("llama-3.1-8b", 2, Constraints(zero=(3,), offload=("optimizer",))),
    ("gpt3-350m", 1, Constraints(pp=(2,), virtual_stages=(2,), framework=("megatron",))),
    ("deepseek-vl2-tiny", 1, Constraints(ep=(2,), offload=("optimizer",), zero=(2,))),
])
def test_plans_equal_estimate_across_shapes(name: str, nodes: int, cons: Constraints) -> None:
    res = suggest(name, nodes=nodes, top=2, constraints=cons)
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    for rp in res.plans:
        again = oracle_estimate(model, cluster, rp.plan.workload, rp.plan.cfg, partition=rp.plan.partition)
        _same_plan(again.to_json(), rp.plan.to_json())


def test_json_has_the_issue_keys() -> None:
    res = suggest("llama-3.1-8b", nodes=1, top=2, constraints=Constraints(pp=(2,)))
    data = res.to_json()
    assert set(data) >= {"plans", "evaluated", "rejected"}
    assert set(data["rejected"]) == {"out_of_memory", "indivisible", "framework"}
    plan = data["plans"][0]
    for key in ("id", "dp", "tp", "pp", "ep", "zero_stage", "offload", "micro_batch", "grad_accum", "recompute",
                "balancer_bottleneck_s", "fits", "memory", "step_time_s", "time", "tokens_per_s", "tflops_per_gpu",
                "mfu", "stages"):
        assert key in plan
    b = plan["balancer_bottleneck_s"]
    assert b["optimal"] <= b["greedy"] + 1e-12


def test_memory_objective_ranks_by_peak() -> None:
    res = suggest("llama-3.1-8b", nodes=1, top=3, objective="memory")
    peaks = [p.plan.memory.peak for p in res.plans]
    assert peaks == sorted(peaks)
    fastest = suggest("llama-3.1-8b", nodes=1, top=1)
    assert res.plans[0].plan.memory.peak <= fastest.plans[0].plan.memory.peak


def test_greedy_balancer_is_used_when_asked() -> None:
    model = load_model("deepseek-vl2-tiny")
    cons = Constraints(pp=(4,), tp=(1,), framework=("megatron",), virtual_stages=(1,), recompute=("full",))
    res = suggest(model, nodes=1, top=1, constraints=cons, balancer="greedy")
    plan = res.plans[0].plan
    cfg = plan.cfg
    assert cfg.pp == 4
    # Rebuild greedy's partition from the per-block costs at this plan's settings.
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    from planner.search.evaluate import Pricing

    table = Pricing.of(model, cluster, plan.workload, "greedy").tables.table(cfg.tp, int(cfg.sequence_parallel), cfg.ep,
                                                                            (cfg.micro_batch,))
    per_block = table.total(2, table.b_index(cfg.micro_batch))  # recompute "full"
    units = pipeline_units(model)
    unit_costs = [float(per_block[a:e].sum()) for a, e in units]
    g = greedy_partition(unit_costs, 4)
    starts = [units[sum(g.counts[:k])][0] for k in range(4)]
    assert [a for a, _ in plan.partition] == starts
    b = res.plans[0].balancer_bottleneck_s
    assert b["greedy"] == pytest.approx(g.bottleneck, rel=1e-12)
    assert b["optimal"] <= b["greedy"]

def test_vl2_pipelined_plans_show_both_bottlenecks() -> None:
    res = suggest("vl2", nodes=2, top=3, constraints=Constraints(pp=(4,)))
    for rp in res.plans:
        b = rp.balancer_bottleneck_s
        assert 0 < b["optimal"] <= b["greedy"]


def test_nothing_fits_gives_closest_and_advice() -> None:
    with pytest.raises(NoPlanFits) as info:
        suggest("llama-3.1-70b", nodes=1, constraints=Constraints(tp=(8,), zero=(0,), framework=("megatron",)))
    err = info.value
    assert isinstance(err, UserError)
    res = err.result
    assert res.closest is not None and not res.closest.fits
    assert "short" in str(err) and "closest" in str(err)
    # Megatron offloads its optimizer itself (bf16): the advice keeps the framework.
    assert "optimizer offload (offload optimizer)" in res.advice
    assert any("nodes" in a for a in res.advice)
    # In fp16 it cannot: the advice names the framework change that offloading then needs (on two
    # nodes: DeepSpeed's 18 host bytes per parameter, x1.5 pinned, need 1.73 TiB on one node's
    # 1.70 usable, 0.87 TiB per node on two).
    with pytest.raises(NoPlanFits) as info:
        suggest("llama-3.1-70b", nodes=2, precision="fp16",
                constraints=Constraints(tp=(8,), zero=(0,), framework=("megatron",)))
    assert "optimizer offload on DeepSpeed (offload optimizer framework deepspeed)" in info.value.result.advice


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 0}, "nodes: need a whole number >= 1"),
        ({"nodes": -2}, "nodes: need a whole number >= 1"),
        ({"nodes": 1, "constraints": Constraints(tp=(3,))}, "tp 3 cannot divide"),
        ({"nodes": 1, "constraints": Constraints(ep=(2,))}, "dense"),
        ({"nodes": 1, "global_batch": 7, "constraints": Constraints(dp=(2, 4, 8))}, "global_batch 7"),
        ({"nodes": 1, "constraints": Constraints(tp=(8,), pp=(8,))}, "exclude every plan"),
        ({"nodes": 1, "seq_len": 10**7}, "seq_len 10000000 exceeds"),
        ({"nodes": 1, "objective": "speed"}, "objective: use one of"),
    ],
)
def test_bad_input_is_a_user_error(kwargs: dict, needle: str) -> None:
    with pytest.raises(UserError) as info:
        suggest("llama-3.1-8b", **kwargs)
    assert needle in str(info.value) and "--" not in str(info.value)  # API keywords, not CLI flags


def test_identical_predictions_under_two_runtimes_are_one_row() -> None:
    """DeepSpeed and Megatron-DeepSpeed price a plain ZeRO layout the same: one row, the
    simpler runtime first, the other listed; the top K holds K distinct predictions."""
    cons = Constraints(tp=(1,), pp=(1,), ep=(1,), zero=(1, 2), offload=("none",), recompute=("none", "full"),
                       framework=("deepspeed", "megatron-deepspeed"))
    res = suggest("llama-3.1-8b", nodes=1, top=3, global_batch=64, constraints=cons)
    keys = [(p.plan.cfg.zero_stage, p.plan.cfg.micro_batch, p.plan.cfg.recompute, p.plan.step_time_s,
             p.plan.memory.peak) for p in res.plans]
    assert len(set(keys)) == len(keys) == 3
    collapsed = [p for p in res.plans if p.also_runs_on]
    assert collapsed, "some layout must predict identically under both runtimes"
    for rp in collapsed:
        assert rp.plan.cfg.framework == "deepspeed" and rp.also_runs_on == ["megatron-deepspeed"]
        assert rp.to_json()["also_runs_on"] == ["megatron-deepspeed"]
        twin = rp.plan.cfg.model_copy(update={"framework": "megatron-deepspeed"})
        model = load_model("llama-3.1-8b")
        cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
        again = estimate(model, cluster, rp.plan.workload, twin, partition=rp.plan.partition)
        assert again.step_time_s == pytest.approx(rp.plan.step_time_s, rel=1e-9)
        assert again.memory.peak == pytest.approx(rp.plan.memory.peak, rel=1e-9)
    # The explanation names the time parts that differ and the memory trade.
    assert "beats" in res.why and ("less" in res.why or "tie-break" in res.why) and "memory" in res.why


def test_layouts_with_uneven_groups_are_left_out() -> None:
    """384 GPUs admit dp 3 x tp 4, whose DP groups (ranks 0, 4, 8) put two ranks on one node
    and one on the next: the collective model has no shape for that, so the space leaves such
    layouts out (counted as indivisible) instead of failing the whole search."""
    from planner.cost.layout import Layout

    model = load_model("qwen2.5-72b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 48)
    space = candidate_space(model, cluster, Workload(global_batch=1536, seq_len=2048), Constraints())
    c = space.columns
    layouts = {(int(c["tp"][i]), int(c["ep"][i]), int(c["dp"][i]), int(c["pp"][i])) for i in range(len(space))}
    for tp, ep, dp, pp in layouts:  # every shape of every layout can be priced
        shapes = Layout(cluster, tp, ep, dp, pp)
        assert shapes.tp and shapes.ep and shapes.edp and shapes.pp and shapes.dp
    assert not any(dp == 3 and tp == 4 for tp, _, dp, _ in layouts)
    assert any(dp == 6 and tp == 4 for tp, _, dp, _ in layouts)  # ranks 0, 4, ..., 20: two on each of 3 nodes
    result = suggest(model, nodes=48)
    assert result.plans and result.rejected["indivisible"] > 0


def test_progress_reports_rising_fractions_that_end_at_one() -> None:
    seen: list[float] = []
    suggest("deepseek-v3", nodes=16, progress=seen.append)
    assert len(seen) >= 2 and seen[-1] == 1.0
    assert all(0.0 < a <= b <= 1.0 for a, b in zip(seen, seen[1:]))


@pytest.mark.parametrize("objective", ["throughput", "memory"])
def test_every_plan_says_why_it_ranks_below_the_best(objective) -> None:
    """Each plan after #1 carries one line: how its configuration differs from #1's, what it
    gives up in the ranked quantity (the figure recomputed here from the plans' own numbers)
    and the other quantity; #1 carries the winner's line."""
    res = suggest("llama-3.1-70b", nodes=8, top=5, objective=objective)
    best = res.plans[0]
    assert best.why == res.why and best.to_json()["why"] == res.why
    b = best.plan.to_json()
    for rp in res.plans[1:]:
        p = rp.plan.to_json()
        diff = [k for k in ("dp", "tp", "pp", "ep", "zero_stage", "offload", "micro_batch", "grad_accum", "recompute",
                            "sequence_parallel", "virtual_stages", "framework") if p[k] != b[k]]
        assert rp.to_json()["why"] == rp.why
        for k in diff:  # each difference named, this plan's value first
            assert f"{k} {p[k]} vs {b[k]}" in rp.why, (k, rp.why)
        if objective == "throughput":
            lost = 1 - p["tokens_per_s"] / b["tokens_per_s"]
            assert lost >= 0
            if lost >= 5e-4:
                assert f"{lost:.1%} fewer tokens/s (" in rp.why, rp.why
        else:
            extra = (p["memory"]["peak_bytes"] - b["memory"]["peak_bytes"]) / 2**30
            assert extra >= 0
            if extra > 1e-6:
                assert f"{extra:.2f} GiB more peak memory (" in rp.why, rp.why
                assert "tokens/s" in rp.why


def test_why_behind_names_what_settles_a_tie() -> None:
    """Equal tokens/s: the order comes from peak memory, then the tie-break; the line says so."""
    from planner.search.rank import why_behind

    gib = 2**30
    base = {"dp": 8, "tp": 1, "pp": 1, "ep": 1, "zero_stage": 3, "offload": "none", "micro_batch": 1, "grad_accum": 8,
            "recompute": "none", "sequence_parallel": False, "virtual_stages": 1, "framework": "deepspeed",
            "tokens_per_s": 1000.0, "time": {"compute_s": 1.0}, "memory": {"peak_bytes": 60 * gib}}
    more_memory = {**base, "zero_stage": 2, "memory": {"peak_bytes": 70 * gib}}
    line = why_behind(base, more_memory, "throughput")
    assert line.startswith("zero_stage 2 vs 3: equal tokens/s; ranks lower on more peak memory")
    assert "70.0 vs 60.0 GiB" in line
    same = {**base, "framework": "megatron"}
    assert "tie-break" in why_behind(base, same, "throughput")
    slower = {**base, "tokens_per_s": 999.9, "time": {"compute_s": 1.0001}}
    assert "0.01% fewer tokens/s (" in why_behind(base, slower, "throughput")  # never rounds to 0.0%


def test_cost_objective_breaks_equal_costs_by_host_memory_then_gpu_memory() -> None:
    """--objective cost: GPU-hours per token first (1 / tokens/s on a fixed cluster); equal
    costs go to the plan that keeps fewer bytes in host memory (offload), then less GPU memory."""
    from planner.search.rank import _TIE_COLUMNS, order, why_behind

    cols = {c: np.zeros(4, dtype=int) for c in _TIE_COLUMNS}
    tps = np.array([100.0, 100.0, 100.0, 120.0])
    host = np.array([2e11, 1e11, 1e11, 5e11])
    peak = np.array([50e9, 70e9, 60e9, 79e9])
    # 3 is cheapest; of the equal three, 1 and 2 hold less in host memory, and 2 less on the GPU.
    assert list(order("cost", cols, tps, peak, host, 8)) == [3, 2, 1, 0]
    plan = {"zero_stage": 2, "tokens_per_s": 100.0, "time": {},
            "memory": {"peak_bytes": 70 * 2**30, "cpu_bytes_per_node": 100 * 2**30}}
    heavier = {**plan, "zero_stage": 1, "memory": {"peak_bytes": 50 * 2**30, "cpu_bytes_per_node": 200 * 2**30}}
    assert ("equal tokens/s; ranks lower on more host memory for offload (200.0 vs 100.0 GiB per node); "
            "peak memory 50.0 vs 70.0 GiB" in why_behind(plan, heavier, "cost"))

    # On one DGX, llama-3.1-8b's ZeRO-1 and ZeRO-2 optimizer-offload plans run at identical
    # tokens/s and pin the same 18 bytes per parameter on the host: GPU memory decides. (DeepSpeed's:
    # Megatron-FSDP's plans, tied among themselves over cp, would fill the top five.)
    res = suggest("llama-3.1-8b", nodes=1, top=5, objective="cost",
                  constraints=Constraints(virtual_stages=(1, 2, 4), framework=("deepspeed", "megatron-deepspeed")))
    keys = [(round(1 / p.plan.tokens_per_s, 15), p.plan.cpu_bytes_per_node, p.plan.memory.peak) for p in res.plans]
    assert keys == sorted(keys)
    tied = [(a, b) for a, b in zip(res.plans, res.plans[1:]) if a.plan.tokens_per_s == b.plan.tokens_per_s]
    assert [(a.plan.cfg.zero_stage, b.plan.cfg.zero_stage) for a, b in tied] == [(2, 1)]
    for a, b in tied:
        assert a.plan.cpu_bytes_per_node == b.plan.cpu_bytes_per_node and a.plan.memory.peak < b.plan.memory.peak
        # compared with each other (each row's own line compares it with #1), the tie is named
        line = why_behind(a.plan.to_json(), b.plan.to_json(), "cost")
        assert "zero_stage 1 vs 2: equal tokens/s and host memory; ranks lower on more peak memory" in line
    assert any("more GPU-hours per token (" in p.why for p in res.plans[1:])


@pytest.mark.parametrize(("name", "nodes", "kwargs", "part"), [
    # cp 1: context parallelism would give the same GPUs more micro-batches per pipeline
    ("llama-3.1-405b", 2048, {"constraints": Constraints(cp=(1,))}, "pp_bubble"),  # 512 samples on 16,384 GPUs
    ("llama-3.1-70b", 64, {"constraints": Constraints(pp=(8,), virtual_stages=(2,), cp=(1,)), "global_batch": 64},
     "pp_bubble"),
    # dp 2048, one micro-batch: the all-reduce hides behind one backward (without a pipeline,
    # which gives the same GPUs a faster layout that is bubble-bound instead)
    ("gpt3-13b", 1024, {"constraints": Constraints(pp=(1,))}, "dp_comm"),
])
def test_a_batch_bound_best_plan_gets_a_note_with_a_batch_that_fixes_it(name, nodes, kwargs, part) -> None:
    """When the pipeline bubble or the exposed DP traffic is most of the best plan's step, a
    note says so and names a global batch (a whole multiple of today's) that gives the same
    layout enough micro-batches; the cost model agrees: re-estimated with that batch, that
    part is under 20% of the step."""
    import re

    res = suggest(name, nodes=nodes, **kwargs)
    best = res.plans[0].plan
    assert getattr(best.time, part) / best.step_time_s > 0.25
    assert res.to_json()["notes"] == res.notes
    # The batch note; an interleaved best plan may also get the schedule check's (test_schedule_check.py).
    notes = [n for n in res.notes if not n.startswith("Megatron's interleaved schedule")]
    assert len(notes) == 1
    assert notes[0].startswith({"pp_bubble": "the pipeline bubble", "dp_comm": "exposed data-parallel"}[part])
    gb = int(re.search(r"global_batch (\d+)", notes[0]).group(1))
    assert gb % best.workload.global_batch == 0 and gb > best.workload.global_batch
    m = gb // (best.cfg.micro_batch * best.cfg.dp)
    cfg = best.cfg.model_copy(update={"grad_accum": m})
    again = estimate(load_model(name), Cluster.build(load_profile("dgx-a100-80g"), nodes),
                     best.workload.model_copy(update={"global_batch": gb}), cfg, partition=best.partition)
    assert getattr(again.time, part) / again.step_time_s < 0.2
    assert f"gives this layout {m} micro-batches and" in notes[0]


def test_no_note_when_the_batch_keeps_the_pipelines_and_reductions_busy() -> None:
    # a pipelined best plan (with TP overlap: pp 1; with context parallelism: Ulysses under ZeRO-3;
    # with ZeRO-3, Megatron-FSDP over TP 4, its gathers hidden under 8K-token micro-batches)
    res = suggest("llama-3.1-70b", nodes=8, tp_comm_overlap=False, constraints=Constraints(cp=(1,), zero=(0, 1, 2)))
    assert res.plans[0].plan.time.dp_comm / res.plans[0].plan.step_time_s < 0.25
    assert res.plans[0].plan.cfg.pp > 1 and res.plans[0].plan.time.pp_bubble / res.plans[0].plan.step_time_s < 0.25
    assert res.notes == []


def test_top_1_does_not_claim_to_be_the_only_plan() -> None:
    """With --top 1 there is no runner-up to compare with; the line says so instead of calling
    the plan the only one that fits, which only a single-candidate space earns."""
    assert suggest("vl2", nodes=1, top=1).why.startswith("ranked first (top 2 or more")
    one = Constraints(dp=(8,), tp=(1,), pp=(1,), zero=(3,), offload=("none",), micro_batch=(1,), recompute=("none",),
                      framework=("deepspeed",), sequence_parallel=(False,))
    res = suggest("llama-3.1-8b", nodes=1, top=1, constraints=one)
    assert res.evaluated == 1 and res.why == "the only plan that fits"


def test_no_batch_note_for_zero3_traffic_which_grows_with_the_batch() -> None:
    """ZeRO-3 gathers every layer's weights for each micro-batch: its exposed DP traffic grows
    with the micro-batches like compute does, so a bigger batch would not hide it."""
    from planner.cost.notes import batch_notes

    plan = {"step_time_s": 10.0, "pp": 1, "virtual_stages": 1, "grad_accum": 1, "micro_batch": 1, "dp": 64,
            "zero_stage": 1, "time": {"compute_s": 6.0, "dp_comm_s": 4.0}}
    note = batch_notes(plan, 4096)
    assert len(note) == 1 and note[0].startswith("exposed data-parallel communication is 40% of the step")
    # dp / (fixed + k grows) <= 1/5 with fixed 4 s and grows 6 s: k = 3 -> 192 samples
    assert "global_batch 192 " in note[0]
    assert batch_notes({**plan, "zero_stage": 3}, 4096) == []


def test_megatron_interleaves_layers_that_do_not_divide_into_the_chunks() -> None:
    """32 Llama layers over pp 4 x 3 virtual stages: 12 chunks of unequal size, which Megatron
    runs through its custom pipeline layout. The search plans them, and they are estimate's."""
    cons = Constraints(pp=(4,), virtual_stages=(3,), framework=("megatron",))
    res = suggest("llama-3.1-8b", nodes=2, top=2, constraints=cons)
    model = load_model("llama-3.1-8b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    decoders = [i for i, b in enumerate(model.blocks) if b.kind == "decoder"]
    for rp in res.plans:
        assert rp.plan.cfg.virtual_stages == 3 and rp.plan.cfg.pp == 4
        per_chunk = [sum(1 for i in decoders if a <= i < e) for a, e in rp.plan.partition]
        assert len(per_chunk) == 12 and sum(per_chunk) == 32 and len(set(per_chunk)) > 1
        again = estimate(model, cluster, rp.plan.workload, rp.plan.cfg, partition=rp.plan.partition)
        _same_plan(again.to_json(), rp.plan.to_json())


def test_vision_language_models_interleave_only_an_even_split() -> None:
    """Megatron's custom layout has no vision-encoder layers: DeepSeek-VL2-Tiny's 12 decoder
    layers interleave over pp 2 x 3 chunks, not pp 2 x 4."""
    cons = Constraints(pp=(2,), framework=("megatron",), micro_batch=(1,))
    ok = suggest("deepseek-vl2-tiny", nodes=1, top=1, global_batch=64,
                 constraints=Constraints(**{**cons.__dict__, "virtual_stages": (3,)}))
    assert ok.plans[0].plan.cfg.virtual_stages == 3
    with pytest.raises(UserError, match="their framework cannot run"):
        suggest("deepseek-vl2-tiny", nodes=1, top=1, global_batch=64,
                constraints=Constraints(**{**cons.__dict__, "virtual_stages": (4,)}))
    cfg = ok.plans[0].plan.cfg.model_copy(update={"virtual_stages": 4})
    model = load_model("deepseek-vl2-tiny")
    with pytest.raises(UserError, match="vision-language model needs its 12 decoder layers divisible"):
        estimate(model, Cluster.build(load_profile("dgx-a100-80g"), 1), ok.plans[0].plan.workload, cfg)


def test_megatron_interleaves_micro_batch_counts_pp_does_not_divide() -> None:
    """6 micro-batches per step on pp 4 x 2 virtual stages: Megatron-Core runs them with a
    micro-batch group of 6 (tests/test_interleaved_schedule.py), which holds more chunk
    activations in the warm-up than the default group of 4. The search plans them with that
    count, equal to estimate's; fewer micro-batches than pp cannot interleave at all."""
    cons = Constraints(pp=(4,), virtual_stages=(2,), framework=("megatron",), micro_batch=(1,), tp=(2,))
    res = suggest("llama-3.1-8b", nodes=1, top=3, global_batch=6, constraints=cons)
    model = load_model("llama-3.1-8b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    for rp in res.plans:
        cfg = rp.plan.cfg
        assert (cfg.pp, cfg.virtual_stages, cfg.grad_accum, cfg.dp) == (4, 2, 6, 1)
        # rank r holds min(2 (3 - r) + (2 - 1) x 6 + 1, 6 x 2) / 2 stages' worth of micro-batches
        # (the default group of 4 would give 5.5, 4.5, 3.5, 2.5)
        assert [s.inflight for s in rp.plan.stages] == [6.0, 5.5, 4.5, 3.5]
        again = estimate(model, cluster, rp.plan.workload, cfg, partition=rp.plan.partition)
        _same_plan(again.to_json(), rp.plan.to_json())
    with pytest.raises(UserError, match="their framework cannot run"):
        suggest("llama-3.1-8b", nodes=1, top=1, global_batch=3, constraints=cons)
    cfg = res.plans[0].plan.cfg.model_copy(update={"grad_accum": 3})
    workload = res.plans[0].plan.workload.model_copy(update={"global_batch": 3})
    with pytest.raises(UserError, match="needs at least pp 4 micro-batches per step, not 3"):
        estimate(model, cluster, workload, cfg)
