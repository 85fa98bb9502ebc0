"""Measured block costs (``dsplan profile``) in place of the analytic ones.

A layer profile holds, for each distinct block of one model, the forward, backward and
full-recompute seconds its reference-trainer layer took on one device at one micro-batch and
sequence length, the activation bytes it kept, and the device's GEMM rate, memory bandwidth
and local collectives (planner/run/profile_blocks.py measures them).

The cost model uses a measurement as a *level*, and its own formulas for *shape*: block j of a
plan costs its analytic time at the plan's (tp, micro-batch, sequence) times

    ratio_j = measured_j / analytic_j(at the profile's device, micro-batch, sequence, tp 1)

for forward, backward and recompute apiece. Where the plan's micro-batch, sequence or tensor
parallelism differ from the profile's, the analytic model carries the measurement over (and
``LayerProfile.differences`` says so); at the profile's own point the measured seconds are
the prediction exactly. A profile measured on a scaled model (``--scale``, when the full
blocks do not fit the device) transfers the same way: its ratios come from the scaled blocks.
Activations alike: each block's stored bytes, under every recompute mode, are its analytic bytes
times measured over analytic at the profile's point (recompute none).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.cost.layer_cost import RECOMPUTE_MODES
from planner.errors import UserError, arg, describe_validation_error
from planner.model.spec import ModelSpec

FORMAT = "dsplan-layer-profile/1"
_SELECTIVE, _FULL, _OP = (RECOMPUTE_MODES.index(m) for m in ("selective", "full", "op"))  # block-table rows


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class BlockMeasurement(_Frozen):
    """One distinct block, as its layer ran on the device (seconds per micro-batch)."""

    signature: str  # block_signature of the model's block it stands for
    kind: str
    block_index: int = Field(ge=0)  # the first block of the model with this signature
    profiled_index: int = Field(ge=0)  # its layer in ``LayerProfile.profiled_spec``
    forward_s: float = Field(ge=0)
    backward_s: float = Field(ge=0)
    recompute_s: float | None = Field(None, ge=0)  # full recomputation's extra backward time; None: not checkpointed
    activation_bytes: float = Field(ge=0)  # kept for backward over the micro-batch


class GemmPoint(_Frozen):
    dtype: str
    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    seconds: float = Field(gt=0)

    @property
    def flops_per_s(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.seconds


class CollectivePoint(_Frozen):
    op: Literal["allreduce", "allgather", "reducescatter"]
    ranks: int = Field(ge=2)
    nbytes: float = Field(gt=0)  # nccl-tests convention: the whole buffer
    seconds: float = Field(gt=0)


class LayerProfile(_Frozen):
    """What ``dsplan profile`` wrote (profile.json)."""

    format: Literal["dsplan-layer-profile/1"] = FORMAT
    model: str
    hardware: str  # the hardware profile these measurements stand for
    device: str  # what ran them, e.g. "cpu: AMD EPYC (2 threads)" or "cuda: NVIDIA H200"
    dtype: str
    micro_batch: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    scale: str  # "1": the model's own blocks
    profiled_spec: ModelSpec
    blocks: tuple[BlockMeasurement, ...]
    gemm: tuple[GemmPoint, ...] = ()
    memory_bandwidth_GBps: float | None = Field(None, gt=0)
    # CPU ranks, every rank copying at once (they share the host's memory): into mapped memory,
    # and into memory allocated for the copy (first-touch page faults)
    rank_copy_GBps: float | None = Field(None, gt=0)
    alloc_copy_GBps: float | None = Field(None, gt=0)
    collectives: tuple[CollectivePoint, ...] = ()
    warmup: int = Field(ge=0)
    repetitions: int = Field(gt=0)
    versions: dict[str, str] = Field(default_factory=dict)

    def __hash__(self) -> int:  # a Workload field: hashed by what it measured
        return hash((self.model, self.hardware, self.device, self.micro_batch, self.seq_len, self.blocks))

    def matmul_flops_per_s(self, dtype: str | None = None) -> float | None:
        """The best GEMM rate of the sweep in ``dtype`` (the profile's): the achievable matmul rate."""
        return max((g.flops_per_s for g in self.gemm if g.dtype == (dtype or self.dtype)), default=None)

    def summary(self) -> dict[str, Any]:
        """What plan.json records of the profile a plan was priced with."""
        return {"model": self.model, "hardware": self.hardware, "device": self.device, "dtype": self.dtype,
                "micro_batch": self.micro_batch, "seq_len": self.seq_len, "scale": self.scale,
                "blocks": len(self.blocks)}

    def differences(self, micro_batch: int, seq_len: int, tp: int) -> list[str]:
        """How a plan's point differs from the profile's, in words (empty: priced as measured)."""
        out = []
        if micro_batch != self.micro_batch:
            out.append(f"micro-batch {micro_batch} (profiled at {self.micro_batch})")
        if seq_len != self.seq_len:
            out.append(f"sequence {seq_len} (profiled at {self.seq_len})")
        if tp != 1:
            out.append(f"tensor parallel {tp} (profiled unsharded)")
        if self.scale != "1":
            out.append(f"full-size blocks (profiled at scale {self.scale})")
        return out


def profile_notes(profile: LayerProfile | None, cfg: Any, seq_len: int, calibration: Any = None) -> list[str]:
    """A plan's notes on what it was priced with beyond the published figures: measured block
    costs (and how they were carried to ``cfg``'s micro-batch and tp), and a fitted calibration."""
    out = []
    if profile is not None:
        moved = profile.differences(cfg.micro_batch, seq_len, cfg.tp)
        carried = f"; carried by the cost model to {', '.join(moved)}" if moved else ", as measured"
        out.append(f"block compute measured by dsplan profile on {profile.device} ({profile.dtype}){carried}")
    if calibration is not None and not calibration.identity:
        c = calibration
        runs = f", fitted on {len(c.fitted_on)} run(s)" if c.fitted_on else ""
        out.append(f"calibrated: gemm x{c.gemm:.3g}, hbm x{c.hbm:.3g}, network x{c.network:.3g}, "
                   f"overlap {c.overlap:.3g}{runs}")
    return out


def block_signature(block: Any) -> str:
    """A short hash of a block's full description: equal blocks, equal signature."""
    text = json.dumps(block.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def measured_for(profile: LayerProfile, model: ModelSpec, hardware: str, source: str | None = None) -> list[int]:
    """For each block of ``model``, the index in ``profile.blocks`` of its measurement; a
    UserError naming ``source`` when the profile is of another model or hardware, or lacks a block."""
    source = source or arg("layer_profile")
    if profile.model != model.name:
        raise UserError(f"{source}: the profile measured model {profile.model}, not {model.name}; run "
                        f"`dsplan profile` for {model.name}")
    if profile.hardware != hardware:
        raise UserError(f"{source}: the profile was measured for hardware {profile.hardware} ({profile.device}), "
                        f"not {hardware}; profile on that system or plan with {arg('hardware')} {profile.hardware}")
    index = {m.signature: i for i, m in enumerate(profile.blocks)}
    out = []
    for i, block in enumerate(model.blocks):
        # A multi-token-prediction depth, which the profiler does not build, runs at its layer's ratio.
        j = index.get(block_signature(block.layer if block.kind == "mtp" else block))
        if j is None:
            raise UserError(f"{source}: block {i} ({block.kind}) of {model.name} is not in the profile (the model "
                            "changed since it was measured); profile it again")
        out.append(j)
    return out


def as_layer_profile(value: "str | Path | LayerProfile | None") -> LayerProfile | None:
    """A LayerProfile, or one read from a path (``dsplan profile``'s file)."""
    return load_layer_profile(value) if isinstance(value, (str, Path)) else value


def load_layer_profile(path: str | Path, source: str | None = None) -> LayerProfile:
    """Read profile.json; every problem is one UserError naming the file."""
    source = source or arg("layer_profile")
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{source} {p}: no such file; write one with `dsplan profile`") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{source} {p}: cannot read it as JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{source} {p}: not a dsplan layer profile (format {FORMAT!r}); "
                        "write one with `dsplan profile`")
    try:
        return LayerProfile.model_validate(data)
    except ValidationError as err:
        where = f"{source} {p}"
        raise UserError(f"{describe_validation_error(where, err)}; write it again with `dsplan profile`") from None


def measured_ratios(profile: LayerProfile, index: list[int], fwd: np.ndarray, bwd: np.ndarray,
                    rc: np.ndarray, act: np.ndarray) -> np.ndarray:
    """[forward, backward, recompute, activations] x block: measured over analytic at the
    profile's point, for each block of a model (``index``: measured_for's answer); ``fwd``,
    ``bwd`` and ``rc`` (full recomputation) are the analytic seconds of the profiled spec's
    blocks there, ``act`` their stored bytes per sample without recomputation. A block the
    analytic model prices at nothing keeps ratio 1; one measured without a recompute (not
    checkpointed) recomputes at its forward's ratio. The activation ratio carries what the
    profile saw kept for backward (its dtype's bytes, its implementation's tensors) over to
    every recompute mode of the block."""
    def ratio(measured: float, analytic: float) -> float:
        return measured / analytic if analytic > 0 else 1.0

    out = np.ones((4, len(index)))
    for i, k in enumerate(index):
        m = profile.blocks[k]
        j = m.profiled_index
        out[0, i] = ratio(m.forward_s, float(fwd[j]))
        out[1, i] = ratio(m.backward_s, float(bwd[j]))
        out[2, i] = ratio(m.recompute_s, float(rc[j])) if m.recompute_s is not None else out[0, i]
        out[3, i] = ratio(m.activation_bytes, float(act[j]) * profile.micro_batch)
    return out


def measured_act(ratios: np.ndarray, act: np.ndarray, act_live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stored bytes ([group, mode, block]) and a recomputed block's live bytes ([group, block]) at
    the profile's level (``ratios``' activation row)."""
    return act * ratios[3], act_live * ratios[3]


def as_measured(ratios: np.ndarray, fwd, bwd, rc, gemm, te, attn):
    """The compute arrays scaled to the layer profile's level: forward parts (the GEMMs, the
    attention core, what TE saves of it, the selective recompute) by the forward ratio, backward
    parts by the backward's, full recomputation by its own, per-op SAC's partial forward by the forward's."""
    f, b, r = ratios[:3]
    rc = rc.copy()
    rc[:, _FULL] *= r
    rc[:, _SELECTIVE] *= f
    rc[:, _OP] *= f  # per-op SAC reruns part of the forward
    te_rc = te["te_rc"].copy()
    te_rc[:, _FULL] *= r
    te_rc[:, _SELECTIVE] *= f
    te_rc[:, _OP] *= f
    return (fwd * f, bwd * b, rc, gemm * f, {"te_f": te["te_f"] * f, "te_b": te["te_b"] * b, "te_rc": te_rc},
            (attn[0] * f, attn[1] * b))
