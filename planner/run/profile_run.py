"""``dsplan profile``: measure a model's blocks and the device, as one LayerProfile.

The blocks run at full size unless ``scale`` says otherwise (a GPU with too little memory for
one block of the real model); the dtype is the training one on a GPU (bf16) and fp32 on a CPU,
where bf16 matmuls run far below fp32 without AMX or AVX-512 BF16 (this machine's EPYC: 0.9
against 57 GFLOP/s per core). With more than one rank the local collectives are measured too.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Callable

import torch

from planner.cost.measured_blocks import LayerProfile
from planner.errors import UserError
from planner.model.spec import ModelSpec
from planner.run import profile_device as pdev
from planner.run.model_scale import parse_scale, scale_spec
from planner.run.profile_blocks import Settings, profile_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_HARDWARE = "cpu-local"
# torch.cuda.get_device_name() substrings and the built-in profile each one means.
GPU_PROFILES = (("GB300", "gb300-nvl72"), ("GB200", "gb200-nvl72"), ("B300", "dgx-b300"), ("B200", "dgx-b200"),
                ("H200", "hgx-h200"), ("H800", "h800"), ("H100", "dgx-h100"), ("A100-SXM4-40GB", "dgx-a100-40g"),
                ("A100-PCIE", "a100-pcie"), ("A100", "dgx-a100-80g"), ("L40S", "l40s-pcie"),
                ("MI300X", "mi300x"), ("MI250X", "mi250x"))


@dataclass(frozen=True)
class ProfileRequest:
    model: ModelSpec
    device: str  # "cpu" | "cuda"
    micro_batch: int
    seq_len: int
    scale: str = "1"
    precision: str | None = None  # None: fp32 on CPU, bf16 on GPU
    hardware: str | None = None  # None: cpu-local, or the GPU's built-in profile
    ranks: int | None = None  # collective ranks; None: 2 on CPU, the GPU count on CUDA
    warmup: int = 2
    repetitions: int = 5


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def default_hardware(device: torch.device) -> str:
    if device.type == "cpu":
        return CPU_HARDWARE
    name = torch.cuda.get_device_name(device)
    for key, profile in GPU_PROFILES:
        if key in name:
            return profile
    raise UserError(f"--device cuda: no built-in hardware profile for {name!r}; pass --hardware NAME|PATH")


def check_device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here (a CPU build, or no GPU); "
                        "use --device cpu, or install a CUDA build of torch")
    return torch.device(kind)


def _single_rank_group(device: torch.device) -> None:
    """DeepSpeed's MoE layer asks for its expert groups at the first forward: one rank here."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pdev.free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def run_profile(req: ProfileRequest, progress: Callable[[str], None] = lambda _: None) -> LayerProfile:
    """Long: every measurement of ``dsplan profile``, in the order the progress bar shows them."""
    device = check_device(req.device)
    precision = req.precision or ("bf16" if device.type == "cuda" else "fp32")
    hardware = req.hardware or default_hardware(device)
    scaled = scale_spec(req.model, parse_scale(req.scale))
    settings = Settings(device, DTYPES[precision], req.micro_batch, req.seq_len, req.warmup, req.repetitions)
    _single_rank_group(device)
    blocks = profile_blocks(req.model, scaled, settings, progress)
    progress("GEMM sweep")
    gemm = pdev.gemm_sweep(device, settings.dtype, req.warmup, req.repetitions, req.model.hidden)
    progress("memory bandwidth")
    bandwidth = pdev.memory_bandwidth(device, req.warmup, req.repetitions)
    ranks = req.ranks if req.ranks is not None else (torch.cuda.device_count() if device.type == "cuda" else 2)
    collectives: list = []
    copies: dict[str, float] = {}
    if ranks > 1:
        progress(f"collectives over {ranks} ranks")
        collectives, copies = pdev.local_collectives(ranks, device.type, req.repetitions)
    import deepspeed

    return LayerProfile(
        model=req.model.name, hardware=hardware, device=device_label(device), dtype=precision,
        micro_batch=req.micro_batch, seq_len=req.seq_len, scale=req.scale, profiled_spec=scaled.spec,
        blocks=tuple(blocks), gemm=tuple(gemm), memory_bandwidth_GBps=bandwidth, collectives=tuple(collectives),
        rank_copy_GBps=copies.get("copy"), alloc_copy_GBps=copies.get("alloc_copy"),
        warmup=req.warmup, repetitions=req.repetitions,
        versions={"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": platform.python_version()},
    )
