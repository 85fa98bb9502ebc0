"""Plan: one evaluated configuration, with its memory and time breakdowns.

``Plan.to_json()`` is plan.json: the parallel layout and workload that ``dsplan generate`` and
the trainer read (planner/emit/plan_file.py), plus the predictions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from planner.cost.goodput import CheckpointPlan
from planner.cost.memory import MemoryBreakdown
from planner.cost.parallel import ParallelConfig, Workload
from planner.cost.step_time import MicroBatchTime, StepTime


@dataclass(frozen=True)
class StagePlan:
    """One pipeline rank: its chunks of blocks, memory at its peak, one micro-batch's time."""

    rank: int
    chunks: list[tuple[int, int]]
    decoder_layers: int
    block_kinds: dict[str, int]
    memory: MemoryBreakdown
    microbatch: MicroBatchTime
    inflight: float


@dataclass(frozen=True)
class Plan:
    model: str
    hardware: str
    nodes: int
    gpus_per_node: int
    cfg: ParallelConfig
    workload: Workload
    partition: list[tuple[int, int]]
    stages: list[StagePlan]
    time: StepTime
    capacity_bytes: float
    model_flops_per_step: float
    peak_flops: float
    host_capacity_bytes: float = float("inf")  # per node, for offloaded states
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    checkpoint: CheckpointPlan | None = None  # planner/cost/goodput.py

    @functools.cached_property
    def worst_stage(self) -> StagePlan:
        """The stage with the highest peak (asked for by every memory figure: kept once found;
        a frozen dataclass whose stages are not changed after it is built)."""
        return max(self.stages, key=lambda s: s.memory.peak)

    @property
    def memory(self) -> MemoryBreakdown:
        return self.worst_stage.memory

    @property
    def fits(self) -> bool:
        return (self.memory.peak <= self.capacity_bytes and self.cpu_bytes_per_node <= self.host_capacity_bytes
                and not self.reason)

    @property
    def offloads(self) -> bool:
        """Whether anything lives in host memory: optimizer states, parameters or activations."""
        return self.cfg.offload != "none" or self.cfg.activation_offload > 0

    @functools.cached_property
    def cpu_bytes_per_node(self) -> float:
        """Host memory per node for offloaded states (0 without offload)."""
        return max(s.memory.cpu_per_node for s in self.stages)

    @property
    def step_time_s(self) -> float:
        return self.time.total

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_s(self) -> float:
        return self.workload.global_batch * self.workload.seq_len / self.step_time_s

    @property
    def goodput(self) -> float:
        """Share of wall time that trains, counting checkpoints, failures and restarts (1 if unpriced)."""
        return 1.0 if self.checkpoint is None else self.checkpoint.goodput

    @property
    def tflops_per_gpu(self) -> float:
        """Model FLOPs (no recomputation) per second per GPU, in TFLOP/s."""
        return self.model_flops_per_step / self.step_time_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    def why_not(self) -> str:
        """The reason a plan is rejected ('' when it fits)."""
        if self.reason:
            return self.reason
        if self.memory.peak > self.capacity_bytes:
            w = self.worst_stage
            return (f"pipeline rank {w.rank} needs {w.memory.peak / 2**30:.1f} GiB of "
                    f"{self.capacity_bytes / 2**30:.1f} GiB")
        if self.cpu_bytes_per_node > self.host_capacity_bytes:
            return (f"offloaded states and activations need {self.cpu_bytes_per_node / 2**40:.2f} TiB of host memory "
                    f"per node; {self.host_capacity_bytes / 2**40:.2f} TiB is usable")
        return ""

    def to_json(self) -> dict[str, Any]:
        c, w = self.cfg, self.workload
        t = self.time
        data: dict[str, Any] = {
            "model": self.model, "hardware": self.hardware, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
            "gpus": self.gpus, "framework": c.framework, "dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep,
            "etp": c.etp, "cp": c.cp, "cp_comm": c.cp_comm, "dp_replicate": c.dp_replicate,
            "zero_stage": c.zero_stage, "offload": c.offload, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
            "global_batch": w.global_batch, "seq_len": w.seq_len, "recompute": c.recompute,
            "activation_offload": c.activation_offload,
            "sequence_parallel": c.sequence_parallel, "virtual_stages": c.virtual_stages, "precision": w.precision_name,
            "optimizer": w.optimizer, "images_per_sample": w.images_per_sample, "tiles_per_image": w.tiles_per_image,
            "flash_attention": w.flash_attention, "dropout": w.dropout, "tp_comm_overlap": w.tp_comm_overlap,
            "te_attention": w.te_attention, "fp8_param_gather": w.fp8_param_gather,
            "precision_aware_optimizer": w.precision_aware_optimizer, "ep_comm_overlap": w.ep_comm_overlap,
            "moe_imbalance": w.moe_imbalance, "mtbf_hours": w.mtbf_hours, "zero_pp": list(w.zero_pp),
            "mtp_layers": w.mtp_layers, "moe_dispatcher": w.moe_dispatcher,
            "moe_capacity_factor": w.moe_capacity_factor, "recompute_modules": list(w.recompute_modules),
            "pp_schedule": w.pp_schedule, "compile": list(w.compile), "rms_norm_kernel": w.rms_norm_kernel,
            "flash_version": w.flash_version,
            "layer_profile": w.layer_profile.summary() if w.layer_profile else None,
            "stage_blocks": [list(p) for p in self.partition],
            "fits": self.fits,
            "reason": self.why_not(),
            # the fullest GPU's breakdown; host memory is the fullest node's (what must fit)
            "memory": {**_memory_json(self.memory, self.capacity_bytes, self.offloads),
                       **({"cpu_bytes_per_node": self.cpu_bytes_per_node} if self.offloads else {})},
            "step_time_s": t.total,
            "time": {"compute_s": t.compute, "recompute_s": t.recompute, "tp_comm_s": t.tp_comm,
                     "pp_bubble_s": t.pp_bubble, "pp_comm_s": t.pp_comm, "dp_comm_s": t.dp_comm,
                     "ep_comm_s": t.ep_comm, "cp_comm_s": t.cp_comm, "optimizer_s": t.optimizer,
                     "act_offload_s": t.act_offload},
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            **({"checkpoint": self.checkpoint.to_json(t.total), "goodput": self.goodput,
                "goodput_tokens_per_s": self.tokens_per_s * self.goodput} if self.checkpoint else {}),
            "stages": [_stage_json(s, self.capacity_bytes, self.offloads) for s in self.stages],
        }
        if self.notes:
            data["notes"] = list(self.notes)
        return data


def _memory_json(m: MemoryBreakdown, capacity: float, offload: bool) -> dict[str, float]:
    out = {"peak_bytes": m.peak, "weights_bytes": m.weights, "grads_bytes": m.grads, "optimizer_bytes": m.optimizer,
           "activations_bytes": m.activations, "buffers_bytes": m.buffers, "overhead_bytes": m.overhead,
           "capacity_bytes": capacity}
    if offload:
        out["cpu_bytes_per_node"] = m.cpu_per_node
    return out


def _stage_json(s: StagePlan, capacity: float, offload: bool) -> dict[str, Any]:
    mb = s.microbatch
    return {"rank": s.rank, "blocks": [list(c) for c in s.chunks], "decoder_layers": s.decoder_layers,
            "block_kinds": dict(s.block_kinds), "inflight_microbatches": s.inflight,
            "memory": _memory_json(s.memory, capacity, offload),
            "microbatch_time": {"forward_s": mb.fwd, "backward_s": mb.bwd, "recompute_s": mb.recompute,
                                "tp_comm_s": mb.tp, "ep_comm_s": mb.ep, "pp_comm_s": mb.pp, "cp_comm_s": mb.cp,
                                "total_s": mb.total}}
