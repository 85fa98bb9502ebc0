"""Model-state memory equals DeepSpeed 0.19's own estimators for the same inputs."""

from __future__ import annotations

import csv
import itertools

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from planner.cost import memory as mem

CASES = [(2_851_000_000, 8, 1), (125_000_000, 1, 1), (6_738_415_616, 8, 4), (70_553_706_496, 8, 16), (1_000_003, 4, 3)]


@pytest.mark.parametrize("total,gpn,nodes", CASES)
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeed(total, gpn, nodes, offload):
    ours = mem.zero2_model_states_mem_needs(total, gpn, nodes, offload)
    assert ours == estimate_zero2_model_states_mem_needs(total, gpn, nodes, offload)
    # and the planner's per-parameter accounting gives the same GPU bytes
    states = mem.model_states(total, 0, framework="deepspeed", zero=2, offload="optimizer" if offload else "none",
                              dp=gpn * nodes, ep=1)
    assert int(states.gpu) == pytest.approx(ours[1], abs=1)


@pytest.mark.parametrize("total,gpn,nodes", CASES)
@pytest.mark.parametrize("offload,offload_params,zero_init", list(itertools.product([False, True], repeat=3)))
def test_zero3_matches_deepspeed(total, gpn, nodes, offload, offload_params, zero_init):
    largest = total // 50
    theirs = estimate_zero3_model_states_mem_needs(total, largest, gpn, nodes, offload, offload_params, zero_init)
    ours = mem.zero3_model_states_mem_needs(total, largest, gpn, nodes, offload, offload_params, zero_init)
    assert ours == theirs
    if offload and not offload_params:
        mode = "optimizer"
    elif offload:
        mode = "optimizer+params"
    else:
        mode = "none"
    states = mem.model_states(total, 0, framework="deepspeed", zero=3, offload=mode, dp=gpn * nodes, ep=1,
                              live_layer_params=largest)
    assert int(states.gpu) == pytest.approx(theirs[1], abs=1)
    if offload and zero_init:  # steady-state host memory per node equals DeepSpeed's zero.Init estimate
        assert mem.cpu_bytes_per_node(states.cpu, gpn) == pytest.approx(theirs[0], rel=1e-9)


def test_documented_examples(reference_dir):
    """The worked examples in DeepSpeed's memory docs (2851M params, 1 node x 8 GPUs)."""
    rows = list(csv.DictReader(open(reference_dir / "deepspeed_memory_estimator.csv")))
    assert rows[1]["example(2851M params, 1 node x 8 GPUs)"].startswith("5.31GB/GPU")
    p = 2851 * 10**6
    # (The docs' ZeRO-2 no-offload example, 15.93 GB, is the older 4P + 16P/N formula; 0.19's
    # code says 2P + 18P/N, which the test above checks against the code itself.)
    assert mem.zero2_model_states_mem_needs(p, 8, 1, False)[1] == 2 * p + 18 * p // 8
    assert mem.zero2_model_states_mem_needs(p, 8, 1, True)[1] / 2**30 == pytest.approx(5.31, abs=0.01)
    cpu, gpu, _ = mem.zero3_model_states_mem_needs(p, 32 * 10**6, 8, 1, False, False, True)
    assert gpu / 2**30 == pytest.approx(6.09, abs=0.01)
    cpu, gpu, _ = mem.zero3_model_states_mem_needs(p, 32 * 10**6, 8, 1, True, True, True)
    assert gpu / 2**30 == pytest.approx(0.12, abs=0.01) and cpu / 2**30 == pytest.approx(71.69, abs=0.01)
