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
    assert (host_capacity_bytes(profile.node.host_memory_GiB)
            == profile.node.host_memory_GiB * 2**30 * HOST_USABLE_FRACTION)


def test_offloading_405b_to_one_node_overflows_the_host_and_does_not_fit():
    plan, profile = _offload_plan("llama-3.1-405b", 1)
    # ZeRO-3 offloading parameters too keeps 18 bytes per parameter on the host (fp32 master,
    # fp32 gradient, two Adam moments, the 16-bit partition), x1.5 for pinned buffers: DeepSpeed's
    # own estimator (estimate_zero3_model_states_mem_needs, 18 x gpus_factor x 1.5 per node).
    P = load_model("llama-3.1-405b").total_params()
    assert plan.cpu_bytes_per_node == pytest.approx(18 * P * 1.5, rel=1e-12)
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
    assert (data["closest"]["memory"]["cpu_bytes_per_node"]
            > host_capacity_bytes(load_profile("dgx-a100-80g").node.host_memory_GiB))


@pytest.mark.parametrize("nodes", [2, 4])
def test_every_ranked_offload_plan_fits_in_host_memory(nodes):
    result = CliRunner().invoke(main, ["suggest", "--model", "llama-3-70b", "--nodes", str(nodes),
                                       "--offload", "optimizer", "--framework", "deepspeed", "--top", "3", "--json"])
    assert result.exit_code == 0, result.output
    cap = host_capacity_bytes(load_profile("dgx-a100-80g").node.host_memory_GiB)
    plans = json.loads(result.output)["plans"]
    assert plans and all(0 < p["memory"]["cpu_bytes_per_node"] <= cap for p in plans)


@pytest.mark.parametrize(("zero", "offload", "per_param", "gpu_grad_bytes"), [
    # ZeRO-1/2 (DeepSpeed stage_1_and_2.py): fp32 master partition (4), fp32 gradient partition
    # (4), Adam m and v (8), and the pinned 16-bit copy of the partition the updated weights go
    # back through (2). ZeRO-1 keeps whole 16-bit gradients on the GPU; ZeRO-2 none.
    (1, "optimizer", 18, 2.0),
    (2, "optimizer", 18, 0.0),
    # ZeRO-3 (stage3.py): master, gradient and moments (16); with parameter offload the 16-bit
    # partition too (18).
    (3, "optimizer", 16, None),
    (3, "optimizer+params", 18, None),
])
@pytest.mark.parametrize("nodes", [1, 2])
def test_host_bytes_of_deepspeed_offload_worked_by_hand(zero, offload, per_param, gpu_grad_bytes, nodes):
    """Each node holds its GPUs' partitions: per_param x P / (8 x nodes) x 8, x1.5 for pinned
    buffers. DeepSpeed's ZeRO-2 estimator says P x max(4 x GPUs, 16) x 1.5 instead: its 4 x GPUs
    is the fp32 model every process builds at start-up, a transient that zero.Init or
    meta-device loading avoids, not the steady state a plan must hold."""
    model = load_model("llama-3-8b")
    P = model.total_params()
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    dp = cluster.num_gpus
    cfg = ParallelConfig(dp=dp, zero_stage=zero, offload=offload, micro_batch=1, grad_accum=1, recompute="full",
                         framework="deepspeed")
    plan = estimate(model, cluster, Workload(global_batch=dp, seq_len=2048), cfg)
    assert plan.cpu_bytes_per_node == pytest.approx(per_param * P / nodes * 1.5, rel=1e-12)
    assert plan.memory.optimizer == 0.0
    if gpu_grad_bytes is not None:
        assert plan.memory.grads == pytest.approx(gpu_grad_bytes * P, rel=1e-12)
