"""Host time DeepSpeed's ZeRO-3 spends per fetched module: the fetch bookkeeping of its hooks.

DeepSpeed's ZeRO-3 runs Python hooks around every module: the parameter coordinator traces,
fetches, waits for and releases each module's parameters in the forward and again in the
backward (deepspeed/runtime/zero/partitioned_param_coordinator.py). That host time does not
shrink with the GPU, and where the device work per module is small it sets the step. This
benchmark measures it on this machine with the real engine: a stack of N small Linear modules
(one weight each, none persistent), forward and backward under ZeRO-3 against ZeRO-0, one
process (DS_ACCELERATOR=cpu, gloo), the median of timed steps after warm-up. The difference
over N is the host seconds per fetched module per forward + backward; the optimizer step is
left out (it runs once per step over flat partitions, not per module).

planner/cost/frameworks.py ZERO3_HOST_S_PER_MODULE records the figure it printed on this
project's 2-core host; a faster host runs the hooks faster, so on GPU nodes it errs slow.

Usage: python benchmarks/bench_zero3_host_overhead.py [--modules N] [--steps S] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _engine(stage: int, modules: int):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(modules)])
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every weight fetched, as a large model's are
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_allow_untested_optimizer": True, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def fwd_bwd_seconds(stage: int, modules: int, steps: int) -> float:
    """Median seconds of one forward + backward (no optimizer step timed) under ``stage``."""
    import torch

    engine = _engine(stage, modules)
    x = torch.randn(4, 32)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        elapsed = time.perf_counter() - start
        engine.step()
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


def measure(modules: int = 200, steps: int = 10) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29600 + os.getpid() % 300)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import torch

    torch.set_num_threads(1)
    plain, zero3 = fwd_bwd_seconds(0, modules, steps), fwd_bwd_seconds(3, modules, steps)
    return {"modules": modules, "zero0_s": plain, "zero3_s": zero3, "host_s_per_module": (zero3 - plain) / modules}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = measure(args.modules, args.steps)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['modules']} modules: forward+backward {out['zero0_s'] * 1e3:.1f} ms under ZeRO-0, "
              f"{out['zero3_s'] * 1e3:.1f} ms under ZeRO-3: {out['host_s_per_module'] * 1e6:.0f} us of host time "
              "per fetched module")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
