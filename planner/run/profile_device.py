"""The device's own rates for ``dsplan profile``: GEMMs by shape, memory bandwidth, collectives.

- GEMM sweep: square and training-shaped (tokens x hidden x 4 hidden) matmuls in the working
  dtype; the best rate is the device's achievable matmul rate (what MAMF is on a GPU:
  reference/mamf_max_achievable_matmul_measured.csv).
- Memory bandwidth: a copy of a buffer far larger than the caches, read plus write bytes.
- Collectives: all-reduce, all-gather and reduce-scatter over ``ranks`` local processes (gloo on
  CPU, NCCL on GPUs) at sizes from 4 KiB to 256 MiB (a model's gradient buckets run to hundreds
  of MiB, where gloo's rate differs from the small sizes'), nccl-tests' byte convention, the
  tensor forms ZeRO calls (all_gather_into_tensor, reduce_scatter_tensor); from these
  ``fit_link`` reads a latency and a bus bandwidth per op.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from planner.cost.measured_blocks import CollectivePoint, GemmPoint
from planner.run.profile_blocks import median_seconds

CPU_GEMM_SIZES = (256, 512, 1024, 2048)
GPU_GEMM_SIZES = (1024, 2048, 4096, 8192)
COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}
COLLECTIVE_SIZES = tuple(4096 * 4**i for i in range(9))  # 4 KiB .. 256 MiB


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def gemm_sweep(device: torch.device, dtype: torch.dtype, warmup: int, repetitions: int,
               hidden: int | None = None) -> list[GemmPoint]:
    """Square GEMMs, plus the MLP up-projection shape of a model of width ``hidden``; on a CPU
    one bf16 GEMM as well (its rate is the bf16 peak a cpu-local hardware profile states)."""
    sizes = GPU_GEMM_SIZES if device.type == "cuda" else CPU_GEMM_SIZES
    shapes = [(n, n, n, dtype) for n in sizes]
    if hidden:
        shapes.append((max(sizes), 4 * hidden, hidden, dtype))
    if device.type == "cpu" and dtype != torch.bfloat16:
        shapes.append((256, 256, 256, torch.bfloat16))
    out = []
    for m, n, k, dt in shapes:
        a = torch.randn(m, k, device=device, dtype=dt)
        b = torch.randn(k, n, device=device, dtype=dt)
        seconds = median_seconds(lambda: a @ b, device, warmup, repetitions)
        out.append(GemmPoint(dtype=DTYPE_NAMES[dt], m=m, n=n, k=k, seconds=seconds))
    return out


def memory_bandwidth(device: torch.device, warmup: int, repetitions: int) -> float:
    """GB/s of a large device-to-device copy (bytes read plus bytes written)."""
    n = COPY_BYTES[device.type] // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, warmup, repetitions)
    return 2.0 * src.nbytes / seconds / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(fn: Callable[[], object], repetitions: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``fn`` after two warm-up calls, every rank starting together."""
    times = []
    for i in range(2 + repetitions):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_rows(repetitions: int) -> list[tuple[str, int, float]]:
    """CPU ranks share the host's memory: each rank's copy rate with every rank copying at once,
    into mapped memory (``copy``) and into memory allocated for it (``alloc_copy``: fresh pages,
    faulted in on first touch, as a runtime's per-step flat buffers are)."""
    src = torch.ones(COPY_BYTES["cpu"] // 4)
    dst = torch.empty_like(src)
    return [("copy", src.nbytes, _timed(lambda: dst.copy_(src), repetitions)),
            ("alloc_copy", src.nbytes, _timed(lambda: torch.empty_like(src).copy_(src), repetitions))]


def _collective_worker(rank: int, world: int, port: int, backend: str, repetitions: int, result: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    rows = _copy_rows(repetitions) if backend == "gloo" else []
    for nbytes in COLLECTIVE_SIZES:
        buf = torch.ones(nbytes // 4, device=device)
        part = torch.ones(nbytes // 4 // world, device=device)
        ops: dict[str, Callable[[], object]] = {
            "allreduce": lambda: dist.all_reduce(buf),
            "allgather": lambda: dist.all_gather_into_tensor(buf, part),
            "reducescatter": lambda: dist.reduce_scatter_tensor(part, buf),
        }
        sync = (lambda: torch.cuda.synchronize(device)) if backend == "nccl" else (lambda: None)
        for op, fn in ops.items():
            rows.append((op, nbytes, _timed(fn, repetitions, sync)))
    if rank == 0:
        result.extend(rows)
    dist.destroy_process_group()


def local_collectives(ranks: int, device_type: str,
                      repetitions: int) -> tuple[list[CollectivePoint], dict[str, float]]:
    """All-reduce, all-gather and reduce-scatter times over ``ranks`` processes on this machine,
    and on CPU ranks each rank's copy rates (GB/s, read plus write) with all of them copying."""
    import torch.multiprocessing as mp

    backend = "nccl" if device_type == "cuda" else "gloo"
    with mp.Manager() as manager:
        result = manager.list()
        mp.spawn(_collective_worker, args=(ranks, free_port(), backend, repetitions, result), nprocs=ranks, join=True)
        rows = list(result)
    copies = {op: 2.0 * n / t / 1e9 for op, n, t in rows if op in ("copy", "alloc_copy")}
    points = [CollectivePoint(op=op, ranks=ranks, nbytes=float(n), seconds=t) for op, n, t in rows if op not in copies]
    return points, copies


def fit_link(points: list[CollectivePoint], op: str = "allreduce") -> tuple[float, float]:
    """(latency seconds, bus bandwidth bytes/s) of ``op`` by least squares on t = a + b x bytes,
    bytes counted as nccl-tests' bus traffic per rank (2(n-1)/n of the buffer for all-reduce)."""
    rows = [p for p in points if p.op == op]
    if len(rows) < 2:
        raise ValueError(f"fit_link: need two {op} sizes, got {len(rows)}")
    n = rows[0].ranks
    factor = 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n
    xs = [p.nbytes * factor for p in rows]
    ys = [p.seconds for p in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return max(my - slope * mx, min(ys) / 10), 1.0 / slope
