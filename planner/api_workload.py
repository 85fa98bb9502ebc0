"""The API's workload: ``make_workload`` with the CLI's defaults and bounds, and the Workload
fields ``estimate`` and ``suggest`` take as keywords (planner/api.py re-exports them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner import limits
from planner.errors import UserError, arg

if TYPE_CHECKING:  # pragma: no cover - imports for type checkers only
    from planner.cost.measured_blocks import LayerProfile
    from planner.cost.parallel import Workload
    from planner.model.spec import ModelSpec

# The Workload fields ``estimate`` and ``suggest`` take as keywords instead of ``workload=``.
WORKLOAD_KEYS = ("global_batch", "seq_len", "images_per_sample", "tiles_per_image", "precision", "optimizer",
                 "flash_attention", "dropout", "tp_comm_overlap", "te_attention", "fp8_param_gather",
                 "precision_aware_optimizer", "ep_comm_overlap", "moe_imbalance", "mtbf_hours", "layer_profile",
                 "zero_pp", "mtp_layers", "moe_dispatcher", "moe_capacity_factor", "recompute_modules",
                 "pp_schedule", "compile", "rms_norm_kernel", "flash_version")


def make_workload(model: "str | ModelSpec", *, gpus: int | None = None, global_batch: int | None = None,
                  seq_len: int | None = None, images_per_sample: int | None = None,
                  tiles_per_image: int | None = None, precision: str = "bf16", optimizer: str = "adamw",
                  flash_attention: bool = True, dropout: bool = False, tp_comm_overlap: bool = True,
                  te_attention: bool = True, fp8_param_gather: bool = True,
                  precision_aware_optimizer: bool = False, ep_comm_overlap: bool = True,
                  moe_imbalance: float = 1.0, mtbf_hours: float | None = None,
                  layer_profile: "str | LayerProfile | None" = None, zero_pp: "str | tuple" = (),
                  mtp_layers: int | None = None, moe_dispatcher: str = "alltoall",
                  moe_capacity_factor: float | None = None,
                  recompute_modules: "str | tuple[str, ...] | None" = None,
                  pp_schedule: str = "1f1b", compile: "str | tuple[str, ...] | None" = None,
                  rms_norm_kernel: str = "fused", flash_version: int = 2) -> "Workload":
    """The per-step workload with the CLI's defaults: the model's training sequence length,
    ~4M tokens per step rounded so that many data-parallel sizes of ``gpus`` divide it (the
    search's default batch, planner/cost/degrees.py), the model's default images and tiles per
    sample for vision-language models, and its own multi-token-prediction depths unless
    ``mtp_layers`` says how many (0: the main model only). ``recompute_modules``: what
    Megatron's selective recompute runs again (a comma list; default "auto":
    recompute_modules.auto_modules). ``pp_schedule``: 1f1b (looped, interleaved by virtual stages)
    or dualpipev (planner/cost/dualpipe.py). ``compile``: what torchtitan compiles (a comma list
    of model and loss, or "none"; default both), the rest priced as eager kernels
    (planner/cost/eager_kernels.py; ``rms_norm_kernel`` "composite" for PyTorch before 2.8).
    ``flash_version`` 1: FlashAttention-1 (or its Triton port) at half FlashAttention-2's rate.

    >>> make_workload("vl2", gpus=64).global_batch
    1024
    """
    from pydantic import ValidationError

    from planner.cost.degrees import default_global_batch, rule_message
    from planner.cost.parallel import Workload, parse_zero_pp
    from planner.model.load import load_model
    from planner.model.spec import ModelSpec
    from planner.model.vision_inputs import vision_inputs

    spec = model if isinstance(model, ModelSpec) else load_model(model)
    seq = seq_len_of(spec, seq_len)
    if global_batch is None:
        global_batch = default_global_batch(seq, gpus or 1)
    limits.tokens_per_step(limits.count("global_batch", global_batch), seq)
    images, tiles = vision_inputs(spec, images_per_sample, tiles_per_image, seq)
    from planner.cost.measured_blocks import as_layer_profile
    _check_knobs(moe_imbalance, mtbf_hours, mtp_layers, moe_dispatcher, moe_capacity_factor)
    check_flash(flash_attention, flash_version)
    from planner.cost.eager_kernels import parse_compile
    modules = _recompute_modules(spec, recompute_modules, flash_attention, precision)
    try:
        return Workload(global_batch=global_batch, seq_len=seq, images_per_sample=images, tiles_per_image=tiles,
                        precision=precision, optimizer=optimizer, flash_attention=flash_attention, dropout=dropout,
                        tp_comm_overlap=tp_comm_overlap, te_attention=te_attention,
                        fp8_param_gather=fp8_param_gather, precision_aware_optimizer=precision_aware_optimizer,
                        ep_comm_overlap=ep_comm_overlap, moe_imbalance=moe_imbalance, mtbf_hours=mtbf_hours,
                        layer_profile=as_layer_profile(layer_profile), zero_pp=parse_zero_pp(zero_pp),
                        mtp_layers=mtp_layers, moe_dispatcher=moe_dispatcher,
                        moe_capacity_factor=moe_capacity_factor, recompute_modules=modules,
                        pp_schedule=pp_schedule, compile=parse_compile(compile),
                        rms_norm_kernel=rms_norm_kernel, flash_version=flash_version).resolved(spec)
    except ValidationError as err:
        raise UserError(rule_message("workload", err)) from None


def _recompute_modules(spec: "ModelSpec", given: "str | tuple[str, ...] | None", flash_attention: bool,
                       precision: str) -> tuple[str, ...]:
    """The modules Megatron's selective recompute runs again: those given, checked, or auto's."""
    from planner.cost.recompute_modules import auto_modules, check_recompute_modules, parse_recompute_modules

    modules = parse_recompute_modules(given)
    if modules is None:
        return auto_modules(spec, flash_attention, precision)
    check_recompute_modules(modules, spec, precision)
    return modules


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_knobs(moe_imbalance: float, mtbf_hours: float | None, mtp_layers: int | None, moe_dispatcher: str,
                 moe_capacity_factor: float | None) -> None:
    """One clear message for a workload knob out of its range (make_workload's)."""
    from planner.cost.moe_dispatch import DISPATCHERS
    from planner.cost.parallel import MAX_MOE_IMBALANCE, MAX_MTBF_HOURS, MAX_MTP_LAYERS

    if not _number(moe_imbalance) or not 1 <= moe_imbalance <= MAX_MOE_IMBALANCE:
        raise UserError(f"{arg('moe_imbalance')}: need a number from 1 to {MAX_MOE_IMBALANCE:g} (the busiest "
                        f"expert-parallel rank's tokens over the mean; 1 = balanced), "
                        f"got {limits.shown(moe_imbalance)}")
    if mtbf_hours is not None and (not _number(mtbf_hours) or not 0 < mtbf_hours <= MAX_MTBF_HOURS):
        raise UserError(f"{arg('mtbf_hours')}: need hours above 0 and at most {MAX_MTBF_HOURS:g} (the job's mean "
                        f"time between failures), got {limits.shown(mtbf_hours)}")
    if mtp_layers is not None and (isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int)
                                   or not 0 <= mtp_layers <= MAX_MTP_LAYERS):
        raise UserError(f"{arg('mtp_layers')}: need a whole number of multi-token-prediction depths from 0 (the main "
                        f"model only) to {MAX_MTP_LAYERS}, got {limits.shown(mtp_layers)}")
    if moe_dispatcher not in DISPATCHERS:
        raise UserError(f"{arg('moe_dispatcher')}: {limits.shown(moe_dispatcher)} is not a token dispatcher dsplan "
                        f"prices; use {' or '.join(DISPATCHERS)}")
    if moe_capacity_factor is not None and (not _number(moe_capacity_factor)
                                            or not 0 < moe_capacity_factor <= MAX_MOE_IMBALANCE):
        raise UserError(f"{arg('moe_capacity_factor')}: need a number above 0 and at most {MAX_MOE_IMBALANCE:g} "
                        f"(each expert's token capacity over the mean; leave it out for dropless routing), "
                        f"got {limits.shown(moe_capacity_factor)}")
    if moe_capacity_factor is not None and moe_dispatcher == "flex":  # transformer_config.py refuses the padding
        raise UserError(f"{arg('moe_capacity_factor')} with {arg('moe_dispatcher')} flex: DeepEP does not pad to "
                        f"capacity; use {arg('moe_dispatcher')} alltoall or allgather, or drop "
                        f"{arg('moe_capacity_factor')}")


def check_flash(flash_attention: bool, flash_version: object) -> None:
    """The FlashAttention generation: 1 or 2, and only where FlashAttention runs."""
    if isinstance(flash_version, bool) or flash_version not in (1, 2):
        raise UserError(f"{arg('flash_version')}: need 1 (FlashAttention-1, or its Triton port) or 2 "
                        f"(FlashAttention-2), got {limits.shown(flash_version)}")
    if flash_version == 1 and not flash_attention:
        raise UserError(f"{arg('flash_version')} 1 prices FlashAttention-1, but {arg('flash_attention')} is off "
                        f"(the unfused kernels); drop one of them")


def seq_len_of(spec: "ModelSpec", seq_len: int | None) -> int:
    return limits.count("seq_len", spec.train_seq_len if seq_len is None else seq_len)


def check_workload(workload: "Workload") -> None:
    """A Workload given whole (``workload=``) within the same bounds as its fields given one by one."""
    seq = limits.count("seq_len", workload.seq_len)
    limits.tokens_per_step(limits.count("global_batch", workload.global_batch), seq)
    check_flash(workload.flash_attention, workload.flash_version)
