"""Host Adam speed: torch's fused CPU AdamW (what Megatron-Core's HybridDeviceOptimizer steps
with, megatron/core/optimizer/__init__.py) against DeepSpeedCPUAdam (ZeRO-Offload).

    python benchmarks/bench_cpu_adam.py [--params 5e7] [--threads 2] [--repeat 5]

The cost model prices both offload runtimes at the hardware profile's ``cpu_adam_GBps``
(planner/cost/step_time.py: ``cpu_optimizer_time``, ``hybrid_optimizer_time``). This prints
the measured rate of each kernel on this host and their ratio, the figure that says whether
one rate may stand for both. Both stream ~28-30 bytes per parameter (fp32 weight, gradient
and two moments read, three written), so on a many-core server both approach the memory
bandwidth; on a small host the arithmetic shows through.

Needs the run extra (DeepSpeed); the first run JIT-builds DeepSpeed's cpu_adam op (a minute
or two, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def seconds_per_step(make_optimizer, params: int, repeat: int) -> float:
    """Best of ``repeat`` steps over one fp32 tensor of ``params`` elements (after a warm-up step
    that creates the moments)."""
    import torch

    weight = torch.nn.Parameter(torch.randn(params))
    weight.grad = torch.randn(params)
    opt = make_optimizer([weight])
    opt.step()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=5e7, help="fp32 parameters stepped (default 5e7)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / OpenMP threads")
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    import torch

    torch.set_num_threads(opts.threads)
    n = int(opts.params)
    kernels = {
        "torch AdamW fused=True (Megatron HybridDeviceOptimizer)":
            lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch AdamW foreach (torch's default)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        kernels["DeepSpeedCPUAdam (ZeRO-Offload)"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, adamw_mode=True)
    except ImportError as err:  # the run extra is not installed
        print(f"DeepSpeedCPUAdam unavailable ({err}); install the run extra")
    print(f"{n:.3g} fp32 parameters, {opts.threads} thread(s), best of {opts.repeat}")
    print(f"{'kernel':<58} {'ms/step':>8} {'Gparam/s':>9} {'GB/s of fp32 params':>20}")
    times = {}
    for label, make in kernels.items():
        t = seconds_per_step(make, n, opts.repeat)
        times[label] = t
        print(f"{label:<58} {t * 1e3:8.1f} {n / t / 1e9:9.3f} {4 * n / t / 1e9:20.2f}")
    fused = next(t for k, t in times.items() if "fused" in k)
    ds = next((t for k, t in times.items() if "DeepSpeed" in k), None)
    if ds is not None:
        print(f"torch fused AdamW steps {ds / fused:.2f}x as fast as DeepSpeedCPUAdam on this host")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
