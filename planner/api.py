"""The Python API: what the CLI does, as plain function calls for notebooks and scripts.

Everything here takes and returns plain data: a ``ModelSpec``, a ``Cluster``, a ``Plan``
(``planner.cost.plan``), and flat dict *records* (one per plan) that print, serialise to
JSON and become a DataFrame with ``to_dataframe`` when pandas is installed. Nothing here
imports pandas, matplotlib, torch or DeepSpeed at import time.

    >>> from planner import load_model, load_cluster, estimate, suggest, records
    >>> vl2 = load_model("vl2")
    >>> cluster = load_cluster("dgx-a100-80g", nodes=8)
    >>> plan = estimate(vl2, cluster, ep=8, zero=1)
    >>> best = suggest(vl2, cluster, top=3, framework="deepspeed")
    >>> rows = records(best.plans)          # list of flat dicts

Bad input raises ``planner.errors.UserError`` with one message naming the argument by its
keyword here (the CLI names the same input by its flag: planner/errors.py ``arg``). Defaults
are the CLI's, from one place: planner/cost/degrees.py (dp, ZeRO, accumulation, global batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from planner import limits
from planner.api_records import label, record, records, to_dataframe, uncertainty
from planner.api_workload import WORKLOAD_KEYS, check_workload, make_workload, seq_len_of
from planner.errors import UserError, arg

if TYPE_CHECKING:  # pragma: no cover - imports for type checkers only
    from planner.cost.parallel import ParallelConfig, Workload
    from planner.cost.plan import Plan
    from planner.hardware.cluster import Cluster
    from planner.hardware.profile import HardwareProfile
    from planner.model.spec import ModelSpec

DEFAULT_HARDWARE = "dgx-a100-80g"

__all__ = [
    "SEARCH_AXES",
    "constraints",
    "estimate",
    "label",
    "load_cluster",
    "load_hardware",
    "load_model",
    "make_workload",
    "parallel_config",
    "record",
    "records",
    "suggest",
    "to_dataframe",
    "uncertainty",
    "with_calibration",
    "with_fabric",
]


# -- inputs ----------------------------------------------------------------------------------


def load_model(name_or_path: "str | ModelSpec") -> "ModelSpec":
    """A model by preset name (``"vl2"``, ``"llama-3-8b"``) or HF ``config.json`` path.

    >>> load_model("vl2").name
    'deepseek-vl2'
    """
    from planner.model.load import load_model as _load
    from planner.model.spec import ModelSpec

    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    return _load(name_or_path)


def load_hardware(name_or_path: "str | HardwareProfile" = DEFAULT_HARDWARE,
                  calibration: "str | None" = None) -> "HardwareProfile":
    """A hardware profile by built-in name (``"dgx-h100"``) or YAML path; ``calibration``, a
    calibration.yaml of ``dsplan calibrate``, replaces its calibration section (with_calibration).

    >>> load_hardware("h100").gpu.name
    'H100-SXM5-80GB'
    """
    from planner.hardware.load import load_profile
    from planner.hardware.profile import HardwareProfile

    profile = name_or_path if isinstance(name_or_path, HardwareProfile) else load_profile(name_or_path)
    return profile if calibration is None else with_calibration(profile, calibration)


def load_cluster(hardware: "str | HardwareProfile" = DEFAULT_HARDWARE, nodes: int = 1, *,
                 gpus_per_node: int | None = None, calibration: "str | None" = None) -> "Cluster":
    """``nodes`` machines of one hardware profile (``calibration``: as for load_hardware).

    >>> load_cluster("dgx-a100-80g", nodes=4).num_gpus
    32
    """
    from planner.hardware.cluster import Cluster

    profile = load_hardware(hardware, calibration)
    if gpus_per_node is not None:
        profile = profile.with_gpus_per_node(gpus_per_node)
    return Cluster.build(profile, nodes)


def with_calibration(hardware: "str | HardwareProfile", calibration: str) -> "HardwareProfile":
    """``hardware`` with the calibration section of ``calibration`` (a dsplan calibrate file; one
    fitted on another system is a UserError naming both)."""
    from planner.hardware.calibration_file import with_calibration as _with

    return _with(load_hardware(hardware), calibration)


_FABRIC_KINDS = {"hdr": "infiniband_hdr", "ndr": "infiniband_ndr", "xdr": "infiniband_xdr"}
# Per-port InfiniBand rates (NVIDIA ConnectX-6 HDR 200 Gb/s, ConnectX-7 NDR 400 Gb/s, XDR 800 Gb/s).
_FABRIC_GBIT = {"infiniband_hdr": 200.0, "infiniband_ndr": 400.0, "infiniband_xdr": 800.0}


def with_fabric(hardware: "str | HardwareProfile", *, fabric: str | None = None, nic_gbit: float | None = None,
                oversubscription: float | None = None, name: str | None = None) -> "HardwareProfile":
    """A copy of a profile with another inter-node fabric: the what-if behind the fabric plots.

    ``fabric``: ``"hdr"`` / ``"ndr"`` / ``"xdr"`` (InfiniBand generations; the NIC speed
    follows unless ``nic_gbit`` is given) or a profile ``fabric.kind``; ``oversubscription``:
    leaf downlinks per uplink (1 = full fat-tree, 2 = 2:1 tapered).

    >>> with_fabric("dgx-a100-80g", fabric="ndr").node.nics.speed_gbit
    400.0
    """
    from pydantic import ValidationError

    from planner.errors import describe_validation_error

    base = load_hardware(hardware)
    fab_update: dict[str, Any] = {}
    nic_update: dict[str, Any] = {}
    if fabric is not None:
        kind = _FABRIC_KINDS.get(fabric.lower(), fabric.lower())
        allowed = ("infiniband_hdr", "infiniband_ndr", "infiniband_xdr", "roce", "ethernet")
        if kind not in allowed:
            raise UserError(f"fabric {fabric!r} is unknown; use hdr, ndr, xdr or one of {', '.join(allowed)}")
        fab_update["kind"] = kind
        if nic_gbit is None and kind in _FABRIC_GBIT:
            nic_update["speed_gbit"] = _FABRIC_GBIT[kind]
    if nic_gbit is not None:
        nic_update["speed_gbit"] = nic_gbit
    if oversubscription is not None:
        fab_update["oversubscription"] = oversubscription
    label = name or _fabric_label(base.name, fabric, nic_gbit, oversubscription)
    try:
        # model_copy skips validation; round-trip through the model so a bad value is caught here.
        data = base.model_dump()
        data["fabric"].update(fab_update)
        data["node"]["nics"].update(nic_update)
        data["name"] = label
        return type(base).model_validate(data)
    except ValidationError as err:
        raise UserError(describe_validation_error(f"with_fabric({base.name})", err)) from None


def _fabric_label(base: str, fabric: str | None, gbit: float | None, over: float | None) -> str:
    parts = [base, fabric.lower() if fabric else "", f"{gbit:g}G" if gbit else "", f"{over:g}:1" if over else ""]
    return "+".join(p for p in parts if p)


# The keywords of one plan (``parallel_config``, ``estimate``).
PLAN_KEYS = ("tp", "pp", "dp", "ep", "zero", "offload", "micro_batch", "recompute", "sequence_parallel",
             "virtual_stages", "framework", "cp", "cp_comm", "dp_replicate", "etp", "activation_offload")


def _check_counts(values: Mapping[str, Any]) -> None:
    """The counts among ``values`` (degrees, batch sizes) within planner/limits.py's bounds,
    checked before any arithmetic on them (a default batch, a divisor search)."""
    for key in (*_COUNT_AXES, "global_batch"):
        if values.get(key) is not None:
            limits.count(key, values[key])


def _workload_options(workload: "Workload | None", keywords: dict[str, Any]) -> dict[str, Any]:
    """The WORKLOAD_KEYS taken out of ``keywords`` (None: not given); refused beside ``workload``."""
    given = {k: v for k in WORKLOAD_KEYS if (v := keywords.pop(k, None)) is not None}
    if workload is not None and given:
        raise UserError(f"give workload= or the workload's fields ({', '.join(given)}), not both")
    return given


def _check_keys(what: str, keywords: Mapping[str, Any], allowed: Iterable[str]) -> None:
    unknown = sorted(set(keywords) - set(allowed))
    if unknown:
        raise UserError(f"unknown {what} argument(s) {', '.join(unknown)}; use {', '.join(allowed)}")


# -- one plan --------------------------------------------------------------------------------


def parallel_config(cluster: "Cluster", workload: "Workload", **knobs: Any) -> "ParallelConfig":
    """The ParallelConfig of ``knobs`` (``tp``, ``pp``, ``dp``, ``ep``, ``zero``, ``offload``,
    ``micro_batch``, ``recompute``, ``sequence_parallel``, ``virtual_stages``, ``framework``)
    for ``workload`` on ``cluster``, with the CLI's defaults: dp fills the cluster, ZeRO-1 when
    dp > 1, accumulation = global batch / (micro-batch x dp) (planner/cost/degrees.py).

    >>> parallel_config(load_cluster(nodes=1), make_workload("llama-3-8b", global_batch=64), tp=2).grad_accum
    16
    """
    from planner.cost.degrees import build_parallel_config

    _check_keys("plan", knobs, PLAN_KEYS)
    return build_parallel_config(cluster, global_batch=workload.global_batch, **knobs)


def estimate(model: "str | ModelSpec", cluster: "Cluster", *, workload: "Workload | None" = None,
             partition: list[tuple[int, int]] | None = None, **knobs: Any) -> "Plan":
    """Memory per GPU and step time of one configuration (``dsplan estimate``), with the notes
    ``suggest`` gives its best plan (what the batch holds back; the interleaved schedule).

    ``knobs``: the plan's ``tp``, ``pp``, ``dp``, ``ep``, ``zero``, ``offload``,
    ``micro_batch``, ``recompute``, ``sequence_parallel``, ``virtual_stages``, ``framework``,
    ``cp``, ``cp_comm``, ``dp_replicate``, ``etp`` and ``activation_offload`` (decoder layers whose
    activations go to host memory) (CLI defaults), and either ``workload`` or its
    fields (``global_batch``, ``seq_len``, ``images_per_sample``, ``tiles_per_image``,
    ``precision``, ``optimizer``, ``flash_attention``, ``dropout``). The default global batch
    is ~4M tokens that the plan's micro-batch x dp divides, with at least pp micro-batches
    (planner/cost/degrees.py).
    ``partition``: half-open block ranges per pipeline stage (default: Megatron's even split).

    >>> plan = estimate("vl2", load_cluster(nodes=8), ep=8)
    >>> plan.fits, round(plan.mfu, 2)        # doctest: +SKIP
    (True, 0.31)
    """
    import dataclasses

    from planner.cost.degrees import build_parallel_config
    from planner.cost.estimate import estimate as _estimate
    from planner.cost.measured_blocks import profile_notes
    from planner.cost.notes import batch_notes
    from planner.cost.schedule_check import plan_schedule_notes

    spec = load_model(model)
    given = _workload_options(workload, knobs)
    _check_keys("estimate", knobs, PLAN_KEYS)
    schedule = workload.pp_schedule if workload is not None else given.get("pp_schedule")
    if knobs.get("virtual_stages") is None:  # DualPipeV's two chunks a pipelined rank, else one
        knobs["virtual_stages"] = 2 if schedule == "dualpipev" and (knobs.get("pp") or 1) > 1 else 1
    _check_counts({**knobs, **given})
    if workload is None:
        cfg = build_parallel_config(cluster, global_batch=given.pop("global_batch", None),
                                    seq_len=seq_len_of(spec, given.get("seq_len")), **knobs)
        workload = make_workload(spec, global_batch=cfg.samples_per_step, **given)
    else:
        check_workload(workload)
        cfg = build_parallel_config(cluster, global_batch=workload.global_batch, **knobs)
    plan = _estimate(spec, cluster, workload, cfg, partition)
    notes = batch_notes(plan.to_json(), workload.seq_len) + plan_schedule_notes(spec, cluster, workload, cfg,
                                                                               plan.partition, plan.step_time_s)
    notes += profile_notes(workload.layer_profile, cfg, workload.seq_len, cluster.profile.calibration)
    return dataclasses.replace(plan, notes=notes)


# -- many plans ------------------------------------------------------------------------------

SEARCH_AXES = ("dp", "tp", "pp", "ep", "zero", "offload", "micro_batch", "recompute", "virtual_stages", "framework",
               "sequence_parallel", "allow_tp_across_nodes", "cp", "cp_comm", "dp_replicate", "etp",
               "activation_offload")
_COUNT_AXES = ("dp", "tp", "pp", "ep", "cp", "micro_batch", "virtual_stages", "dp_replicate")


def constraints(**axes: Any) -> Any:
    """``planner.search.space.Constraints`` from keyword axes, each one value or a sequence
    (``tp=8``, ``pp=[2, 4]``, ``zero=(1, 2)``); unknown names and values are a UserError.

    >>> constraints(tp=8, pp=[2, 4]).pp
    (2, 4)
    """
    from planner.cost.parallel import CP_COMMS, FRAMEWORKS, OFFLOADS, RECOMPUTES
    from planner.search.space import Constraints

    _check_keys("search constraint", axes, SEARCH_AXES)
    choices = dict(offload=OFFLOADS, recompute=RECOMPUTES, framework=FRAMEWORKS, cp_comm=CP_COMMS, etp=(1, "tp"))
    out: dict[str, Any] = {}
    for key, value in axes.items():
        if value is None:
            continue
        if key in ("allow_tp_across_nodes", "activation_offload"):
            out[key] = bool(value)
            continue
        values = (value,) if isinstance(value, (str, int, bool)) else tuple(value)
        if not values:
            raise UserError(f"{key}: empty list; give one value or several, or leave it out")
        for v in values:
            if key in _COUNT_AXES:
                limits.count(key, v)
            elif key == "zero" and (isinstance(v, bool) or v not in (0, 1, 2, 3)):
                raise UserError(f"{arg('zero')}: stages are 0, 1, 2 or 3, got {','.join(map(str, values))}")
            elif key in choices and v not in choices[key]:
                raise UserError(f"{arg(key)}: unknown value {v!r}; choose from {', '.join(map(str, choices[key]))}")
        out[key] = tuple(None if v == "tp" else v for v in values) if key == "etp" else values
    return Constraints(**out)


def suggest(model: "str | ModelSpec", cluster: "Cluster", *, workload: "Workload | None" = None, top: int = 5,
            objective: str = "throughput", balancer: str = "optimal",
            progress: "Callable[[float], None] | None" = None, **axes: Any) -> Any:
    """Search the parallel space and return the best ``top`` plans (``dsplan suggest``).

    ``axes`` pin or restrict the search like the CLI flags, each one value or a sequence:
    ``dp``, ``tp``, ``pp``, ``ep``, ``zero``, ``offload``, ``micro_batch``, ``recompute``,
    ``virtual_stages``, ``framework``, ``sequence_parallel``, ``allow_tp_across_nodes``,
    ``cp``, ``cp_comm``, ``dp_replicate``, ``etp`` (hybrid-sharding groups, default 1; the experts'
    TP, 1 and/or "tp", default both: each value its own search), ``activation_offload`` (False: never
    offload activations; default True: a plan may offload as few decoder layers as make it fit, where
    the runtime can); the workload is ``workload`` or its
    fields (``global_batch``, ..., ``zero_pp``, which takes "auto"; as ``estimate``; batch: ``make_workload``'s).
    ``progress`` is called with the fraction of the search done. Returns the search's
    ``SuggestResult``: ``.plans`` (best first; each has ``.plan``, the estimate's Plan,
    ``.why`` (why #1 won, or why this one ranks below it) and ``.to_json()``), ``.evaluated``,
    ``.rejected`` (counts by reason), ``.why`` and ``.notes`` (when the batch, not the layout,
    limits the best plan); ``uncertainty(result)`` says which plans are within the model's
    measured error of #1. Raises ``UserError`` (``NoPlanFits``) when nothing fits.

    >>> result = suggest("vl2", load_cluster(nodes=8), top=3, framework="deepspeed")
    >>> [p.plan.cfg.zero_stage for p in result.plans]     # doctest: +SKIP
    [3, 3, 3]
    """
    from planner.search.suggest import suggest as _suggest

    limits.count("top", top)
    spec = load_model(model)
    given = _workload_options(workload, axes)
    cons = constraints(**axes)
    precisions = given.get("precision")
    if isinstance(precisions, (tuple, list)):  # several precisions: each searched, the plans ranked together
        given["precision"] = precisions[0] if precisions else "bf16"
    schedules = given.get("pp_schedule")
    if isinstance(schedules, (tuple, list)):  # several pipeline schedules: the same
        from planner.cost.dualpipe import SCHEDULES

        if bad := [s for s in schedules if s not in SCHEDULES] or (not schedules and [""]):
            raise UserError(f"{arg('pp_schedule')}: unknown schedule {bad[0]!r}; choose from {', '.join(SCHEDULES)}")
        given["pp_schedule"] = schedules[0]
    zero_pp = given.pop("zero_pp", workload.zero_pp if workload else ())  # "auto": search.suggest tries each
    wl = workload if workload is not None else make_workload(spec, gpus=cluster.num_gpus, **given)
    check_workload(wl)
    many = tuple(precisions) if isinstance(precisions, (tuple, list)) and len(precisions) > 1 else None
    knobs = {k: getattr(wl, k) for k in WORKLOAD_KEYS if k not in ("precision", "zero_pp")}
    if isinstance(schedules, (tuple, list)) and len(set(schedules)) > 1:
        knobs["pp_schedule"] = tuple(dict.fromkeys(schedules))
    return _suggest(spec, cluster.profile, cluster.nodes, precision=many or wl.precision_name, **knobs,
                    constraints=cons, balancer=balancer, objective=objective, top=top, zero_pp=zero_pp,
                    progress=progress)
