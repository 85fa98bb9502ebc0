"""How fast one GPU runs a kernel: GEMMs by shape, attention, memory-bound work.

A GEMM's time is a roofline over the GPU's *achievable* numbers, not one constant:

    t = max(flops / (peak * mamf * GEMM_SUSTAINED * tile_eff * k_eff), bytes / (hbm * HBM_EFFICIENCY))
        + KERNEL_OVERHEAD_S

- ``mamf``: the largest fraction of the dense peak a well-shaped bf16 GEMM reaches on this GPU
  (profile.gpu.matmul_efficiency, from reference/mamf_max_achievable_matmul_
  measured.csv: A100 SXM 86.9%, H100 SXM 80.3%).
- ``tile_eff``: wave quantisation. cuBLAS covers the m x n output with 128x128 (bf16) tiles and
  runs them in waves of one tile per SM; a partial last wave and the padding of ragged edges
  idle SMs. Matters for narrow TP shards and small expert GEMMs.
- ``k_eff = k / (k + K_HALF)``: a tile's main loop over k amortises its prologue and epilogue
  (loading C, writing the tile); small k (attention head dims, TP-sharded down-projections)
  runs well below MAMF.
- memory side: a GEMM with small m, n or k moves more bytes per FLOP than the GPU's ridge point
  (A100: 312e12 / 2.04e12 = 153 FLOP/byte) and is HBM-bound.

Elementwise work (norms, activations, softmax, dropout, residual adds, the optimizer step) is
HBM-bound: bytes / (hbm * HBM_EFFICIENCY).

FlashAttention (Dao 2023, FlashAttention-2, Fig. 5-6): forward reaches 50-73% of the A100 peak
and the backward somewhat less, higher for head dim 128 than 64; causal masking skips half of
the score blocks. ``flash_efficiency`` reproduces that band from the head dim, levelling off at
the GPU's MAMF. On Hopper the same kernel levels off much lower: FlashAttention-2 is written
with Ampere's synchronous mma.sync and cp.async, not Hopper's wgmma and TMA, and reaches only
35% of the H100 peak (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract; FA3,
which uses them, reaches 75%). Hopper profiles carry that as
``gpu.flash_attention_efficiency`` (the level at which head dim 128 lands on 35%).

Every function here takes numpy arrays as well as floats, so the search can evaluate many
candidates at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost.precision import RECIPES, check_recipe
from planner.hardware.profile import HardwareProfile

# Global factors: the only constants fitted to measurements, once for all models and
# clusters, on Narayanan et al. 2021 Table 1 as a whole (benchmarks/bench_megatron_table1.py;
# never per row). Both sit inside published ranges:
# - HBM_EFFICIENCY: share of the datasheet bandwidth that training's elementwise kernels
#   (LayerNorm, fused softmax, dropout, bias-GELU, Adam) sustain: a device copy reaches
#   ~85-90% on A100/H100; kernels with reductions somewhat less.
# - GEMM_SUSTAINED: share of MAMF that GEMMs keep inside a training step. MAMF is the best
#   shape of an isolated sweep at boost clocks; in a run the backward's transposed operand
#   layouts (dgrad, wgrad), clocks under sustained power draw, cold caches after memory-bound
#   kernels and NCCL kernels sharing the SMs cost 15-25% (ml-engineering, compute/accelerator/
#   README.md: MAMF is an upper bound that real training does not reach).
# Fitted jointly: along the line of equal Table 1 error, the pair with the larger GEMM loss
# also keeps Llama-class runs (FlashAttention, little memory-bound work) in the published MFU
# band; see planner/cost/README.md.
HBM_EFFICIENCY = 0.85
GEMM_SUSTAINED = 0.80
# FP8 GEMMs keep a smaller share of their (doubled) peak than bf16 ones: the measured MAMF ratio on
# Hopper, H100 70.9 / 80.3 % = 0.883 and H200 73.4 / 80.3 % = 0.914 (reference/
# mamf_max_achievable_matmul_measured.csv; the source gives H200's bf16 as H100's), 0.90 on
# average. A GPU without a measured FP8 MAMF (Blackwell) takes its bf16 share times it.
FP8_MAMF_RATIO = 0.90
KERNEL_OVERHEAD_S = 3e-6  # per kernel: launch tail, ramp-up and the epilogue wave
K_HALF = 48.0  # k at which a GEMM tile's main loop reaches half efficiency
TILE = 128  # output tile edge cuBLAS uses for large bf16 GEMMs
FLASH_HEAD_HALF = 40.0  # head dim at which FlashAttention-2 reaches half of MAMF
FLASH_BWD_RATIO = 0.80  # backward efficiency relative to the forward (FlashAttention-2 Fig. 6 vs 5)
# FlashAttention-1 (and the Triton port llm-foundry's MPT runs) against FlashAttention-2: "around 2x
# speedup compared to FlashAttention", which reaches "only 25-40%" of the A100 peak (Dao 2023,
# arXiv:2307.08691, abstract); the Triton port is "slightly slower" than the CUDA one overall
# (flash-attention's flash_attn_triton.py at eff9fe6, its header).
FLASH1_SPEED = 0.5

# Streaming multiprocessors per GPU (vendor whitepapers), for wave quantisation.
_SMS = {"A100": 108, "H100": 132, "H200": 132, "H800": 132, "GH200": 132, "B200": 148, "L40S": 142,
        "MI250X": 110, "MI300X": 304, "V100": 80,
        "CPU rank": 1}  # a cpu-local rank (planner/run/profile_hardware.py): one thread's BLAS runs one tile at a time


@dataclass(frozen=True, slots=True)
class Device:
    """The few numbers of one GPU the time model needs, in SI units."""

    peak_flops: float  # dense FLOP/s in the training dtype
    mamf: float  # achievable fraction of peak for well-shaped GEMMs
    hbm: float  # bytes/s
    sms: int
    flash: float | None = None  # FlashAttention's level as a fraction of peak; None: mamf
    low: "Device | None" = None  # the recipe's GEMM format (precision.py), None without one
    low_bytes: float = 2.0  # bytes per element of that format's operands
    gemm_sustained: float = GEMM_SUSTAINED  # x the profile's calibration.gemm
    hbm_efficiency: float = HBM_EFFICIENCY  # x the profile's calibration.hbm
    alloc_copy: float | None = None  # bytes/s of a copy into new memory (GPU.alloc_copy_GBps); None: hbm
    flash_speed: float = 1.0  # the FlashAttention generation's rate against FlashAttention-2 (Workload.flash_version)

    @property
    def flash_ceiling(self) -> float:
        return self.mamf if self.flash is None else self.flash

    @property
    def mfu_peak(self) -> float:
        """MFU's denominator: the dense peak of the format the linear GEMMs run in (a recipe's
        FP8/FP4 peak, else the working dtype's), so MFU says how much of that rate a plan uses."""
        return self.low.peak_flops if self.low is not None else self.peak_flops

    @property
    def hbm_effective(self) -> float:
        return self.hbm * self.hbm_efficiency

    @property
    def first_touch_s_per_byte(self) -> float:
        """What a buffer allocated anew costs per byte beyond a copy into mapped memory: the page
        faults of its first touch (0 on a GPU, whose caching allocator reuses mapped memory)."""
        if self.alloc_copy is None:
            return 0.0
        return max(0.0, 2.0 / (self.alloc_copy * self.hbm_efficiency) - 2.0 / self.hbm_effective)


def device(profile: HardwareProfile, dtype: str = "bf16", recipe: str | None = None, flash_version: int = 2) -> Device:
    """The GPU in the working ``dtype``; with a TE ``recipe``, ``low`` is the GPU in the
    recipe's GEMM format, at its measured MAMF where the profile has one (H100 fp8: 70.9%), else
    at the bf16 share (times FP8_MAMF_RATIO for FP8). ``flash_version`` 1 runs FlashAttention at
    FLASH1_SPEED of FlashAttention-2's rate."""
    gpu, cal = profile.gpu, profile.calibration
    rates = {"gemm_sustained": GEMM_SUSTAINED * cal.gemm, "hbm_efficiency": HBM_EFFICIENCY * cal.hbm}
    sms = next((n for key, n in _SMS.items() if key.lower() in gpu.name.lower()), 108)
    low = None
    if recipe is not None:
        check_recipe(recipe, gpu.peak_TFLOPs, gpu.name)  # type: ignore[arg-type]
        r = RECIPES[recipe]
        borrowed = gpu.matmul_efficiency * (FP8_MAMF_RATIO if r.gemm_format == "fp8" else 1.0)
        mamf = gpu.matmul_efficiency_low.get(r.gemm_format, borrowed)  # type: ignore[call-overload]
        low = Device(gpu.peak_flops(r.gemm_format), mamf, gpu.hbm_GBps * 1e9, sms, **rates)
    return Device(gpu.peak_flops(dtype), gpu.matmul_efficiency, gpu.hbm_GBps * 1e9, sms, gpu.flash_attention_efficiency,
                  low, RECIPES[recipe].element_bytes if recipe else 2.0, **rates,
                  alloc_copy=gpu.alloc_copy_GBps * 1e9 if gpu.alloc_copy_GBps else None,
                  flash_speed=FLASH1_SPEED if flash_version == 1 else 1.0)


def tile_efficiency(m, n, sms: int):
    """Useful share of the SM-time of a GEMM's output tiles (padding and the last wave)."""
    m = np.asarray(m, dtype=float)
    n = np.asarray(n, dtype=float)
    tm = np.maximum(np.ceil(m / TILE), 1.0)
    tn = np.maximum(np.ceil(n / TILE), 1.0)
    tiles = tm * tn
    waves = np.ceil(tiles / sms)
    padding = (m * n) / (tm * tn * TILE * TILE)
    occupancy = tiles / (waves * sms)
    return np.clip(padding * occupancy, 1e-3, 1.0)


def gemm_efficiency(m, n, k, dev: Device):
    """Fraction of the dense peak a (m x k) @ (k x n) GEMM reaches on the compute side."""
    k = np.asarray(k, dtype=float)
    return dev.mamf * dev.gemm_sustained * tile_efficiency(m, n, dev.sms) * k / (k + K_HALF)


def gemm_time(m, n, k, dev: Device, batch=1, bytes_per_el: int = 2):
    """Seconds for ``batch`` GEMMs of (m x k) @ (k x n)."""
    m = np.asarray(m, dtype=float)
    n = np.asarray(n, dtype=float)
    k = np.asarray(k, dtype=float)
    flops = 2.0 * m * n * k * batch
    # Batched small GEMMs (experts, heads) fill the GPU together: quantise over all of them.
    eff = dev.mamf * dev.gemm_sustained * tile_efficiency(m * batch, n, dev.sms) * k / (k + K_HALF)
    compute = flops / (dev.peak_flops * eff)
    memory = bytes_per_el * (m * k + k * n + m * n) * batch / dev.hbm_effective
    return np.where(flops > 0, np.maximum(compute, memory) + KERNEL_OVERHEAD_S, 0.0)


def flash_efficiency(head_dim, dev: Device):
    """FlashAttention's forward efficiency as a fraction of the peak (FlashAttention-2's, times
    the generation's ``dev.flash_speed``)."""
    d = np.asarray(head_dim, dtype=float)
    calibrated = dev.gemm_sustained / GEMM_SUSTAINED  # the profile's calibration.gemm
    return dev.flash_ceiling * d / (d + FLASH_HEAD_HALF) * calibrated * dev.flash_speed


def flash_time(flops, head_dim, causal: bool, dev: Device, backward: bool = False):
    """Forward (or backward: 2.5x the FLOPs, 5 matmuls against 2) of FlashAttention."""
    work = np.asarray(flops, dtype=float) * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    eff = flash_efficiency(head_dim, dev) * (FLASH_BWD_RATIO if backward else 1.0)
    return np.where(work > 0, work / (dev.peak_flops * eff) + KERNEL_OVERHEAD_S, 0.0)


def hbm_time(nbytes, dev: Device):
    """Seconds to stream ``nbytes`` through HBM (read + write already counted by the caller)."""
    return np.asarray(nbytes, dtype=float) / dev.hbm_effective


def adam_step_bytes(moment_bytes: int = 4, master_bytes: int = 4) -> float:
    """Optimizer step traffic per parameter held by this GPU (fused multi-tensor Adam): read and
    write the master weight and both moments, read the fp32 gradient (4), write the 16-bit
    working copy (2), plus the gradient-norm/overflow pass (4): 34 bytes in fp32. With 16-bit
    master remainders (TE's FusedAdam, store_param_remainders) the step also reads the 16-bit
    weight the remainder completes (2)."""
    remainder_read = 2 if master_bytes < 4 else 0
    return 2.0 * master_bytes + 4.0 * moment_bytes + 4 + 2 + remainder_read + 4


ADAM_STEP_BYTES = adam_step_bytes()
SGD_STEP_BYTES = 18.0
