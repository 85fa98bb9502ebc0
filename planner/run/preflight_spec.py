"""``preflight.json``: what a run directory's ``preflight.sh`` expects of each node.

``dsplan generate`` writes it (planner/emit/preflight.py prices the collectives with dsplan's
own model), and ``python -m planner.run.preflight`` reads it on the node, so the node needs
neither the planner's search nor its hardware profiles. Read at the edge, with pydantic: a
hand-edited file that no longer reads is the user's to regenerate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.errors import UserError

PREFLIGHT_FILE = "preflight.json"
SCHEMA_VERSION = 1
# A GPU whose single bf16 GEMM loop runs below this fraction of the profile's achievable rate
# (peak x matmul_efficiency, the MAMF of reference/mamf_max_achievable_matmul_measured.csv)
# fails. One 8192^3 shape lands within ~5-10% of a shape sweep's best (Bekman's mamf-finder
# sweeps, ml-engineering compute/accelerator); a power-capped, hot or clock-locked GPU loses 20%
# and more. 85% passes the first and catches the second.
GEMM_MIN_FRACTION = 0.85
# Bus bandwidth below this fraction of dsplan's prediction fails. The model's worst residual on
# the healthy published curves (A100 and H200 nodes, reference/nccl_allreduce_busbw_measured.csv,
# 1 MiB .. 16 GiB) is 0.88 of the prediction; a lost NVLink, a NIC down to PCIe or a wrong HCA
# costs far more.
BUSBW_MIN_FRACTION = 0.85
# Bandwidth is compared from 1 MiB up: below it one call costs the ~40 us launch-and-sync floor
# (planner/cost/nccl_algorithms.py CALL_OVERHEAD_S), which the host's CPU sets, not the links.
BUSBW_MIN_BYTES = 2**20
# One small all-reduce inside a node: NCCL's own floor is ~40 us on A100 and H200 (32 KiB,
# reference/nccl_allreduce_busbw_measured.csv); above 100 us the GPUs talk through host memory
# (no P2P / NVLink), or the CPU is starved.
SMALL_ALLREDUCE_MAX_US = 100.0
SMALL_ALLREDUCE_MAX_BYTES = 64 * 2**10
# nvidia-smi's memory.total below this fraction of the profile's memory: another GPU model or a
# MIG slice. (ECC and the driver's reserve take up to ~6% on GDDR parts, e.g. L40S.)
MEMORY_MIN_FRACTION = 0.9


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP or INFO
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status} {self.name}: {self.detail}"
        return f"{text}\n     fix: {self.fix}" if self.status == "FAIL" and self.fix else text


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_MiB: float


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BusbwPoint(_Strict):
    size_bytes: int = Field(gt=0)
    busbw_GBps: float = Field(ge=0)
    algorithm: str = ""


class Group(_Strict):
    """One group nccl-tests runs over: ``node`` (the node's GPUs) or ``job`` (every GPU of the plan)."""

    name: Literal["node", "job"]
    ranks: int = Field(ge=1)
    nodes: int = Field(ge=1)
    ops: dict[str, list[BusbwPoint]]  # by nccl-tests binary: all_reduce_perf, all_gather_perf


class Gemm(_Strict):
    dtype: Literal["bf16"] = "bf16"
    peak_TFLOPs: float = Field(gt=0)
    matmul_efficiency: float = Field(gt=0, le=1)
    min_fraction: float = Field(GEMM_MIN_FRACTION, gt=0, le=1)

    @property
    def target_TFLOPs(self) -> float:
        return self.peak_TFLOPs * self.matmul_efficiency


class Expectations(_Strict):
    version: Literal[1] = SCHEMA_VERSION
    plan: str
    profile: str
    vendor: Literal["nvidia", "amd", "cpu", "other"]
    gpu_name: str
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    gpu_memory_GiB: float = Field(gt=0)
    memory_min_fraction: float = Field(MEMORY_MIN_FRACTION, gt=0, le=1)
    nics: int = Field(ge=0)  # compute NICs per node (profile node.nics.count)
    rdma: bool  # InfiniBand or RoCE: the NICs show in /sys/class/infiniband
    fabric: str
    gemm: Gemm
    busbw_min_fraction: float = Field(BUSBW_MIN_FRACTION, gt=0, le=1)
    busbw_min_bytes: int = Field(BUSBW_MIN_BYTES, ge=1)
    small_allreduce_max_us: float = Field(SMALL_ALLREDUCE_MAX_US, gt=0)
    small_allreduce_max_bytes: int = Field(SMALL_ALLREDUCE_MAX_BYTES, ge=1)
    groups: list[Group]

    def group(self, name: str) -> Group | None:
        return next((g for g in self.groups if g.name == name), None)


def read_expectations(path: str | Path) -> Expectations:
    """The file, checked; a missing or malformed one is a UserError (regenerate)."""
    fix = "regenerate the run directory with `dsplan generate`"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: cannot read it ({err}); {fix}") from None
    try:
        return Expectations.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise UserError(f"{path}: {where}: {first['msg']}; {fix}") from None
