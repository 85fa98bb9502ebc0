"""Memory-aware rebalancing: pipelines whose time-balanced split runs out of memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.cost.estimate import estimate
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search import memfit
from planner.search.evaluate import evaluate_keys
from planner.search.request import candidate_space
from planner.search.space import Constraints
from planner.search.suggest import NoPlanFits, suggest
from tests.search_cases import case_of, evaluate_one, prepared

# DeepSeek-VL2 on one node, four pipeline stages, Megatron's distributed optimizer: the split
# that balances time runs a stage out of memory; moving layers fits them all.
CONS = Constraints(pp=(4,), micro_batch=(1,), recompute=("none",), zero=(1,), virtual_stages=(1,),
                   framework=("megatron",), offload=("none",))


def _rebalanced_is_estimates_and_its_time_split_does_not_fit(name: str, nodes: int, cons: Constraints, plan):
    """The rebalanced plan is estimate's own answer for its split (fits, same numbers), and the
    time-balanced split of the same configuration does not fit. Returns the full evaluation
    of the space and the plan's row in it."""
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    again = estimate(model, cluster, plan.workload, plan.cfg, partition=plan.partition)
    assert again.fits
    assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
    assert again.memory.peak == pytest.approx(plan.memory.peak, rel=1e-9)
    space = candidate_space(model, cluster, plan.workload, cons, cp=(plan.cfg.cp, plan.cfg.cp_comm))
    case = case_of(model, cluster, plan.workload, space)
    out = evaluate_keys(case.p, case.ks)
    same = [j for j, i in enumerate(out.rows) if space.config(int(i)) == plan.cfg]
    assert same and not out.fits[same[0]]
    time_split = case.p.splits.all[out.split_id[same[0]]]
    assert time_split != plan.partition
    assert not estimate(model, cluster, plan.workload, plan.cfg, partition=time_split).fits
    return out, same[0]


def test_time_balanced_split_runs_out_of_memory_but_a_rebalanced_one_fits(monkeypatch) -> None:
    res = suggest("vl2", nodes=1, constraints=CONS, top=1)
    rp = res.plans[0]
    plan = rp.plan
    assert plan.fits and plan.cfg.pp == 4
    # It is the estimate's own answer for that split: fits, same numbers.
    out, j = _rebalanced_is_estimates_and_its_time_split_does_not_fit("vl2", 1, CONS, plan)
    # The split it uses is slower per micro-batch than the time-optimal one: memory bought with time.
    b = rp.balancer_bottleneck_s
    assert b["optimal"] == pytest.approx(out.optimal_bottleneck[j], rel=1e-12)
    assert b["memory_constrained"] > b["optimal"]
    stage_times = [s.microbatch.total - s.microbatch.pp for s in plan.stages]  # what the balancer balances
    assert b["memory_constrained"] == pytest.approx(max(stage_times), rel=1e-6)
    # Without rebalancing nothing fits.
    monkeypatch.setattr(memfit, "MAX_REBALANCED", 0)
    with pytest.raises(NoPlanFits):
        suggest("vl2", nodes=1, constraints=CONS, top=1)


@pytest.mark.parametrize(("name", "cons"), [
    ("vl2", CONS),
    ("deepseek-vl2-tiny", Constraints(pp=(4,), micro_batch=(2,), recompute=("full",), zero=(0, 1), virtual_stages=(1,),
                                      framework=("megatron",), tp=(1,))),
    ("llama-3.1-8b", Constraints(pp=(4,), micro_batch=(1,), recompute=("selective",), zero=(1,), virtual_stages=(1,),
                                 framework=("megatron",), tp=(2,))),
])
def test_stage_memory_bounds_the_real_stage_peak_from_above(name: str, cons: Constraints) -> None:
    """Any split that fits StageMemory fits for real: the bound holds on many random splits."""
    case = prepared(name, 1, cons)
    model, cluster, wl, space = case.model, case.cluster, case.workload, case.space
    rng = np.random.default_rng(0)
    blocks = case.p.splits.units.blocks
    units = len(case.p.splits.units.ranges)
    checked = 0
    for i in range(len(space)):
        cfg = space.config(i)
        sm = memfit.stage_memory(case.p, case.ks, i)
        for _ in range(5):
            cuts = np.sort(rng.choice(np.arange(1, units), cfg.pp - 1, replace=False))
            counts = np.diff(np.concatenate(([0], cuts, [units])))
            parts = blocks(tuple(int(c) for c in counts))
            plan = estimate(model, cluster, wl, cfg, partition=parts)
            start = 0
            for s, c in enumerate(counts):
                bound = sm.stage_bytes(s, start, start + int(c))
                assert bound >= plan.stages[s].memory.peak * (1 - 1e-12), (cfg, parts, s)
                start += int(c)
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize(("name", "nodes", "cons"), [
    ("vl2", 1, replace(CONS, pp=(2, 4))),
    ("llama-3.1-8b", 1, Constraints(pp=(2, 4), micro_batch=(1, 2), recompute=("none", "selective"),
                                    virtual_stages=(1,), framework=("megatron", "deepspeed"))),
    ("deepseek-vl2-tiny", 1, Constraints(pp=(2, 4), virtual_stages=(1,), recompute=("none",))),
    # interleaved too (there B <= S / pp: the bound is the generic one, the 1F1B rows tighten it)
    ("llama-3.1-8b", 2, Constraints(pp=(2, 4), micro_batch=(1, 2), recompute=("none", "full"),
                                    virtual_stages=(1, 2, 3), framework=("megatron",))),
])
def test_split_time_bound_holds_for_every_split(name: str, nodes: int, cons: Constraints) -> None:
    """The bound that orders and stops the rebalancing (bounds.split_time_bound) is never above
    the step time of the time-optimal split, of the memory-limited one, or of random splits."""
    from planner.search.bounds import lower_bounds, split_time_bound

    case = prepared(name, nodes, cons)
    space, p, ks = case.space, case.p, case.ks
    out = evaluate_keys(p, ks)
    rows = out.rows
    pipelined = rows[space.columns["pp"][rows] > 1]
    bound = split_time_bound(p, ks, pipelined)
    time_lb, _ = lower_bounds(p, ks)
    step = dict(zip(rows.tolist(), out.step_time.tolist()))
    assert len(pipelined) >= 9
    assert np.all(bound >= time_lb[pipelined] * (1 - 1e-8))  # never looser than the generic bound
    assert np.any(bound > time_lb[pipelined] * 1.01)  # and tighter somewhere
    rng = np.random.default_rng(1)
    blocks = p.splits.units.blocks
    units = len(p.splits.units.ranges)
    for j, i in enumerate(pipelined.tolist()):
        assert bound[j] <= step[i]
        pp = int(space.columns["pp"][i]) * int(space.columns["vs"][i])  # chunks
        for _ in range(3):  # any other contiguous split is slower than the bound as well
            cuts = np.sort(rng.choice(np.arange(1, units), pp - 1, replace=False))
            counts = np.diff(np.concatenate(([0], cuts, [units])))
            assert bound[j] <= evaluate_one(case, i, blocks(tuple(int(c) for c in counts)))[0]
        mem = memfit.stage_memory(p, ks, i)
        key = ks.key_of(i)
        part = memfit.optimal_partition(p.splits.unit_costs(p.table(ks, key), key.recompute, key.micro_batch), pp,
                                        memory=mem)
        if part.fits:
            assert bound[j] <= evaluate_one(case, i, blocks(part.counts))[0]


@pytest.mark.parametrize(("name", "nodes", "top"), [("deepseek-v3", 128, 5), ("deepseek-v2", 32, 5), ("vl2", 1, 3)])
def test_skipping_pipelines_no_split_in_memory_can_bring_into_the_top_k_changes_no_plan(monkeypatch, name, nodes,
                                                                                      top) -> None:
    """rebalance skips a candidate when one pack proves no split within memory is fast enough
    to reach the K-th plan (partition.fits_within); with that test turned off (every candidate
    rebalanced in full), the same plans come back, and the test did skip some."""
    calls = {"full": 0}
    real = memfit.optimal_partition

    def counted(*args, **kwargs):
        calls["full"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(memfit, "optimal_partition", counted)
    fast = suggest(name, nodes=nodes, top=top)
    pruned_calls = calls["full"]
    monkeypatch.setattr(memfit, "fits_within", lambda *args: True)
    calls["full"] = 0
    full = suggest(name, nodes=nodes, top=top)
    assert calls["full"] > pruned_calls
    assert [p.to_json() for p in fast.plans] == [p.to_json() for p in full.plans]


@pytest.mark.parametrize(("name", "nodes"), [("vl2", 1), ("qwen2-vl-72b", 16)])
def test_memory_objective_rebalances_only_what_can_enter_the_top_k(monkeypatch, name, nodes) -> None:
    """Ranked by peak memory, a pipeline rebalanced under the memory limit still holds at
    least its memory bound, so only those whose bound is within the K-th plan's peak are
    rebalanced (it used to be every out-of-memory pipeline, up to the cap). The top 5 equal
    the first 5 of a search whose bar never closes (top = everything: all evaluated in full,
    every out-of-memory pipeline rebalanced up to the cap)."""
    calls = {"rows": 0}
    real = memfit.rebalance

    def counted(p, ks, rows, bar=float("inf")):
        calls["rows"] += len(rows)
        return real(p, ks, rows, bar)

    monkeypatch.setattr(memfit, "rebalance", counted)
    fast = suggest(name, nodes=nodes, objective="memory", top=5)
    fast_rows, calls["rows"] = calls["rows"], 0
    full = suggest(name, nodes=nodes, objective="memory", top=100_000)
    assert calls["rows"] > fast_rows
    assert [p.to_json() for p in fast.plans] == [p.to_json() for p in full.plans[:5]]


@pytest.mark.parametrize(("name", "nodes", "cons"), [
    ("vl2", 1, Constraints(pp=(2, 4, 8), virtual_stages=(1,), recompute=("none", "full"), micro_batch=(1, 2))),
    ("deepseek-vl2-tiny", 1, Constraints(pp=(2, 4, 8), virtual_stages=(1,))),
    ("llama-3.1-8b", 2, Constraints(pp=(4, 8, 16), virtual_stages=(1,), micro_batch=(1,), framework=("megatron",))),
    # interleaved: the ranks' in-flight counts of memory.inflight_array
    ("llama-3.1-8b", 2, Constraints(pp=(4, 8), virtual_stages=(2, 4), micro_batch=(1,), framework=("megatron",))),
])
def test_pipeline_memory_bound_holds_for_every_split_and_is_tighter(name: str, nodes: int, cons: Constraints) -> None:
    """The memory bound of pipelines (bounds._pipeline_held) is never above the peak of the
    time-balanced split or of random splits (so memory-limited rebalancing cannot beat it
    either), and it is far tighter than the mean-rank bound on deep pipelines, where the first
    rank keeps pp micro-batches in flight."""
    from planner.search.bounds import lower_bounds

    case = prepared(name, nodes, cons)
    space, p, ks = case.space, case.p, case.ks
    _, mem_lb = lower_bounds(p, ks)
    out = evaluate_keys(p, ks)
    rows = out.rows
    c = space.columns
    assert (c["pp"][rows] >= 8).any()
    assert np.all(mem_lb[rows] <= out.peak_bytes * (1 + 1e-12))
    rng = np.random.default_rng(2)
    blocks = p.splits.units.blocks
    units = len(p.splits.units.ranges)
    for i in rng.choice(rows, size=min(60, len(rows)), replace=False).tolist():
        chunks = int(c["pp"][i] * c["vs"][i])
        for _ in range(3):
            cuts = np.sort(rng.choice(np.arange(1, units), chunks - 1, replace=False))
            counts = np.diff(np.concatenate(([0], cuts, [units])))
            assert mem_lb[i] <= evaluate_one(case, i, blocks(tuple(int(x) for x in counts)))[1] * (1 + 1e-12)
    # Against the mean-rank bound alone (model states and the last rank's in-flight share).
    from planner.search import bounds

    monkey = bounds._pipeline_held
    try:
        bounds._pipeline_held = lambda ks, units, rows, *rest: np.zeros(len(rows))
        _, mean_rank = lower_bounds(p, ks)
    finally:
        bounds._pipeline_held = monkey
    deep = rows[c["pp"][rows] >= 8]
    assert np.all(mem_lb[deep] >= mean_rank[deep])
    assert np.any(mem_lb[deep] >= 1.3 * mean_rank[deep])
    peak = dict(zip(rows.tolist(), out.peak_bytes.tolist()))
    deep_peak = np.array([peak[i] for i in deep.tolist()])
    assert np.median(deep_peak / mean_rank[deep]) > 1.05 * np.median(deep_peak / mem_lb[deep])


def test_interleaved_stage_memory_bounds_each_rank_from_above() -> None:
    """Interleaved, StageMemory has one stage per chunk; 1/v of the sum over a rank's chunks
    bounds that rank's real peak, on random splits, so chunks that each fit make a rank fit.
    A global batch of 48 gives micro-batch counts pp does not divide (6 on pp 4), whose larger
    micro-batch group holds more in flight."""
    cons = Constraints(pp=(2, 4), virtual_stages=(2, 3), framework=("megatron",), micro_batch=(1, 2),
                       recompute=("none", "selective", "full"))
    case = prepared("llama-3.1-8b", 2, cons, global_batch=48)
    model, cluster, wl, space = case.model, case.cluster, case.workload, case.space
    rng = np.random.default_rng(2)
    units = len(case.p.splits.units.ranges)
    checked = odd = 0
    for i in rng.choice(len(space), 60, replace=False).tolist():
        cfg = space.config(i)
        pp, vs = cfg.pp, cfg.virtual_stages
        odd += cfg.grad_accum % pp != 0
        sm = memfit.stage_memory(case.p, case.ks, i)
        assert len(sm.inflight) == len(sm.base) == pp * vs
        cuts = np.sort(rng.choice(np.arange(1, units), pp * vs - 1, replace=False))
        bounds = np.concatenate(([0], cuts, [units]))
        plan = estimate(model, cluster, wl, cfg,
                        partition=case.p.splits.units.blocks(tuple(int(c) for c in np.diff(bounds))))
        for r in range(pp):
            rank_bound = sum(sm.stage_bytes(k, int(bounds[k]), int(bounds[k + 1])) for k in range(r, pp * vs, pp)) / vs
            assert rank_bound >= plan.stages[r].memory.peak * (1 - 1e-12), (cfg, r)
        checked += 1
    assert checked == 60 and odd >= 3


def test_interleaved_pipeline_rebalanced_within_memory(monkeypatch) -> None:
    """Llama-3.1-70B on 4 nodes, Megatron with 2 virtual stages and no recomputation: the
    time-balanced split of the fastest layout runs out of memory; a split that keeps every
    chunk within its share fits, ranks first, and is estimate's own answer for that split."""
    cons = Constraints(framework=("megatron",), virtual_stages=(2,), recompute=("none",))
    # Without TP overlap the fastest layout's time-balanced split runs out of memory (with it, another wins).
    res = suggest("llama-3.1-70b", nodes=4, constraints=cons, top=2, tp_comm_overlap=False)
    rp = res.plans[0]
    plan = rp.plan
    assert plan.fits and plan.cfg.virtual_stages == 2 and "memory_constrained" in rp.balancer_bottleneck_s
    _rebalanced_is_estimates_and_its_time_split_does_not_fit("llama-3.1-70b", 4, cons, plan)
    assert rp.balancer_bottleneck_s["memory_constrained"] > rp.balancer_bottleneck_s["optimal"]
    monkeypatch.setattr(memfit, "MAX_REBALANCED", 0)  # without rebalancing, the best plan left is slower
    assert suggest("llama-3.1-70b", nodes=4, constraints=cons, top=1,
                   tp_comm_overlap=False).plans[0].plan.tokens_per_s < plan.tokens_per_s


def test_megatrons_even_split_is_tried_where_the_chunk_bound_finds_no_split(monkeypatch) -> None:
    """GB300 Llama 3.1 405B as NVIDIA's Megatron-Bridge 25.11 recipe runs it (TP 2, PP 8 x VP 4,
    CP 2, micro-batch 1, FP8-CS, layernorm recompute): Megatron's even split fits at 284.9 of
    288 GiB, but stage_memory holds each of a rank's 4 chunks to a quarter of its room, which the
    chunks carrying the embedding and the head overflow. The search tries the even split, priced
    exactly as estimate prices it; without that it finds no plan."""
    model = load_model("llama-3.1-405b")
    gb300 = load_profile("gb300-nvl72")  # FP8 GEMMs at B200's bf16 MAMF share, as a measured profile might say
    profile = gb300.model_copy(update={"gpu": gb300.gpu.model_copy(update={"matmul_efficiency_low": {"fp8": 0.776}})})
    cluster = Cluster.build(profile, 64)
    cons = Constraints(tp=(2,), pp=(8,), virtual_stages=(4,), cp=(2,), micro_batch=(1,), zero=(1,),
                       recompute=("selective",), framework=("megatron",), sequence_parallel=(True,))
    kw = dict(global_batch=1536, seq_len=8192, precision="fp8-tensorwise", recompute_modules=("layernorm",),
              constraints=cons, top=1)
    plan = suggest(model, cluster.profile, 64, **kw).plans[0].plan
    even = estimate(model, cluster, plan.workload, plan.cfg)  # Megatron's even split
    assert plan.partition == even.partition and plan.fits
    assert plan.memory.peak == pytest.approx(even.memory.peak, rel=1e-9)
    assert plan.memory.peak > 0.98 * cluster.profile.gpu.memory_bytes  # at the edge: why the bound misses it
    monkeypatch.setattr(memfit, "megatron_split", lambda *a, **k: None)
    with pytest.raises(NoPlanFits):
        suggest(model, cluster.profile, 64, **kw)
