"""plan.json at the edge: the part of a plan that emit needs, validated.

A plan file is what ``Plan.to_json()`` (and ``dsplan estimate --json``) produce. Emit reads only
the parallel layout, the batch split and the workload; predictions ride along untouched
(``extra="allow"``) so plan.json in the run directory keeps everything the planner said.

This is the one schema of plan.json: ``dsplan generate`` writes ``PlanFile.to_json()`` into the
run directory, and ``dsplan run`` and the reference trainer (planner.run) read it back with
``plan_from_dict``. Emit never imports planner.run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from planner.cost.eager_kernels import COMPILE_COMPONENTS, CompileComponent
from planner.cost.parallel import (
    MAX_MOE_IMBALANCE,
    MAX_MTBF_HOURS,
    MAX_MTP_LAYERS,
    CpComm,
    Framework,
    Offload,
    Optimizer,
    ParallelConfig,
    PpSchedule,
    PrecisionName,
    Recompute,
    RecomputeModule,
    Workload,
    ZeroPP,
)
from planner.cost.precision import split_precision
from planner.errors import UserError, describe_validation_error


class PlanFile(BaseModel):
    """One plan: degrees, ZeRO, batch split, workload (plus any predictions, kept as they are)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str
    hardware: str = "dgx-a100-80g"
    nodes: PositiveInt
    gpus_per_node: PositiveInt
    framework: Framework = "deepspeed"
    dp: PositiveInt
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    ep: PositiveInt = 1
    etp: PositiveInt | None = None  # the routed experts' TP, 1 or tp (ParallelConfig.etp; None: tp)
    cp: PositiveInt = 1
    cp_comm: CpComm = "p2p"
    dp_replicate: PositiveInt = 1  # hybrid-sharding groups (ParallelConfig.dp_replicate)
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload: Offload = "none"
    micro_batch: PositiveInt
    grad_accum: PositiveInt = 1
    global_batch: PositiveInt
    seq_len: PositiveInt
    recompute: Recompute = "none"
    activation_offload: int = Field(0, ge=0)  # decoder layers offloaded to host memory (ParallelConfig)
    sequence_parallel: bool = False
    virtual_stages: PositiveInt = 1
    precision: PrecisionName = "bf16"  # a working precision or a TE recipe (planner/cost/precision.py)
    tp_comm_overlap: bool = True  # TP collectives overlapped with the GEMMs where the runtime can (Workload)
    te_attention: bool = True  # Megatron-Core's attention through Transformer Engine (Workload)
    fp8_param_gather: bool = True  # weights kept and all-gathered in FP8 where the recipe allows (Workload)
    precision_aware_optimizer: bool = False  # Megatron-Core's bf16-moment Adam (Workload)
    zero_pp: tuple[ZeroPP, ...] = ()  # DeepSpeed ZeRO++ options on ZeRO-3 (Workload)
    ep_comm_overlap: bool = True  # expert all-to-alls overlapped with another micro-batch where the runtime can
    moe_imbalance: float = Field(1.0, ge=1.0, le=MAX_MOE_IMBALANCE)  # busiest EP rank's tokens / mean (Workload)
    moe_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"  # Megatron-Core's token dispatcher (Workload)
    moe_capacity_factor: float | None = Field(None, gt=0, le=MAX_MOE_IMBALANCE)  # None: dropless (Workload)
    recompute_modules: tuple[RecomputeModule, ...] = Field(("core_attn",), min_length=1)  # selective's (Workload)
    pp_schedule: PpSchedule = "1f1b"  # looped 1F1B or DualPipeV (Workload; planner/cost/dualpipe.py)
    compile: tuple[CompileComponent, ...] = COMPILE_COMPONENTS  # what torchtitan compiles (Workload)
    rms_norm_kernel: Literal["fused", "composite"] = "fused"  # eager RMSNorm's PyTorch (Workload)
    flash_version: Literal[1, 2] = 2  # the FlashAttention generation (Workload)
    mtbf_hours: float | None = Field(None, gt=0, le=MAX_MTBF_HOURS)  # the job's MTBF override (Workload)
    mtp_layers: int | None = Field(None, ge=0, le=MAX_MTP_LAYERS)  # MTP depths trained (Workload; None: the model's)
    optimizer: Optimizer = "adamw"
    flash_attention: bool = True  # FlashAttention, or the unfused kernels (Workload)
    dropout: bool = False  # dropout masks kept for backward (Workload)
    stage_blocks: list[tuple[int, int]] | None = None
    images_per_sample: int = Field(0, ge=0)
    tiles_per_image: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "PlanFile":
        world = self.nodes * self.gpus_per_node
        if self.dp * self.tp * self.pp * self.cp != world:
            raise ValueError(
                f"dp x tp x pp x cp = {self.dp} x {self.tp} x {self.pp} x {self.cp} = "
                f"{self.dp * self.tp * self.pp * self.cp} but nodes x gpus_per_node = {world}"
            )
        if self.micro_batch * self.grad_accum * self.dp != self.global_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must equal micro_batch x grad_accum x dp "
                f"= {self.micro_batch} x {self.grad_accum} x {self.dp}"
            )
        if self.stage_blocks is not None:
            chunks = self.pp * self.virtual_stages
            if len(self.stage_blocks) not in (self.pp, chunks):
                raise ValueError(f"stage_blocks has {len(self.stage_blocks)} stages; the plan has pp={self.pp}")
            previous_end = self.stage_blocks[0][0]
            if previous_end != 0:
                raise ValueError("stage_blocks must start at block 0")
            for first, last in self.stage_blocks:
                if first != previous_end or last <= first:
                    raise ValueError("stage_blocks must be contiguous, non-empty [first, last) ranges in order")
                previous_end = last
        self.parallel_config()  # the degree rules (ep | dp, offload needs ZeRO, ...)
        return self

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, zero_stage=self.zero_stage, offload=self.offload,
            micro_batch=self.micro_batch, grad_accum=self.grad_accum, recompute=self.recompute,
            sequence_parallel=self.sequence_parallel, virtual_stages=self.virtual_stages, framework=self.framework,
            cp=self.cp, cp_comm=self.cp_comm, dp_replicate=self.dp_replicate, etp=self.etp,
            activation_offload=self.activation_offload,
        )

    def workload(self) -> Workload:
        return Workload(
            global_batch=self.global_batch, seq_len=self.seq_len, images_per_sample=self.images_per_sample,
            tiles_per_image=self.tiles_per_image, precision=self.precision, optimizer=self.optimizer,
            flash_attention=self.flash_attention, dropout=self.dropout,
            tp_comm_overlap=self.tp_comm_overlap, te_attention=self.te_attention,
            fp8_param_gather=self.fp8_param_gather, precision_aware_optimizer=self.precision_aware_optimizer,
            ep_comm_overlap=self.ep_comm_overlap, moe_imbalance=self.moe_imbalance, mtbf_hours=self.mtbf_hours,
            zero_pp=self.zero_pp, mtp_layers=self.mtp_layers, moe_dispatcher=self.moe_dispatcher,
            moe_capacity_factor=self.moe_capacity_factor, recompute_modules=self.recompute_modules,
            pp_schedule=self.pp_schedule, compile=self.compile, rms_norm_kernel=self.rms_norm_kernel,
            flash_version=self.flash_version,
        )

    @property
    def work_precision(self) -> str:
        """The working precision (bf16 under a TE recipe)."""
        return split_precision(self.precision)[0]

    @property
    def recipe(self) -> str | None:
        """The Transformer Engine recipe ``precision`` names, if any."""
        return split_precision(self.precision)[1]

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_json(self) -> dict[str, Any]:
        """Everything the plan file held (predictions included), in a JSON-ready dict."""
        data = self.model_dump(mode="json")
        if data.get("stage_blocks") is not None:
            data["stage_blocks"] = [list(pair) for pair in data["stage_blocks"]]
        return data


def fit_problem(data: dict[str, Any]) -> str | None:
    """Why a plan does not fit in memory, by its own prediction (``fits: false`` and ``reason``,
    as ``Plan.to_json`` writes them), or None: it fits, or the file carries no prediction."""
    if data.get("fits") is not False:
        return None
    reason = data.get("reason")
    return reason if isinstance(reason, str) and reason.strip() else "the planner predicts it runs out of memory"


WRITE_A_PLAN = "write it with `dsplan estimate --json` or `dsplan suggest --json`"


def plan_from_dict(data: Any, source: str = "plan", fix: str = WRITE_A_PLAN) -> PlanFile:
    """Validate a plan dict; any problem is a UserError naming ``source`` and the field, then ``fix``."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a JSON object with the plan's fields (model, dp, tp, pp, ...)")
    try:
        return PlanFile.model_validate(data)
    except ValidationError as err:
        raise UserError(f"{describe_validation_error(source, err)}; {fix}") from None


def load_plan_file(path: str | Path, flag: str = "--plan") -> PlanFile:
    """Read a plan.json (one plan, or a ``suggest --json`` answer whose first plan is taken);
    messages name the file after ``flag``, the option that gave it."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{flag} {p}: no such file") from None
    except (OSError, ValueError) as err:  # ValueError: not UTF-8, or a NUL byte in the name
        raise UserError(f"{flag} {p}: cannot read it ({err.__class__.__name__}: {err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{flag} {p}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("plans"), list) and "dp" not in data:
        if not data["plans"]:
            raise UserError(f"{flag} {p}: the file lists no plans")
        data = data["plans"][0]
    return plan_from_dict(data, f"{flag} {p}")
