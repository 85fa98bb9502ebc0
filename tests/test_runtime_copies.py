"""What DeepSpeed's data-parallel path costs beyond its collectives, and what a CPU rank hides.

- DeepSpeed copies gradients into new flat tensors and back around each reduction, and gathers
  ZeRO-3 weights into new storage (cost/runtime_copies.py). On a GPU that is HBM traffic of a
  few milliseconds; on CPU ranks a fresh allocation is faulted in on first touch, at the
  ``alloc_copy_GBps`` that ``dsplan profile`` measures.
- A CPU rank's cores run its collectives: nothing overlaps (step_time.dp_exposed).
- Weights are gathered in the working precision (fp32 runs gather 4 bytes per weight).
- A collective library whose ops do not follow NCCL's ring (gloo) carries each op's measured
  share of the all-reduce's bus bandwidth (``node.intra.op_share``).
"""

from __future__ import annotations

import numpy as np
import pytest

from planner import api
from planner.cost import efficiency as eff
from planner.cost.collectives import collective_seconds
from planner.cost.runtime_copies import flat_copy_seconds, fresh_buffer_seconds, grad_reduction_copies
from planner.hardware.load import load_profile
from planner.hardware.placement import contiguous_shape

GB = 1e9


def _cpu(**gpu: float):
    """The built-in cpu-local profile with its GPU section changed."""
    base = load_profile("cpu-local")
    return base.model_copy(update={"gpu": base.gpu.model_copy(update=gpu)})


def test_a_gpu_allocates_from_its_cache_so_first_touch_costs_nothing():
    dev = eff.device(load_profile("dgx-h100"))
    assert dev.first_touch_s_per_byte == 0.0
    assert fresh_buffer_seconds(dev, np.array([1e9]))[0] == 0.0
    # a flat copy is then an HBM copy: read and write at the effective HBM rate
    assert flat_copy_seconds(dev, np.array([1e9]))[0] == pytest.approx(2e9 / dev.hbm_effective)


def test_first_touch_is_what_a_copy_into_new_memory_costs_beyond_a_mapped_copy():
    dev = eff.device(_cpu(hbm_GBps=20.0, alloc_copy_GBps=4.0))
    per_byte = 2 / (4 * GB * dev.hbm_efficiency) - 2 / (20 * GB * dev.hbm_efficiency)
    assert dev.first_touch_s_per_byte == pytest.approx(per_byte)
    # a copy into new memory then takes exactly the measured fresh-copy rate
    assert flat_copy_seconds(dev, np.array([5e8]))[0] == pytest.approx(2 * 5e8 / (4 * GB * dev.hbm_efficiency))


def test_deepspeed_copies_per_reduction_by_zero_stage():
    """ZeRO-0: flat copy (new memory) and all of it back. ZeRO-1: flat copy and the owned 1/dp back.
    ZeRO-2: also the contiguous bucket (new each step) and the owned share into the partition buffer."""
    dev = eff.device(_cpu(hbm_GBps=20.0, alloc_copy_GBps=4.0))
    g, hbm, ft = 1e9, dev.hbm_effective, dev.first_touch_s_per_byte
    got = grad_reduction_copies(dev, np.full(3, g), np.full(3, 4), np.array([0, 1, 2]))
    want = [2 * 2 * g / hbm + g * ft,
            2 * 1.25 * g / hbm + g * ft,
            2 * 2.5 * g / hbm + 2.25 * g * ft]
    assert got == pytest.approx(want)
    assert got[2] > got[0] > got[1]


def test_on_gpus_the_copies_stay_small_beside_the_reduction():
    """A 7B model's ZeRO-2 step on 8 H100: the copies add under 2% of the step."""
    cluster = api.load_cluster("dgx-h100")
    plan = api.estimate("llama-2-7b", cluster, zero=2, micro_batch=1, global_batch=64, seq_len=4096)
    dev = eff.device(cluster.profile)
    copies = grad_reduction_copies(dev, np.array([2 * 6.7e9]), np.array([8]), np.array([2]))[0]
    assert 0 < copies < 0.02 * plan.step_time_s


def _estimate(hardware, **knobs):
    cluster = api.load_cluster(hardware, gpus_per_node=2)
    return api.estimate("gpt3-125m", cluster, global_batch=2, micro_batch=1, seq_len=128, precision="fp32", **knobs)


def test_a_cpu_rank_hides_none_of_its_gradient_reduction():
    """ZeRO-2 on cpu-local: the reduction's all-reduce is paid in full after the backward (gloo
    calls on the cores that compute); on a GPU node the same plan hides it under the backward."""
    plan = _estimate("cpu-local", zero=2)
    cluster = api.load_cluster("cpu-local", gpus_per_node=2)
    allreduce = collective_seconds(cluster, "allreduce", contiguous_shape(cluster, 2), 4 * 125.2e6)
    assert plan.time.dp_comm > allreduce
    gpu = api.estimate("gpt3-125m", api.load_cluster("dgx-a100-80g", gpus_per_node=2), global_batch=2,
                       micro_batch=1, seq_len=2048, precision="fp32", zero=2)
    gpu_allreduce = collective_seconds(gpu_cluster := api.load_cluster("dgx-a100-80g", gpus_per_node=2), "allreduce",
                                       contiguous_shape(gpu_cluster, 2), 4 * 125.2e6)
    assert gpu.time.dp_comm < gpu_allreduce


def test_fp32_training_gathers_four_bytes_per_weight():
    """ZeRO-3 on cpu-local (nothing hides): the forward and backward gathers of fp32 weights are
    twice the bytes of bf16 ones, so the data-parallel time grows by about the gathers' time."""
    cluster = api.load_cluster("cpu-local", gpus_per_node=2)
    fp32 = api.estimate("gpt3-125m", cluster, global_batch=2, micro_batch=1, seq_len=128, precision="fp32", zero=3)
    bf16 = api.estimate("gpt3-125m", cluster, global_batch=2, micro_batch=1, seq_len=128, precision="bf16", zero=3)
    gather_bf16 = collective_seconds(cluster, "allgather", contiguous_shape(cluster, 2), 2 * 125.2e6)
    # fp32: two more gathers' worth (forward and backward) of 2 more bytes, plus 2 more bytes of gradients
    assert fp32.time.dp_comm - bf16.time.dp_comm > 2 * 0.8 * gather_bf16


def _with_op_share(share: dict[str, float]):
    base = load_profile("cpu-local")
    return base.model_copy(update={"node": base.node.model_copy(update={
        "intra": base.node.intra.model_copy(update={"op_share": share})})})


def test_a_measured_op_share_slows_that_op_only():
    base, slow = _with_op_share({}), _with_op_share({"allgather": 0.25})
    a, b = api.load_cluster(base, gpus_per_node=2), api.load_cluster(slow, gpus_per_node=2)
    shape_a, shape_b = contiguous_shape(a, 2), contiguous_shape(b, 2)
    big = 256 * 2**20
    assert collective_seconds(b, "allgather", shape_b, big) == pytest.approx(
        4 * collective_seconds(a, "allgather", shape_a, big), rel=0.05)
    assert collective_seconds(b, "allreduce", shape_b, big) == collective_seconds(a, "allreduce", shape_a, big)
