"""A hardware profile's calibration section scales the rates it names, and only those.

Each factor of planner.hardware.profile.Calibration multiplies one achieved rate of the cost
model: gemm the GEMM and attention kernels, hbm the memory-bound kernels, network the
collectives' bandwidth, overlap the share of compute that hides data-parallel traffic.
"""

from __future__ import annotations

import pytest

from planner import api
from planner.cost import efficiency as eff
from planner.cost.collectives import collective_time
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import contiguous_shape
from planner.hardware.profile import Calibration


def _calibrated(**factors: float):
    profile = load_profile("dgx-a100-80g")
    return profile.model_copy(update={"calibration": Calibration(**factors)})


def test_the_gemm_factor_scales_compute_bound_gemms_and_attention():
    base, fast = eff.device(load_profile("dgx-a100-80g")), eff.device(_calibrated(gemm=1.25))
    big = (8192, 8192, 8192)
    t0 = float(eff.gemm_time(*big, base)) - eff.KERNEL_OVERHEAD_S
    t1 = float(eff.gemm_time(*big, fast)) - eff.KERNEL_OVERHEAD_S
    assert t0 / t1 == pytest.approx(1.25, rel=1e-9)
    a0 = float(eff.flash_time(1e12, 128, True, base)) - eff.KERNEL_OVERHEAD_S
    a1 = float(eff.flash_time(1e12, 128, True, fast)) - eff.KERNEL_OVERHEAD_S
    assert a0 / a1 == pytest.approx(1.25, rel=1e-9)
    assert float(eff.hbm_time(1e9, base)) == float(eff.hbm_time(1e9, fast))


def test_the_hbm_factor_scales_memory_bound_work_only():
    base, slow = eff.device(load_profile("dgx-a100-80g")), eff.device(_calibrated(hbm=0.5))
    assert float(eff.hbm_time(1e9, slow)) == pytest.approx(2 * float(eff.hbm_time(1e9, base)))
    big = (8192, 8192, 8192)
    assert float(eff.gemm_time(*big, base)) == float(eff.gemm_time(*big, slow))


def test_the_network_factor_scales_bandwidth_not_latency():
    base = Cluster.build(load_profile("dgx-a100-80g"), 2)
    fast = Cluster.build(_calibrated(network=2.0), 2)
    shape = contiguous_shape(base, 16)
    small, large = 1024.0, 2.0**31
    b_small, f_small = (collective_time(c, "allreduce", shape, small).time_s for c in (base, fast))
    b_large, f_large = (collective_time(c, "allreduce", shape, large).time_s for c in (base, fast))
    assert f_large == pytest.approx(b_large / 2, rel=0.05)  # bandwidth-bound: halved, less its latency
    assert f_small > 0.9 * b_small  # latency-bound: barely moves


def test_overlap_zero_leaves_all_data_parallel_traffic_exposed():
    def dp_seconds(profile) -> float:
        cluster = api.load_cluster(profile, nodes=2)
        return api.estimate("gpt3-1.3b", cluster, dp=16, zero=1, micro_batch=1, global_batch=16, seq_len=2048,
                            framework="megatron").time.dp_comm

    # Megatron overlaps the 1.3B model's gradient reduce-scatter (2.6 GB across 2 nodes) with
    # the backward: all of it hides, none with overlap 0, part with a small share
    hidden, exposed = dp_seconds(load_profile("dgx-a100-80g")), dp_seconds(_calibrated(overlap=0.0))
    assert hidden == 0.0
    assert exposed > 0.03
    assert 0.0 < dp_seconds(_calibrated(overlap=0.05)) < exposed


def test_a_calibrated_plan_says_so_in_its_notes():
    cluster = api.load_cluster(_calibrated(gemm=0.7, network=0.5), nodes=1)
    plan = api.estimate("gpt3-125m", cluster, dp=8, micro_batch=1, global_batch=8, seq_len=512)
    assert any("calibrated: gemm x0.7, hbm x1, network x0.5, overlap 1" in n for n in plan.notes)
    plain = api.estimate("gpt3-125m", api.load_cluster("dgx-a100-80g"), dp=8, micro_batch=1, global_batch=8,
                         seq_len=512)
    assert not any("calibrated" in n for n in plain.notes)
