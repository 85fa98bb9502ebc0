"""The GEMM burn-in of ``preflight.sh``: a short bf16 matmul loop on each GPU of the node.

Each GPU's rate is compared with the profile's achievable one (peak x matmul_efficiency): a
GPU that is power-capped, hot, clock-locked or on the wrong PCIe link runs the whole job at
its pace, since every step waits for the slowest rank. Also prints the torch / CUDA / NCCL
versions the job will run with.
"""

from __future__ import annotations

from typing import Any

from planner.run.preflight_spec import Check, Expectations, Gpu

# 8192^3 bf16: 1.1 TFLOP per product, ~4 ms on A100; 10 warm-up and 50 timed products take
# under half a second per GPU, long enough for clocks to settle (NVIDIA's boost ramps in ms).
SIZE, WARMUP, ITERS = 8192, 10, 50


def _tflops(torch: Any, device: int) -> float:
    a = torch.randn(SIZE, SIZE, device=f"cuda:{device}", dtype=torch.bfloat16)
    b = torch.randn(SIZE, SIZE, device=f"cuda:{device}", dtype=torch.bfloat16)
    for _ in range(WARMUP):
        torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        start.record()
        for _ in range(ITERS):
            torch.matmul(a, b)
        end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return 2 * SIZE**3 * ITERS / seconds / 1e12


def gemm_checks(exp: Expectations, gpus: list[Gpu] | None, local: bool) -> list[Check]:
    """A versions line, then one check per GPU (or one saying why none ran)."""
    try:
        import torch
    except ImportError:
        return [Check("gemm", "SKIP", "torch is not installed for this Python (DSPLAN_PYTHON)")]
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    versions = Check("versions", "INFO", f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, "
                     f"HIP {getattr(torch.version, 'hip', None) or '-'}, NCCL {nccl}")
    if not torch.cuda.is_available():
        if gpus:  # nvidia-smi lists GPUs, torch sees none
            if local:
                return [versions, Check("gemm", "SKIP", "skipped: no GPU for torch (--local trains on CPUs)")]
            return [versions, Check("gemm", "FAIL", f"nvidia-smi lists {len(gpus)} GPU(s) but torch sees none",
                                    "install your CUDA build of torch (torch.version.cuda is None for a CPU build) "
                                    "and check CUDA_VISIBLE_DEVICES")]
        if gpus is not None and not local:  # nvidia-smi runs and lists no GPU
            return [versions, Check("gemm", "FAIL", f"no GPU; the plan expects {exp.gpus_per_node}",
                                    "run on a GPU node, or look for a GPU fallen off the bus (`dmesg | grep -i xid`)")]
        return [versions, Check("gemm", "SKIP", "skipped: no GPU")]
    target = exp.gemm.target_TFLOPs
    floor = target * exp.gemm.min_fraction
    checks = [versions]
    for device in range(torch.cuda.device_count()):
        rate = _tflops(torch, device)
        detail = (f"GPU {device}: {rate:.0f} TFLOP/s bf16 = {100 * rate / target:.0f}% of the achievable "
                  f"{target:.0f} ({exp.gemm.peak_TFLOPs:g} peak x {exp.gemm.matmul_efficiency:g}; limit "
                  f"{100 * exp.gemm.min_fraction:.0f}%)")
        if rate < floor:
            checks.append(Check(f"gemm gpu{device}", "FAIL", detail,
                                "`nvidia-smi -q -d CLOCK,PERFORMANCE,POWER,TEMPERATURE` for throttling or a "
                                "power cap; `nvidia-smi -rgc` resets locked clocks; another process on the GPU "
                                "(`nvidia-smi`) takes its share"))
        else:
            checks.append(Check(f"gemm gpu{device}", "PASS", detail))
    return checks
