"""GEMM times on an A100 worked out by hand from the published figures, not from the module's constants.

Inputs, each from its source:
- A100 SXM bf16 dense peak 312 TFLOP/s and 2,039 GB/s HBM (NVIDIA A100 datasheet);
- its best measured GEMM, 271.2 TFLOP/s (MAMF, reference/mamf_max_achievable_matmul_measured.csv);
- the calibration fitted once on Narayanan et al. 2021 Table 1 and documented in
  planner/cost/README.md: GEMMs sustain 80% of MAMF in a training step, a tile's k-loop reaches
  half efficiency at k = 48, a kernel costs 3 us beyond its work, elementwise traffic runs at 85%
  of HBM;
- cuBLAS's 128 x 128 output tiles on 108 SMs, one tile per SM per wave.

A change to any of these is a change of calibration and must show up here.
"""

from __future__ import annotations

import csv

import pytest

from planner.cost import efficiency as eff
from planner.hardware.load import load_profile
from tests.conftest import REFERENCE_DIR

MAMF_CSV = REFERENCE_DIR / "mamf_max_achievable_matmul_measured.csv"
PEAK = 312e12
HBM = 2039e9 * 0.85
OVERHEAD = 3e-6


@pytest.fixture(scope="module")
def dev():
    return eff.device(load_profile("dgx-a100-80g"))


def _mamf_tflops() -> float:
    rows = list(csv.DictReader(MAMF_CSV.open()))
    row = next(r for r in rows if r["accelerator"] == "NVIDIA A100 SXM" and r["dtype"] == "bf16")
    return float(row["MAMF_TFLOPs"])


def test_the_profile_carries_the_measured_mamf(dev):
    assert _mamf_tflops() == 271.2
    assert dev.peak_flops == PEAK
    assert dev.peak_flops * dev.mamf == pytest.approx(271.2e12, rel=1e-3)  # 86.9% of 312


def test_a_large_square_gemm_runs_at_sustained_mamf(dev):
    # 8192^3: 64 x 64 = 4,096 tiles fill 108 SMs in 38 waves (4,104 slots): 99.8% occupancy.
    rate = 271.2e12 * 0.80 * (4096 / (38 * 108)) * 8192 / (8192 + 48)
    flops = 2 * 8192**3
    assert float(eff.gemm_time(8192, 8192, 8192, dev)) == pytest.approx(flops / rate + OVERHEAD, rel=2e-3)
    assert flops / rate / 1e-3 == pytest.approx(5.11, abs=0.01)  # 5.11 ms at 215 TFLOP/s


def test_a_short_k_gemm_loses_the_k_loop_share(dev):
    # k = 512 (a down-projection sharded 16 ways): the k-loop runs at 512 / (512 + 48) = 91.4% of
    # its long-k rate. Still compute-bound: ~455 FLOP per byte against the A100's ridge of 153.
    rate = 271.2e12 * 0.80 * (4096 / (38 * 108)) * 512 / (512 + 48)
    t = float(eff.gemm_time(8192, 8192, 512, dev))
    assert t == pytest.approx(2 * 8192 * 8192 * 512 / rate + OVERHEAD, rel=2e-3)
    assert 2 * (8192 * 512 * 2 + 8192 * 8192) / HBM < t - OVERHEAD


def test_a_head_dim_k_gemm_is_bound_by_writing_its_output(dev):
    # k = 64 (an attention head): ~64 FLOP per byte, under the ridge, so the 8192 x 8192 bf16
    # output and the operands set the time (78.6 us), not the k-loop (69.4 us of compute).
    bytes_moved = 2 * (8192 * 64 * 2 + 8192 * 8192)
    compute = 2 * 8192 * 8192 * 64 / (271.2e12 * 0.80 * (4096 / (38 * 108)) * 64 / (64 + 48))
    assert compute < bytes_moved / HBM
    assert float(eff.gemm_time(8192, 8192, 64, dev)) == pytest.approx(bytes_moved / HBM + OVERHEAD, rel=1e-6)


def test_a_ragged_tp_shard_pays_for_its_padding_and_last_wave(dev):
    # n = 96 pads to one 128-wide tile column: 64 tiles, one partial wave of 108 SMs.
    tiles_useful = (8192 * 96) / (64 * 128 * 128)  # 0.75 of each tile
    occupancy = 64 / 108
    rate = 271.2e12 * 0.80 * tiles_useful * occupancy * 8192 / (8192 + 48)
    t = float(eff.gemm_time(8192, 96, 8192, dev))
    assert t == pytest.approx(2 * 8192 * 96 * 8192 / rate + OVERHEAD, rel=2e-3)


def test_a_tiny_gemm_is_launch_bound(dev):
    # 64^3: one quarter-filled tile on one SM of 108; 3 us of overhead dominates.
    rate = 271.2e12 * 0.80 * (64 * 64 / (128 * 128)) / 108 * 64 / (64 + 48)
    t = float(eff.gemm_time(64, 64, 64, dev))
    assert t == pytest.approx(2 * 64**3 / rate + OVERHEAD, rel=2e-3)
    assert 4.5e-6 < t < 5.0e-6
