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

Bad input raises ``planner.errors.UserError`` with one message naming the argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.api_records import label, record, records, to_dataframe
from planner.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - imports for type checkers only
    from planner.cost.parallel import ParallelConfig, Workload
    from planner.cost.plan import Plan
    from planner.hardware.cluster import Cluster
    from planner.hardware.profile import HardwareProfile
    from planner.model.spec import ModelSpec

DEFAULT_HARDWARE = "dgx-a100-80g"
TARGET_TOKENS_PER_STEP = 4e6  # default global batch: ~4M tokens (Llama 2/3 pre-training)

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


def load_hardware(name_or_path: "str | HardwareProfile" = DEFAULT_HARDWARE) -> "HardwareProfile":
    """A hardware profile by built-in name (``"dgx-h100"``) or YAML path.

    >>> load_hardware("h100").gpu.name
    'H100-SXM5-80GB'
    """
    from planner.hardware.load import load_profile
    from planner.hardware.profile import HardwareProfile

    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    return load_profile(name_or_path)


def load_cluster(hardware: "str | HardwareProfile" = DEFAULT_HARDWARE, nodes: int = 1, *,
                 gpus_per_node: int | None = None) -> "Cluster":
    """``nodes`` machines of one hardware profile, as the topology the cost model routes over.

    >>> load_cluster("dgx-a100-80g", nodes=4).num_gpus
    32
    """
    from planner.hardware.cluster import Cluster

    profile = load_hardware(hardware)
    if gpus_per_node is not None:
        profile = profile.with_gpus_per_node(gpus_per_node)
    return Cluster.build(profile, nodes)


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
    parts = [base]
    if fabric:
        parts.append(fabric.lower())
    if gbit:
        parts.append(f"{gbit:g}G")
    if over:
        parts.append(f"{over:g}:1")
    return "+".join(parts)


def make_workload(model: "str | ModelSpec", *, gpus: int | None = None, global_batch: int | None = None,
                  seq_len: int | None = None, images_per_sample: int | None = None,
                  tiles_per_image: int | None = None, precision: str = "bf16", optimizer: str = "adamw",
                  flash_attention: bool = True, dropout: bool = False) -> "Workload":
    """The per-step workload with the CLI's defaults: the model's training sequence length,
    ~4M tokens per step rounded so that many data-parallel sizes of ``gpus`` divide it, and
    the model's default images and tiles per sample for vision-language models.

    >>> make_workload("vl2", gpus=64).global_batch
    1024
    """
    from pydantic import ValidationError

    from planner.cost.parallel import Workload
    from planner.search.space import default_global_batch

    spec = load_model(model)
    seq = seq_len if seq_len is not None else spec.train_seq_len
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise UserError(f"seq_len must be a whole number >= 1, got {seq!r}")
    if global_batch is None:
        global_batch = default_global_batch(seq, gpus or 1, TARGET_TOKENS_PER_STEP)
    from planner.model.vision_inputs import vision_inputs

    images, tiles = vision_inputs(spec, images_per_sample, tiles_per_image, seq)
    try:
        return Workload(global_batch=global_batch, seq_len=seq, images_per_sample=images, tiles_per_image=tiles,
                        precision=precision, optimizer=optimizer, flash_attention=flash_attention, dropout=dropout)
    except ValidationError as err:
        raise UserError(_rule_message("workload", err)) from None


def _rule_message(what: str, err: Exception) -> str:
    parts = []
    for item in err.errors():  # type: ignore[attr-defined]
        msg = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
        loc = ".".join(str(x) for x in item.get("loc", ()))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid {what}: " + "; ".join(parts)


# -- one plan --------------------------------------------------------------------------------


def parallel_config(cluster: "Cluster", workload: "Workload", *, tp: int = 1, pp: int = 1, dp: int | None = None,
                    ep: int = 1, zero: int | None = None, offload: str = "none", micro_batch: int = 1,
                    recompute: str = "none", sequence_parallel: bool = False, virtual_stages: int = 1,
                    framework: str = "deepspeed") -> "ParallelConfig":
    """A ParallelConfig with the CLI's defaults: dp fills the cluster, ZeRO-1 when dp > 1,
    accumulation = global batch / (micro-batch x dp)."""
    from pydantic import ValidationError

    from planner.cost.frameworks import grad_accum_for
    from planner.cost.parallel import ParallelConfig

    for label, value in (("tp", tp), ("pp", pp), ("ep", ep), ("micro_batch", micro_batch), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{label} must be a whole number >= 1, got {value!r}")
    world = cluster.num_gpus
    if dp is None:
        if world % (tp * pp):
            raise UserError(f"tp {tp} x pp {pp} = {tp * pp} does not divide the {world} GPUs "
                            f"({cluster.nodes} nodes x {cluster.gpus_per_node}); pick degrees whose product divides {world}")
        dp = world // (tp * pp)
    if dp < 1 or dp * tp * pp != world:
        raise UserError(f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} but the cluster has {world} GPUs; "
                        f"make the degrees multiply to {world}")
    zero_stage = (1 if dp > 1 else 0) if zero is None else zero
    grad_accum = grad_accum_for(workload.global_batch, micro_batch, dp)
    try:
        return ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero_stage, offload=offload,
                              micro_batch=micro_batch, grad_accum=grad_accum, recompute=recompute,
                              sequence_parallel=sequence_parallel, virtual_stages=virtual_stages, framework=framework)
    except ValidationError as err:
        raise UserError(_rule_message("plan", err)) from None


def estimate(model: "str | ModelSpec", cluster: "Cluster", *, workload: "Workload | None" = None,
             partition: list[tuple[int, int]] | None = None, **knobs: Any) -> "Plan":
    """Memory per GPU and step time of one configuration (``dsplan estimate``).

    ``knobs``: ``tp``, ``pp``, ``dp``, ``ep``, ``zero``, ``offload``, ``micro_batch``,
    ``recompute``, ``sequence_parallel``, ``virtual_stages``, ``framework`` (CLI defaults);
    ``workload`` defaults to ``make_workload(model, gpus=cluster.num_gpus)``. ``partition``:
    half-open block ranges per pipeline stage (default: Megatron's even split).

    >>> plan = estimate("vl2", load_cluster(nodes=8), ep=8)
    >>> plan.fits, round(plan.mfu, 2)        # doctest: +SKIP
    (True, 0.31)
    """
    from planner.cost.estimate import estimate as _estimate

    spec = load_model(model)
    wl = workload if workload is not None else make_workload(spec, gpus=cluster.num_gpus)
    cfg = parallel_config(cluster, wl, **knobs)
    return _estimate(spec, cluster, wl, cfg, partition)


# -- many plans ------------------------------------------------------------------------------


SEARCH_AXES = ("dp", "tp", "pp", "ep", "zero", "offload", "micro_batch", "recompute", "virtual_stages", "framework",
               "sequence_parallel", "allow_tp_across_nodes")


def constraints(**axes: Any) -> Any:
    """``planner.search.space.Constraints`` from keyword axes, each one value or a sequence
    (``tp=8``, ``pp=[2, 4]``, ``zero=(1, 2)``); unknown names are a UserError.

    >>> constraints(tp=8, pp=[2, 4]).pp
    (2, 4)
    """
    from planner.search.space import Constraints

    unknown = sorted(set(axes) - set(SEARCH_AXES))
    if unknown:
        raise UserError(f"unknown search constraint(s) {', '.join(unknown)}; use {', '.join(SEARCH_AXES)}")
    out: dict[str, Any] = {}
    for key, value in axes.items():
        if value is None:
            continue
        if key == "allow_tp_across_nodes":
            out[key] = bool(value)
        elif isinstance(value, (str, int, bool)):
            out[key] = (value,)
        else:
            out[key] = tuple(value)
            if not out[key]:
                raise UserError(f"{key}: empty list; give one value or several, or leave it out")
    return Constraints(**out)


def suggest(model: "str | ModelSpec", cluster: "Cluster", *, workload: "Workload | None" = None, top: int = 5,
            objective: str = "throughput", balancer: str = "optimal", **axes: Any) -> Any:
    """Search the parallel space and return the best ``top`` plans (``dsplan suggest``).

    ``axes`` pin or restrict the search like the CLI flags, each one value or a sequence:
    ``dp``, ``tp``, ``pp``, ``ep``, ``zero``, ``offload``, ``micro_batch``, ``recompute``,
    ``virtual_stages``, ``framework``, ``sequence_parallel``, ``allow_tp_across_nodes``.
    Returns the search's ``SuggestResult``: ``.plans`` (best first; each has ``.plan``, the
    estimate's Plan, ``.why`` (why #1 won, or why this one ranks below it) and
    ``.to_json()``), ``.evaluated``, ``.rejected`` (counts by reason), ``.why`` and ``.notes``
    (when the batch, not the layout, limits the best plan). Raises ``UserError``
    (``NoPlanFits``) when nothing fits.

    >>> result = suggest("vl2", load_cluster(nodes=8), top=3, framework="deepspeed")
    >>> [p.plan.cfg.zero_stage for p in result.plans]     # doctest: +SKIP
    [3, 3, 3]
    """
    from planner.search.suggest import suggest as _suggest

    spec = load_model(model)
    wl = workload if workload is not None else make_workload(spec, gpus=cluster.num_gpus)
    if not wl.flash_attention or wl.dropout:
        raise UserError("suggest searches with FlashAttention and no dropout; use estimate for other kernels")
    return _suggest(spec, cluster.profile, cluster.nodes, global_batch=wl.global_batch, seq_len=wl.seq_len,
                    images_per_sample=wl.images_per_sample, tiles_per_image=wl.tiles_per_image,
                    precision=wl.precision, optimizer=wl.optimizer, constraints=constraints(**axes),
                    balancer=balancer, objective=objective, top=top)
