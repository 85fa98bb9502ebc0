"""Hybrid sharding (``--dp-replicate R``): the dp x cp ranks form R groups that each shard the
model states and replicate each other. Priced as the runtimes run it (states over dp x cp / R,
the per-block collectives inside one group, the gradient shards all-reduced across the groups:
once per step on Megatron, every micro-batch on torchtitan's FSDP2), searched by ``suggest``,
refused where no runtime has it, and emitted as Megatron-LM's
--num-distributed-optimizer-instances and torchtitan's replicate x shard mesh."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.collectives import collective_seconds
from planner.cost.layout import layout
from planner.model.catalog import load_model
from tests.test_emit_scripts import MEGATRON_LM_FLAGS
from tests.test_torchtitan import parse_with_torchtitan

MODEL = "llama-3-8b"


def _estimate(nodes: int = 4, **kw):
    cluster = api.load_cluster("dgx-h100", nodes=nodes)
    dp = 8 * nodes
    shape = {"framework": "megatron", "zero": 3, "dp": dp, "micro_batch": 1, "global_batch": dp, "seq_len": 4096}
    return api.estimate(MODEL, cluster, **{**shape, **kw})


@pytest.mark.parametrize("framework, zero", [("megatron", 3), ("megatron", 1), ("torchtitan", 3)])
def test_optimizer_states_shard_over_one_group(framework, zero):
    params = load_model(MODEL).total_params()
    hybrid = _estimate(framework=framework, zero=zero, dp_replicate=4).stages[0].memory
    flat = _estimate(framework=framework, zero=zero).stages[0].memory
    assert hybrid.optimizer == pytest.approx(4 * flat.optimizer, rel=1e-9)
    if framework == "megatron":  # fp32 main weights and two fp32 Adam moments, over 32 / 4 ranks
        assert hybrid.optimizer == pytest.approx(12 * params / 8, rel=1e-9)


def test_the_sharding_group_is_node_local_and_the_replicas_one_per_node():
    shapes = layout(api.load_cluster("dgx-h100", nodes=4), 1, 1, 32, 1, 4)
    assert (shapes.dp.size, shapes.dp.nodes_spanned) == (8, 1)
    assert (shapes.outer.size, shapes.outer.ranks_per_node, shapes.outer.nodes_spanned) == (4, 1, 4)


def _by_hand(nodes: int, rep: int, seq_len: int) -> tuple[float, float]:
    """Megatron-FSDP's exposed DP seconds of one micro-batch and of the last: per-block
    all-gathers (bf16 weights) and reduce-scatters (bf16 gradients, its "auto" dtype) inside
    one group against the micro-batch's forward and backward, and on the last also the
    all-reduce of the rank's gradient shard across the replicas."""
    cluster = api.load_cluster("dgx-h100", nodes=nodes)
    model = load_model(MODEL)
    dp = 8 * nodes
    shapes = layout(cluster, 1, 1, dp, 1, rep)
    gather = sum(collective_seconds(cluster, "allgather", shapes.dp, 2 * b.params()) for b in model.blocks)
    scatter = sum(collective_seconds(cluster, "reducescatter", shapes.dp, 2 * b.params()) for b in model.blocks)
    across = collective_seconds(cluster, "allreduce", shapes.outer, 2 * model.total_params() / (dp // rep))
    mb = _estimate(nodes, seq_len=seq_len, dp_replicate=rep).stages[0].microbatch
    ahead = max(0.0, gather - mb.fwd)
    return ahead + max(0.0, gather + scatter - mb.bwd), ahead + max(0.0, gather + scatter + across - mb.bwd)


@pytest.mark.parametrize("nodes, rep", [(4, 4), (4, 2), (8, 8)])
def test_megatron_fsdp_exposes_the_replicas_all_reduce_behind_the_last_backward(nodes, rep):
    _, last = _by_hand(nodes, rep, 1024)
    assert last > 0.0
    assert _estimate(nodes, seq_len=1024, dp_replicate=rep).time.dp_comm == pytest.approx(last, rel=1e-9)


def test_megatron_reduces_across_replicas_once_a_step_fsdp2_every_micro_batch():
    def exposed(framework: str, m: int) -> float:
        return _estimate(framework=framework, seq_len=1024, global_batch=32 * m, dp_replicate=4).time.dp_comm

    every, last = _by_hand(4, 4, 1024)
    assert last > every
    assert exposed("megatron", 8) == pytest.approx(7 * every + last, rel=1e-9)
    assert exposed("torchtitan", 1) > 0.0
    assert exposed("torchtitan", 8) == pytest.approx(8 * exposed("torchtitan", 1), rel=1e-9)


def test_suggest_prices_a_pinned_hybrid_plan_as_estimate_does():
    cluster = api.load_cluster("dgx-h100", nodes=4)
    pins = {"framework": "megatron", "zero": 3, "dp": 32, "tp": 1, "pp": 1, "micro_batch": 1, "recompute": "none",
            "cp": 1, "global_batch": 256, "seq_len": 2048}
    best = api.suggest(MODEL, cluster, dp_replicate=4, top=1, **pins).plans[0].plan
    alone = api.estimate(MODEL, cluster, dp_replicate=4, **{k: v for k, v in pins.items()})
    assert best.cfg.dp_replicate == 4
    assert best.step_time_s == pytest.approx(alone.step_time_s, rel=1e-9)
    assert best.stages[0].memory.peak == pytest.approx(alone.stages[0].memory.peak, rel=1e-9)


def test_suggest_searches_each_replica_count_given():
    r = CliRunner().invoke(main, ["suggest", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "4",
                                  "--framework", "megatron", "--zero", "3", "--dp-replicate", "1,4", "--top", "40",
                                  "--json"])
    assert r.exit_code == 0, r.output
    plans = json.loads(r.stdout)["plans"]
    assert {p["dp_replicate"] for p in plans} == {1, 4}
    table = CliRunner().invoke(main, ["suggest", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "4",
                                      "--framework", "megatron", "--zero", "3", "--dp-replicate", "4", "--top", "3"])
    assert table.exit_code == 0 and "3h4" in table.output and "hybrid sharding" in table.output, table.output


@pytest.mark.parametrize("args", [
    ["--framework", "deepspeed", "--zero", "3"],
    ["--framework", "megatron", "--zero", "0"],
    ["--framework", "torchtitan", "--zero", "0"],
])
def test_where_no_runtime_has_it_is_one_clear_error(args):
    r = CliRunner().invoke(main, ["estimate", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "4",
                                  "--dp-replicate", "4", *args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--dp-replicate 4" in lines[0] and "--dp-replicate 1" in lines[0], r.output


@pytest.mark.parametrize("rep", ["3", "32", "0"])
def test_replica_counts_that_do_not_split_the_ranks_are_refused(rep):
    r = CliRunner().invoke(main, ["estimate", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "4",
                                  "--framework", "megatron", "--zero", "3", "--dp-replicate", rep])
    assert r.exit_code == 2, r.output
    assert "--dp-replicate" in r.output and "Traceback" not in r.output


def _plan_json(tmp_path, framework: str, zero: str):
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--nodes", "4",
                                  "--framework", framework, "--zero", zero, "--dp-replicate", "4",
                                  "--global-batch", "64", "--recompute", "full", "--json"])
    assert r.exit_code == 0, r.output
    path = tmp_path / "plan.json"
    path.write_text(r.stdout)
    assert json.loads(r.stdout)["dp_replicate"] == 4
    return path


@pytest.mark.parametrize("zero", ["1", "3"])
def test_generate_passes_the_instances_to_megatron_lm(tmp_path, zero):
    entry = tmp_path / "pretrain_gpt.py"
    entry.write_text("# Megatron-LM's entry point stands here\n")
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--plan", str(_plan_json(tmp_path, "megatron", zero)), "--entry",
                                  str(entry), "--out", str(out)])
    assert r.exit_code == 0, r.output
    args = (out / "megatron_args.sh").read_text()
    assert "--num-distributed-optimizer-instances 4" in args
    assert ("--use-megatron-fsdp" in args) == (zero == "3")
    flags = {word for word in args.split() if word.startswith("--")}
    assert flags <= MEGATRON_LM_FLAGS, flags - MEGATRON_LM_FLAGS
    assert "4 instances (hybrid sharding" in (out / "README.md").read_text()


def test_torchtitan_reads_a_replicate_by_shard_mesh(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--plan", str(_plan_json(tmp_path, "torchtitan", "3")),
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = parse_with_torchtitan(out / "torchtitan.toml").parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (4, 8)
    assert "HSDP: 4 replicas" in (out / "README.md").read_text()


def test_the_reference_trainer_refuses_replicated_groups(tmp_path):
    """Searched for the default entry, replicated groups are refused (nothing written); a plan
    file that has them still gets its run directory, with a note that the entry cannot run it,
    and ``dsplan run`` refuses it before it starts a rank (planner/run/rundir.py)."""
    out = tmp_path / "run"
    searched = CliRunner().invoke(main, ["generate", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "4",
                                         "--framework", "megatron", "--zero", "1", "--dp-replicate", "4",
                                         "--out", str(out)])
    assert searched.exit_code == 2 and "--dp-replicate 1" in searched.output, searched.output
    assert not out.exists()
    given = CliRunner().invoke(main, ["generate", "--plan", str(_plan_json(tmp_path, "megatron", "1")),
                                      "--out", str(out)])
    assert given.exit_code == 0, given.output
    assert "cannot run this plan" in given.output and "dp_replicate=4" in given.output, given.output
