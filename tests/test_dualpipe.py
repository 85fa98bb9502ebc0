"""DualPipeV (``--pp-schedule dualpipev``, planner/cost/dualpipe.py): the op order is PyTorch's own,
the closed-form bubble and held activations match a replay of it, the V places chunks r and
2 pp - 1 - r on rank r, the expert all-to-alls overlap only without activation checkpointing, the
search offers it on torchtitan only, and what cannot run exits 2 with one message."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from torch.distributed.pipelining import schedules

from planner import api
from planner.cli import main
from planner.cost import dualpipe


def torch_ops(rank: int, pp: int, m: int) -> list[tuple]:
    """ScheduleDualPipeV's own op list for one rank (its order builder reads only these two fields),
    as (kind, stage, micro-batch) or ("FB", (stage, mb), (stage, mb))."""
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    fields = SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
    out = []
    for a in schedules.ScheduleDualPipeV._calculate_single_rank_operations(fields, rank):
        if a.computation_type == schedules.OVERLAP_F_B:
            f, b = a.sub_actions
            out.append(("FB", (f.stage_index, f.microbatch_index), (b.stage_index, b.microbatch_index)))
        else:
            out.append((kinds[a.computation_type.name], a.stage_index, a.microbatch_index))
    return out


def ours(rank: int, pp: int, m: int) -> list[tuple]:
    stage = dualpipe.chunk_ranks(pp)
    of = {(stage[k], k >= pp): k for k in range(2 * pp)}  # (rank, second leg) -> model chunk

    def k(c: int) -> int:
        return of[rank, c == 1]

    return [("FB", (k(op[1][0]), op[1][1]), (k(op[2][0]), op[2][1])) if op[0] == "FB" else (op[0], k(op[1]), op[2])
            for op in dualpipe.rank_ops(rank, pp, m)]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_the_op_order_is_pytorchs_scheduledualpipev(pp):
    for m in (2 * pp, 2 * pp + 1, 3 * pp + 2):
        for rank in range(pp):
            assert ours(rank, pp, m) == torch_ops(rank, pp, m), (pp, m, rank)


def _equal(pp: int, f: float, b: float, w: float):
    return [[f, f]] * pp, [[b, b]] * pp, [[w, w]] * pp


def test_the_bubble_is_deepseeks_with_its_floor_where_the_replay_says():
    # F = W = B / 2: F&B + B - 3W = 2F, the floor: the replay's bubble exactly, at any m
    for pp in (2, 4, 8):
        for m in (2 * pp, 5 * pp):
            step, _ = dualpipe.replay(pp, m, *_equal(pp, 1.0, 2.0, 1.0))
            assert step == pytest.approx(m * 2 * 3.0 + (pp - 1) * 2.0)
            totals = np.full((1, pp), 2.0)
            closed = dualpipe.bubble(totals, totals * 2, totals, np.array([0]), np.array([pp]))
            assert closed[0] == pytest.approx((pp - 1) * 2.0)


def test_the_closed_form_is_within_2_5_percent_of_the_replayed_step():
    rng = random.Random(7)
    worst = 0.0
    for _ in range(120):
        pp = rng.choice((2, 3, 4, 8))
        m = 2 * pp + 1
        f = 1.0
        b = rng.uniform(1.5, 3.5)
        w = rng.uniform(0.3, 0.6) * b
        step, _ = dualpipe.replay(pp, m, *_equal(pp, f, b, w))
        t = np.full((1, pp), 1.0)
        closed = m * 2 * (f + b) + dualpipe.bubble(2 * f * t, 2 * b * t, 2 * w * t, np.array([0]), np.array([pp]))[0]
        worst = max(worst, abs(closed - step) / step)
    assert worst < 0.025


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_held_activations_and_overlapped_pairs_are_the_replays(pp):
    m = 3 * pp
    _, peaks = dualpipe.replay(pp, m, *_equal(pp, 1.0, 2.0, 1.0))
    for rank in range(pp):
        first, second = dualpipe.held(rank, pp)
        assert peaks[rank] == (first, second)
        pairs = sum(op[0] == "FB" for op in dualpipe.rank_ops(rank, pp, m))
        assert dualpipe.merged_share(rank, pp, m) == pytest.approx(pairs / (2 * m))


def _estimate(**kw):
    base = dict(framework="torchtitan", tp=1, pp=4, ep=8, dp=8, zero=3, micro_batch=1, global_batch=256,
                seq_len=4096, pp_schedule="dualpipev")
    return api.estimate("deepseek-v2-lite", api.load_cluster(nodes=4, hardware="dgx-h100"), **{**base, **kw})


def test_rank_r_holds_chunks_r_and_its_mirror_and_both_ends_of_the_model():
    plan = _estimate()
    pp = plan.cfg.pp
    assert plan.cfg.virtual_stages == 2  # DualPipeV's two chunks a rank, without --virtual-stages
    parts = plan.partition
    assert [s.chunks for s in plan.stages] == [[parts[r], parts[2 * pp - 1 - r]] for r in range(pp)]
    # rank 0 holds the embedding and the head: no second copy of a tied matrix; the V turns on the
    # last rank without a send, so its sends are half a middle rank's (all hops inside one NVLink node
    # here: the same link for every send)
    sends = [s.microbatch.pp for s in plan.stages]
    assert sends[0] == pytest.approx(sends[-1], rel=0.35) and sends[-1] < 0.75 * sends[1]


def test_expert_all_to_alls_overlap_only_without_activation_checkpointing():
    overlapped, exposed = _estimate(), _estimate(ep_comm_overlap=False)
    assert overlapped.time.ep_comm < 0.5 * exposed.time.ep_comm
    full, full_exposed = _estimate(recompute="full"), _estimate(recompute="full", ep_comm_overlap=False)
    assert full.time.ep_comm == pytest.approx(full_exposed.time.ep_comm)  # torchtitan refuses it with AC


def test_dualpipev_holds_about_what_1f1b_holds_on_its_first_rank():
    # equal ranks: rank r holds 2 pp - 1 - r of its first chunk and r + 1 of its second, about
    # pp micro-batches of its stage, as 1F1B's rank 0 does (DeepSeek's "PP + 1" chunks)
    kw = dict(model="llama-3.1-8b", ep=1, dp=2, pp=4, global_batch=64, seq_len=4096)
    dual = api.estimate(kw.pop("model"), api.load_cluster(nodes=1, hardware="dgx-h100"), framework="torchtitan",
                        tp=1, zero=3, micro_batch=1, pp_schedule="dualpipev", **{k: v for k, v in kw.items()})
    plain = api.estimate("llama-3.1-8b", api.load_cluster(nodes=1, hardware="dgx-h100"), framework="torchtitan",
                         tp=1, zero=3, micro_batch=1, **kw)
    middle = [s.memory.activations for s in dual.stages[1:-1]]
    assert all(a == pytest.approx(plain.stages[0].memory.activations, rel=0.2) for a in middle)
    assert dual.stages[0].inflight < plain.stages[0].inflight  # its rank 0 keeps one head micro-batch


def test_the_schedule_check_replays_dualpipev_within_two_percent():
    plan = _estimate()
    assert all("DualPipeV" in n for n in plan.notes if "replayed" in n)
    gap = [float(n.split(": ")[1].split("%")[0]) for n in plan.notes if "DualPipeV, replayed" in n]
    assert all(abs(g) < 2.0 for g in gap)


def test_suggest_offers_dualpipev_on_torchtitan_and_prices_as_estimate():
    cluster = api.load_cluster(nodes=4, hardware="dgx-h100")
    result = api.suggest("deepseek-v2-lite", cluster, pp=(2, 4), global_batch=256, seq_len=4096,
                         pp_schedule="dualpipev", top=3)
    best = result.plans[0].plan
    assert best.cfg.framework == "torchtitan" and best.cfg.virtual_stages == 2
    assert best.cfg.grad_accum >= 2 * best.cfg.pp
    again = api.estimate("deepseek-v2-lite", cluster, partition=best.partition, **_knobs(best.cfg),
                         global_batch=256, seq_len=4096, pp_schedule="dualpipev")
    assert again.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)


def _knobs(cfg) -> dict:
    return dict(framework=cfg.framework, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, dp=cfg.dp, zero=cfg.zero_stage,
                micro_batch=cfg.micro_batch, recompute=cfg.recompute, virtual_stages=cfg.virtual_stages,
                sequence_parallel=cfg.sequence_parallel, etp=cfg.etp, offload=cfg.offload)


REFUSED = [
    (["--framework", "megatron", "--zero", "1"], "--pp-schedule dualpipev is DeepSeek's DualPipeV"),
    (["--framework", "torchtitan", "--zero", "3", "--virtual-stages", "3"], "--virtual-stages 2"),
    (["--framework", "torchtitan", "--zero", "3", "--global-batch", "8"], "at least 2 x --pp = 4 micro-batches"),
]


@pytest.mark.parametrize("flags, phrase", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_what_dualpipev_cannot_run_exits_2_with_one_message(flags, phrase):
    batch = [] if "--global-batch" in flags else ["--global-batch", "64"]
    result = CliRunner().invoke(main, ["estimate", "--model", "deepseek-v2-lite", "--hardware", "dgx-h100", "--pp",
                                       "2", "--ep", "4", "--pp-schedule", "dualpipev", *batch, *flags])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], result.output


def test_plan_json_carries_the_schedule(tmp_path):
    result = CliRunner().invoke(main, ["estimate", "--model", "deepseek-v2-lite", "--hardware", "dgx-h100",
                                       "--framework", "torchtitan", "--zero", "3", "--pp", "2", "--ep", "4",
                                       "--global-batch", "64", "--pp-schedule", "dualpipev", "--json",
                                       "--allow-oom"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["pp_schedule"] == "dualpipev" and plan["virtual_stages"] == 2


ORACLE_CASES = [
    # (model, nodes, hardware, knobs): MoE with its all-to-all overlap, the same recomputed (no
    # overlap), a dense model, and pipeline hops that leave the node
    ("deepseek-v2-lite", 4, "dgx-h100", dict(tp=1, pp=4, ep=8, dp=8, global_batch=256)),
    ("deepseek-v2-lite", 4, "dgx-h100", dict(tp=1, pp=4, ep=8, dp=8, global_batch=256, recompute="full")),
    ("llama-3.1-8b", 1, "dgx-h100", dict(tp=2, pp=2, dp=2, global_batch=64, sequence_parallel=True)),
    ("llama-3.1-70b", 4, "dgx-a100-80g", dict(tp=8, pp=2, dp=2, global_batch=64, recompute="full",
                                              sequence_parallel=True)),
]


@pytest.mark.parametrize("name, nodes, hardware, knobs", ORACLE_CASES)
def test_estimate_is_the_scalar_walk(name, nodes, hardware, knobs):
    from planner.model.load import load_model
    from tests.scalar_oracle import oracle_estimate

    cluster = api.load_cluster(nodes=nodes, hardware=hardware)
    plan = api.estimate(name, cluster, framework="torchtitan", zero=3, micro_batch=1, seq_len=4096,
                        pp_schedule="dualpipev", **knobs)
    oracle = oracle_estimate(load_model(name), cluster, plan.workload, plan.cfg, partition=plan.partition)
    # the oracle leaves out FSDP2's stage kept gathered under a pipeline (one gather and one reduction
    # a step, and the stage's states): the data-parallel time and the states are compared elsewhere
    assert plan.step_time_s - plan.time.dp_comm == pytest.approx(oracle.step_time_s - oracle.time.dp_comm, rel=1e-9)
    assert plan.time.pp_bubble == pytest.approx(oracle.time.pp_bubble, rel=1e-9)
    for got, want in zip(plan.stages, oracle.stages):
        assert got.chunks == want.chunks
        assert got.microbatch.pp == pytest.approx(want.microbatch.pp, rel=1e-9, abs=1e-15)
        assert got.microbatch.ep == pytest.approx(want.microbatch.ep, rel=1e-9, abs=1e-15)
        assert got.inflight == pytest.approx(want.inflight, rel=1e-9)
        assert got.memory.activations == pytest.approx(want.memory.activations, rel=1e-9)


def test_the_searchs_bounds_hold_for_dualpipev_candidates():
    """DualPipeV's bubble can be smaller than a looped schedule's: the time bound takes none, and
    the memory bound one micro-batch of each chunk, so no candidate is pruned below its price."""
    from planner.search.bounds import lower_bounds
    from planner.search.evaluate import evaluate_keys
    from planner.search.space import Constraints
    from tests.search_cases import prepared

    cons = Constraints(framework=("torchtitan",), virtual_stages=(1, 2), pp=(1, 2, 4),
                       recompute=("none", "full"))
    case = prepared("deepseek-v2-lite", 2, cons, global_batch=128, pp_schedule="dualpipev")
    c = case.space.columns
    assert ((c["pp"] > 1) & (c["vs"] == 2)).any() and not ((c["pp"] > 1) & (c["vs"] == 1)).any()
    time_lb, mem_lb = lower_bounds(case.p, case.ks)
    res = evaluate_keys(case.p, case.ks)
    rows = res.rows
    assert len(rows) == len(case.space) > 50
    assert np.all(time_lb[rows] <= res.step_time * (1 + 1e-12))
    assert np.all(mem_lb[rows] <= res.peak_bytes * (1 + 1e-12))


def test_memfits_stage_memory_bounds_each_v_rank_from_above():
    """Under DualPipeV memfit's chunk k sits on rank k then back up the ranks, with the V's held
    counts: half the sum over a rank's two chunks bounds its real peak on random splits, so a
    memory-limited split it finds fits."""
    from planner.cost.estimate import estimate
    from planner.search import memfit
    from planner.search.space import Constraints
    from tests.search_cases import prepared

    cons = Constraints(framework=("torchtitan",), pp=(2, 4), virtual_stages=(2,), zero=(3,),
                       recompute=("none", "full"))
    case = prepared("deepseek-v2-lite", 2, cons, global_batch=128, pp_schedule="dualpipev")
    rng = np.random.default_rng(3)
    units = len(case.p.splits.units.ranges)
    rows = np.flatnonzero(case.space.columns["pp"] > 1)
    for i in rng.choice(rows, 30, replace=False).tolist():
        cfg = case.space.config(i)
        pp = cfg.pp
        sm = memfit.stage_memory(case.p, case.ks, i)
        cuts = np.sort(rng.choice(np.arange(1, units), 2 * pp - 1, replace=False))
        bounds = np.concatenate(([0], cuts, [units]))
        plan = estimate(case.model, case.cluster, case.workload, cfg,
                        partition=case.p.splits.units.blocks(tuple(int(c) for c in np.diff(bounds))))
        for r in range(pp):
            mine = (r, 2 * pp - 1 - r)
            bound = sum(sm.stage_bytes(k, int(bounds[k]), int(bounds[k + 1])) for k in mine) / 2
            assert bound >= plan.stages[r].memory.peak * (1 - 1e-12), (cfg, r)


def test_generate_without_torchtitan_says_dualpipev_is_torchtitans(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["generate", "--model", "deepseek-v2-lite", "--hardware", "dgx-h100", "--nodes",
                                       "4", "--global-batch", "256", "--seq-len", "4096", "--pp-schedule", "dualpipev",
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "DualPipeV is torchtitan's: add --framework torchtitan" in lines[0], result.output
    assert not out.exists()


def test_suggest_ranks_dualpipev_beside_1f1b():
    """``--pp-schedule 1f1b,dualpipev``: each schedule searched, the plans ranked together; DualPipeV's
    search takes pipelines only (1F1B's has the plans without one), so no plan shows twice."""
    cluster = api.load_cluster(nodes=4, hardware="dgx-h100")
    result = api.suggest("deepseek-v2-lite", cluster, framework="torchtitan", global_batch=256, seq_len=4096,
                         pp_schedule=("1f1b", "dualpipev"), top=40)
    plans = [rp.plan for rp in result.plans]
    schedules = {p.workload.pp_schedule for p in plans}
    assert schedules == {"1f1b", "dualpipev"} and result.inputs["pp_schedule"] == "1f1b,dualpipev"
    assert all(p.cfg.pp > 1 and p.cfg.virtual_stages == 2 for p in plans if p.workload.pp_schedule == "dualpipev")
    layouts = [(p.workload.pp_schedule, p.cfg, tuple(p.partition)) for p in plans]
    assert len(set(layouts)) == len(layouts)
    times = [p.step_time_s for p in plans]
    assert times == sorted(times)


def test_the_table_marks_dualpipev_pipelines_and_names_them():
    result = CliRunner().invoke(main, ["suggest", "--model", "deepseek-v2-lite", "--hardware", "dgx-h100", "--nodes",
                                       "4", "--global-batch", "256", "--seq-len", "4096", "--framework", "torchtitan",
                                       "--pp", "2", "--pp-schedule", "dualpipev", "--top", "3"],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert " 2V " in text and "pp 2V = 2 pipeline ranks holding 2 model chunks each in DualPipeV's V" in text
    bad = CliRunner().invoke(main, ["suggest", "--model", "deepseek-v2-lite", "--pp-schedule", "1f1b,zb"])
    assert bad.exit_code == 2 and "--pp-schedule: unknown value" in bad.output, bad.output
