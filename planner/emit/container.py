"""The container a run directory's jobs run in (Dockerfile, k8s-job.yaml, SLURM with pyxis/enroot).

The base image pins CUDA, PyTorch (a CUDA build), NCCL and Transformer Engine together: NVIDIA's
NGC PyTorch container, the release of ``DEFAULT_IMAGE``. On top go the runtime the plan
was made and checked for, at the version dsplan's tests run (DeepSpeed's engine and the
reference trainer, Megatron-Core's argument parser, torchtitan's config loader), and dsplan.
"""

from __future__ import annotations

from planner.emit.plan_file import PlanFile
from planner.emit.torchtitan_config import TORCHTITAN_VERSION

# The versions tests/ check run directories against: DeepSpeed's config and engine (CPU runs of
# the reference trainer), Megatron-Core's parse_args / validate_args (tests/megatron_parser.py).
DEEPSPEED_VERSION = "0.19.8"
DEFAULT_IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
MEGATRON_CORE_VERSION = "0.19.2"


def runtime_pins(plan: PlanFile, builtin: bool) -> list[str]:
    """pip requirements the plan's runtime needs on top of the base image, each pinned."""
    if plan.framework == "torchtitan":
        return [f"torchtitan=={TORCHTITAN_VERSION}"]
    if plan.framework == "megatron":
        return [f"megatron-core=={MEGATRON_CORE_VERSION}"]
    pins = [f"deepspeed=={DEEPSPEED_VERSION}"]
    if plan.framework == "megatron-deepspeed":
        pins.append(f"megatron-core=={MEGATRON_CORE_VERSION}")  # the fork's script imports megatron.core too
    return pins
