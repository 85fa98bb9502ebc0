"""A hardware profile of this machine's CPUs from ``dsplan profile --device cpu``'s measurements.

``dsplan run --local`` runs each planned GPU as one CPU process (gloo); priced on this
profile, a plan's prediction and the local run refer to the same job. What each field is:

- ``gpu``: one rank, i.e. the cores a local process gets. Its "peak" is the best GEMM rate
  the sweep measured per dtype (a CPU's BLAS has no datasheet peak it reaches; the cost model's
  sustained share then applies as on a GPU), its memory the host's RAM over the ranks, its
  "HBM" the copy bandwidth each rank measured while every rank copied (they share the host's
  memory channels), and ``alloc_copy_GBps`` the same into freshly allocated memory;
- ``node.intra``: the local collectives' latency and bus bandwidth (nccl_algorithms' Simple
  ring over two ranks: latency 2(n-1) steps plus the call overhead), as gloo ran its all-reduce,
  and each other op's measured bus bandwidth as a share of the all-reduce's (``op_share``: gloo's
  all-gather and reduce-scatter do not follow NCCL's ring);
- ``nics`` and ``fabric``: a node simulated by another launcher on the same machine talks over
  loopback, the same path, so the same rate.
"""

from __future__ import annotations

import os
from typing import Any

from planner.cost.measured_blocks import LayerProfile
from planner.cost.nccl_algorithms import CALL_OVERHEAD_S, SIMPLE
from planner.run.profile_device import fit_link

GiB = 2**30


def host_memory_GiB() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def cpu_hardware_profile(profile: LayerProfile, name: str, ranks: int, cores: int | None = None) -> dict[str, Any]:
    """The YAML mapping of a hardware profile for ``ranks`` CPU processes on this machine."""
    cores = cores or os.cpu_count() or 1
    peaks = {dt: round(rate / 1e12, 6) for dt in ("fp32", "bf16", "fp16")
             if (rate := profile.matmul_flops_per_s(dt)) is not None}
    lat_s, busbw = fit_link(list(profile.collectives)) if profile.collectives else (1e-3, 1e9)
    step_s = max(1e-6, (lat_s - CALL_OVERHEAD_S) / (2 * max(1, ranks - 1)) - SIMPLE.step_extra_s)
    link_GBps = round(busbw / SIMPLE.efficiency / 1e9, 3)
    memory = host_memory_GiB()
    hbm = profile.rank_copy_GBps or profile.memory_bandwidth_GBps or 10.0
    measured_ops = {p.op for p in profile.collectives}
    op_share = {op: round(min(4.0, fit_link(list(profile.collectives), op)[1] / busbw), 4)
                for op in ("allgather", "reducescatter") if op in measured_ops}
    return {
        "name": name,
        "description": f"this machine's CPUs as {ranks} ranks ({profile.device}), measured by dsplan profile",
        "gpu": {"name": f"CPU rank ({profile.device})", "vendor": "cpu", "memory_GiB": round(memory / ranks, 2),
                "peak_TFLOPs": peaks, "hbm_GBps": round(hbm, 3), "matmul_efficiency": 1.0,
                **({"alloc_copy_GBps": round(profile.alloc_copy_GBps, 3)} if profile.alloc_copy_GBps else {})},
        "node": {"gpus": ranks,
                 "intra": {"kind": "pcie", "bw_GBps": link_GBps, "latency_us": round(step_s * 1e6, 3),
                           "op_share": op_share},
                 "nics": {"count": 1, "speed_gbit": round(link_GBps * 8, 3), "gpus_per_nic": ranks,
                          "latency_us": round(step_s * 1e6, 3), "gpudirect_rdma": False},
                 "pcie_GBps": round(hbm, 3), "host_memory_GiB": round(memory, 2),
                 "cpu_cores": cores},
        "fabric": {"kind": "ethernet", "levels": 1, "switch_radix": 64},
        "sources": [f"dsplan profile --device cpu --model {profile.model}: GEMM sweep, copy bandwidth and "
                    f"{len(profile.collectives)} gloo collective sizes over {ranks} ranks; "
                    + ", ".join(f"{k} {v}" for k, v in sorted(profile.versions.items()))],
    }
