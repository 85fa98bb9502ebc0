"""What a runtime does with a plan's blocks (frameworks.Paid): tensor-parallel communication
overlapped with the GEMMs (Megatron-Core + TE userbuffers, ``--tp-comm-overlap``) and attention
through Transformer Engine (Hopper-native, not FlashAttention-2's level): the exposed share per
block, which plans get them, the search agreeing with the scalar walk, and the flag written."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.comm_overlap import overlapped_tp
from planner.cost.parallel import RECOMPUTES, ParallelConfig, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.search.suggest import suggest
from tests.scalar_oracle import oracle_estimate

FULL = RECOMPUTES.index("full")


def test_the_gemms_hide_tp_up_to_their_own_time_and_one_chunk_stays_exposed():
    # [group, mode, b, block]: one group, tp 4; block 0 communicates longer than its GEMMs, block 1 less.
    tp = np.zeros((1, len(RECOMPUTES), 1, 2))
    tp[0, :, 0] = [[10.0, 2.0]] * len(RECOMPUTES)
    gemm = np.array([[[1.0, 1.0]]])  # forward GEMM seconds [group, b, block]
    ckpt = np.array([[True, True]])
    out = overlapped_tp(tp, gemm, ckpt, np.array([4.0]))
    assert out[0, 0, 0].tolist() == [10.0 - 3.0, 2.0 / 4]  # fwd + 2x bwd GEMMs hide 3 s; at least one chunk of 4
    assert out[0, FULL, 0].tolist() == [10.0 - 4.0, 2.0 / 4]  # the recomputed forward hides one more
    assert (overlapped_tp(np.zeros_like(tp), gemm, ckpt, np.array([4.0])) == 0).all()


COMMON = dict(nodes=2, tp=8, pp=2, micro_batch=1, global_batch=64, seq_len=4096, zero=1)


@pytest.mark.parametrize(("framework", "sp", "changes"), [
    ("megatron", True, True), ("megatron", False, False), ("megatron-deepspeed", True, False)])
def test_only_megatron_with_sequence_parallelism_overlaps(framework, sp, changes):
    cluster = api.load_cluster("dgx-h100", nodes=2)
    knobs = {**COMMON, "framework": framework, "sequence_parallel": sp}
    knobs.pop("nodes")
    on = api.estimate("llama-3.1-8b", cluster, **knobs)
    off = api.estimate("llama-3.1-8b", cluster, tp_comm_overlap=False, **knobs)
    assert (on.time.tp_comm < 0.5 * off.time.tp_comm) == changes
    assert (on.step_time_s < off.step_time_s) == changes
    assert on.time.compute == pytest.approx(off.time.compute, rel=1e-12)


def test_generate_writes_the_flag_the_plan_was_priced_with(tmp_path):
    entry = tmp_path / "pretrain_gpt.py"
    entry.write_text("print('stand-in for Megatron-LM')\n")
    base = ["generate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--nodes", "2", "--framework", "megatron",
            "--tp", "8", "--sequence-parallel", "--entry", str(entry)]
    for flag, expect in (("--tp-comm-overlap", True), ("--no-tp-comm-overlap", False)):
        out = tmp_path / flag
        r = CliRunner().invoke(main, [*base, flag, "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert ("--tp-comm-overlap" in (out / "megatron_args.sh").read_text()) == expect


def test_te_attention_prices_hopper_attention_at_the_gpus_mamf_for_megatron_only():
    cluster = api.load_cluster("dgx-h100", nodes=1)
    knobs = dict(tp=2, micro_batch=1, global_batch=64, seq_len=8192, zero=1, recompute="selective",
                 recompute_modules="core_attn")  # the attention core, which TE runs faster
    for framework, changes in (("megatron", True), ("megatron-deepspeed", False)):
        on = api.estimate("llama-3.1-8b", cluster, framework=framework, **knobs)
        off = api.estimate("llama-3.1-8b", cluster, framework=framework, te_attention=False, **knobs)
        assert (on.time.compute < 0.97 * off.time.compute) == changes, framework
        assert (on.time.recompute < off.time.recompute) == changes  # selective recompute reruns attention
    a100 = api.load_cluster("dgx-a100-80g", nodes=1)  # FlashAttention-2 already reaches MAMF's curve there
    assert api.estimate("llama-3.1-8b", a100, framework="megatron", **knobs).step_time_s == pytest.approx(
        api.estimate("llama-3.1-8b", a100, framework="megatron", te_attention=False, **knobs).step_time_s, rel=1e-12)


@pytest.mark.parametrize(("framework", "pins"), [
    ("megatron", dict(tp=(2, 4), sequence_parallel=True, pp=(1, 2))),  # overlap and TE attention both on
    ("megatron-deepspeed", dict(tp=(2, 4), sequence_parallel=True)), ("deepspeed", {})])
def test_search_agrees_with_the_scalar_walk_on_hopper(framework, pins):
    """Both runtime behaviours, through the search's arrays and the oracle's per-block walk."""
    model = load_model("llama-3.1-8b")
    profile = load_profile("dgx-h100")
    res = suggest(model, profile, 2, global_batch=64, seq_len=4096, top=3,
                  constraints=api.constraints(framework=framework, micro_batch=1, **pins))
    cluster = Cluster.build(profile, 2)
    for rp in res.plans:
        oracle = oracle_estimate(model, cluster, rp.plan.workload, rp.plan.cfg, partition=rp.plan.partition)
        assert rp.plan.step_time_s == pytest.approx(oracle.step_time_s, rel=1e-9), rp.plan.cfg
        assert rp.plan.memory.peak == pytest.approx(oracle.memory.peak, rel=1e-9)
    assert isinstance(rp.plan.cfg, ParallelConfig) and isinstance(rp.plan.workload, Workload)


def test_zero3_rows_land_on_their_own_fields():
    """ZeRO-3's per-block gathers and reduce-scatters go to the z3_gather and z3_reduce rows by
    name, whatever rows RANK_FIELDS gains after them (a row appended once took their place)."""
    from planner.cost.block_times import BlockTables
    from planner.cost.context import CostContext
    from planner.cost.rank_tables import RankSpec, RankTables, rank_fields

    model = load_model("llama-3.1-8b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 1)
    ctx = CostContext.of(cluster, Workload(global_batch=64, seq_len=4096))
    table = BlockTables(model, cluster, ctx.workload, ctx.dev).table(1, 0, 1, (1,))
    spec = RankSpec.build(table, [(0, len(model.blocks))], mode=0, b=1, pp=1, vs=1, tp=1, sp=False, ep=1, dp=8,
                          framework=0, layout=ctx.layout(1, 1, 8, 1), zero3=True)
    rows = rank_fields(RankTables(model, ctx).tables([spec])[0][None])
    gather = (2 * table.params).sum()  # 16-bit weights of every block, gathered over the 8 DP ranks
    assert rows["z3_gather"][0, 0] > 0 and rows["z3_reduce"][0, 0] > 0 and gather > 0
    assert rows["low"][0, 0] == 0.0  # bf16: no quantized weights to cache
