"""planner/cost/degrees.py: the one builder of a ParallelConfig and the one default-batch rule,
used alike by the CLI's commands and the Python API."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.degrees import build_parallel_config, default_global_batch
from planner.errors import UserError


def _search_default_before(seq_len: int, world: int, target_tokens: float = 4e6) -> int:
    """The search's default batch as planner/search/space.py wrote it before the rule moved."""
    target = max(1, round(target_tokens / seq_len))
    lo, hi = max(1, int(target * 0.75)), max(1, int(target * 1.5))

    def key(b: int) -> tuple[int, int, int]:
        return (math.gcd(b, world), (b & -b).bit_length() - 1, -abs(b - target))

    return int(max(range(lo, hi + 1), key=key))


@pytest.mark.parametrize(("seq", "world", "expected"), [(4096, 64, 1024), (8192, 16384, 512), (4096, 24, 768)])
def test_default_global_batch_is_about_4m_tokens_and_divisible(seq: int, world: int, expected: int) -> None:
    gb = default_global_batch(seq, world)
    assert gb == expected
    assert 0.75 * 4e6 <= gb * seq <= 1.5 * 4e6


@pytest.mark.parametrize("seq", [128, 1024, 2048, 4096, 8192, 32768, 10**6, 10**7])
def test_with_unit_1_it_is_the_search_default_it_always_was(seq: int) -> None:
    """suggest's numbers rest on this batch: the generalised rule must not move it."""
    for world in (1, 3, 6, 8, 24, 64, 96, 1000, 16384):
        assert default_global_batch(seq, world) == _search_default_before(seq, world), (seq, world)
        assert default_global_batch(seq, world, unit=1, min_microbatches=1) == _search_default_before(seq, world)


@pytest.mark.parametrize(("seq", "world", "unit", "pp"), [(4096, 24, 24, 1), (4096, 64, 48, 1), (8192, 16, 2, 4),
                                                         (2048, 8, 3, 8), (4096, 8, 5000, 1), (131072, 64, 8, 16)])
def test_a_plan_default_is_a_multiple_of_its_unit_with_enough_micro_batches(seq, world, unit, pp) -> None:
    gb = default_global_batch(seq, world, unit=unit, min_microbatches=pp)
    assert gb % unit == 0 and gb // unit >= pp
    target = round(4e6 / seq)
    if any(k * unit >= 0.75 * target and k >= pp for k in range(1, int(1.5 * target / unit) + 1)):
        assert 0.75 * target <= gb <= 1.5 * target + unit  # in the window whenever a multiple fits it


def test_the_builder_fills_dp_zero_and_accumulation() -> None:
    cluster = api.load_cluster(nodes=2)
    cfg = build_parallel_config(cluster, global_batch=256, tp=2, pp=2)
    assert (cfg.dp, cfg.zero_stage, cfg.grad_accum) == (4, 1, 64)
    one = build_parallel_config(cluster, global_batch=8, tp=8, pp=2)
    assert (one.dp, one.zero_stage, one.grad_accum) == (1, 0, 8)
    # No batch given: the plan's own default, which its micro-batch x dp divides, >= pp micro-batches.
    own = build_parallel_config(cluster, seq_len=4096, tp=2, pp=8, micro_batch=3)
    assert own.samples_per_step % 3 == 0 and own.grad_accum >= 8


@pytest.mark.parametrize(("knobs", "message"), [
    ({"tp": 0}, "tp: need a whole number >= 1, got 0"),
    ({"pp": -1}, "pp: need a whole number >= 1, got -1"),
    ({"micro_batch": 1.5}, "micro_batch: need a whole number >= 1, got 1.5"),
    ({"virtual_stages": True}, "virtual_stages: need a whole number >= 1, got True"),
    ({"dp": 0}, "dp: need a whole number >= 1, got 0"),
    ({"zero": 4}, "zero: stages are 0, 1, 2 or 3, got 4"),
    ({"tp": 3}, "tp 3 x pp 1 = 3 does not divide the 16 GPUs (2 nodes x 8); pick degrees whose product divides 16"),
    ({"dp": 3, "tp": 2}, "dp x tp x pp = 3 x 2 x 1 = 6 but the cluster has 16 GPUs (2 nodes x 8)"),
    ({"micro_batch": 3}, "global_batch 64 is not divisible by micro_batch 3 x dp 16 = 48"),
    ({"sequence_parallel": True}, "invalid plan: sequence parallel needs tp > 1"),
    ({"zero": 0, "offload": "optimizer"}, "invalid plan: optimizer offload needs ZeRO 1, 2 or 3"),
])
def test_each_broken_rule_is_one_error_naming_the_input(knobs: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        build_parallel_config(api.load_cluster(nodes=2), global_batch=64, **knobs)
    assert message in str(err.value)


def test_estimate_defaults_agree_between_the_cli_and_the_api() -> None:
    """``dsplan estimate`` with no --global-batch used its own rule (1,032 samples here); now it
    and ``planner.api.estimate`` take the one default."""
    result = CliRunner().invoke(main, ["estimate", "--model", "llama-3.1-8b", "--nodes", "3", "--seq-len", "4096",
                                       "--json"])
    assert result.exit_code == 0, result.output
    cli = json.loads(result.output)
    plan = api.estimate("llama-3.1-8b", api.load_cluster(nodes=3), seq_len=4096)
    assert cli["global_batch"] == plan.workload.global_batch == 768
    assert (cli["dp"], cli["zero_stage"], cli["grad_accum"]) == (plan.cfg.dp, plan.cfg.zero_stage, plan.cfg.grad_accum)
    assert cli["step_time_s"] == pytest.approx(plan.step_time_s, rel=1e-12)
    assert cli["memory"]["peak_bytes"] == pytest.approx(plan.memory.peak, rel=1e-12)
    # Where dp alone divides the search's default, the plan's default is the search's too.
    assert plan.workload.global_batch == api.make_workload("llama-3.1-8b", gpus=24, seq_len=4096).global_batch


def test_the_estimate_default_keeps_a_pipeline_busy() -> None:
    """At least pp micro-batches per step, with micro-batch x dp dividing the batch."""
    result = CliRunner().invoke(main, ["estimate", "--model", "llama-3.1-8b", "--nodes", "1", "--tp", "2", "--pp", "4",
                                       "--micro-batch", "3", "--framework", "megatron-deepspeed", "--allow-oom",
                                       "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["global_batch"] == 3 * 1 * data["grad_accum"] and data["grad_accum"] >= 4
    plan = api.estimate("llama-3.1-8b", api.load_cluster(nodes=1), tp=2, pp=4, micro_batch=3,
                        framework="megatron-deepspeed")
    assert plan.workload.global_batch == data["global_batch"]


_COMMANDS = [["estimate", "--model", "llama-3-8b"], ["suggest", "--model", "llama-3-8b"],
             ["generate", "--model", "llama-3-8b", "--out", "{out}"], ["topo"]]
_BAD_NODES = [("--nodes", "0", "error: --nodes: need a whole number >= 1, got 0"),
              ("--nodes", "-3", "error: --nodes: need a whole number >= 1, got -3")]
_BAD_GPUS = [("--gpus-per-node", "0", "error: --gpus-per-node: need a whole number from 1 to 576")]


# topo draws a profile's own nodes: it takes --nodes but no --gpus-per-node.
@pytest.mark.parametrize(("command", "flag", "value", "message"),
                         [(c, *bad) for c in _COMMANDS for bad in _BAD_NODES]
                         + [(c, *bad) for c in _COMMANDS if c != ["topo"] for bad in _BAD_GPUS])
def test_every_command_refuses_a_bad_cluster_size_the_same_way(tmp_path, command, flag, value, message) -> None:
    out = tmp_path / "run"
    args = [a.replace("{out}", str(out)) for a in command] + [flag, value]
    result = CliRunner().invoke(main, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(message), result.output
    assert not out.exists()


def test_generate_refuses_nodes_0_with_a_plan_file_too(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    made = CliRunner().invoke(main, ["estimate", "--model", "gpt3-125m", "--global-batch", "8", "--json"])
    plan.write_text(made.output)
    result = CliRunner().invoke(main, ["generate", "--plan", str(plan), "--nodes", "0", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--nodes: need a whole number >= 1, got 0" in result.output
