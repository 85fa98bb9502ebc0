"""Offloaded states must fit in the node's host memory, in estimate and in the search alike."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost.estimate import estimate
from planner.cost.memory import HOST_USABLE_FRACTION, host_capacity_bytes
from planner.cost.parallel import ParallelConfig, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.load import load_model


def _offload_plan(model: str, nodes: int):
    profile = load_profile("dgx-a100-80g")
    cluster = Cluster.build(profile, nodes)
    dp = cluster.num_gpus
    cfg = ParallelConfig(dp=dp, zero_stage=3, offload="optimizer+params", micro_batch=1, grad_accum=1, recompute="full")
    return estimate(load_model(model), cluster, Workload(global_batch=dp, seq_len=2048), cfg), profile


def test_host_capacity_is_the_usable_share_of_the_nodes_memory():
    profile = load_profile("dgx-a100-80g")
    assert host_capacity_bytes(profile.node.host_memory_GiB) == profile.node.host_memory_GiB * 2**30 * HOST_USABLE_FRACTION


def test_offloading_405b_to_one_node_overflows_the_host_and_does_not_fit():
    plan, profile = _offload_plan("llama-3.1-405b", 1)
    # fp32 master weights + two Adam moments alone are 12 bytes per parameter, on one node.
    assert plan.cpu_bytes_per_node > 12 * 405e9
    assert plan.memory.peak <= plan.capacity_bytes  # the GPU side would fit...
    assert not plan.fits  # ...but the host cannot hold the offloaded states
    assert "host memory per node" in plan.why_not()
    assert plan.to_json()["fits"] is False


def test_offloading_over_enough_nodes_fits():
    plan, _ = _offload_plan("llama-3.1-405b", 16)
    assert plan.cpu_bytes_per_node <= plan.host_capacity_bytes
    assert plan.fits, plan.why_not()


def test_suggest_never_ranks_a_plan_whose_offload_overflows_the_host():
    result = CliRunner().invoke(main, ["suggest", "--model", "llama-3.1-405b", "--nodes", "1", "--json"])
    assert result.exit_code == 2
    assert "host memory per node" in result.output
    data = json.loads(result.output[: result.output.rindex("}") + 1])
    assert data["plans"] == []
    assert data["closest"]["memory"]["cpu_bytes_per_node"] > host_capacity_bytes(load_profile("dgx-a100-80g").node.host_memory_GiB)


@pytest.mark.parametrize("nodes", [2, 4])
def test_every_ranked_offload_plan_fits_in_host_memory(nodes):
    result = CliRunner().invoke(main, ["suggest", "--model", "llama-3-70b", "--nodes", str(nodes), "--offload", "optimizer",
                                       "--framework", "deepspeed", "--top", "3", "--json"])
    assert result.exit_code == 0, result.output
    cap = host_capacity_bytes(load_profile("dgx-a100-80g").node.host_memory_GiB)
    plans = json.loads(result.output)["plans"]
    assert plans and all(0 < p["memory"]["cpu_bytes_per_node"] <= cap for p in plans)
