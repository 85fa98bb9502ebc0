"""Plans as flat records: one dict of numbers and strings per plan, for tables, JSON and
DataFrames, and a ``suggest`` result's uncertainty record (``planner.api`` re-exports these).
Nothing here imports pandas until asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from planner.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - imports for type checkers only
    from planner.cost.plan import Plan

__all__ = ["label", "record", "records", "to_dataframe", "uncertainty"]


_CONFIG_KEYS = ("model", "hardware", "nodes", "gpus_per_node", "gpus", "framework", "dp", "tp", "pp", "ep",
                "zero_stage", "offload", "micro_batch", "grad_accum", "recompute", "sequence_parallel",
                "virtual_stages", "global_batch", "seq_len", "images_per_sample", "tiles_per_image", "precision",
                "optimizer")


def record(plan: "Plan | Mapping[str, Any]") -> dict[str, Any]:
    """One plan as a flat dict of numbers and strings (no nesting; SI units).

    Keys: the configuration (``dp``, ``tp``, ``pp``, ``ep``, ``zero_stage``, ...), ``fits``,
    ``reason``, ``peak_bytes`` and the memory parts (``weights_bytes``, ...,
    ``capacity_bytes``), ``step_time_s`` and its parts (``compute_s``, ``pp_bubble_s``, ...),
    ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``stages``; plus ``peak_gib`` and
    ``label`` (a short description such as ``"tp2 pp4 dp8 ep8 z1 mb1"``) for plotting.

    >>> from planner.api import estimate, load_cluster
    >>> record(estimate("llama-3-8b", load_cluster(nodes=1)))["tp"]
    1
    """
    data = plan.to_json() if hasattr(plan, "to_json") else dict(plan)
    out: dict[str, Any] = {k: data[k] for k in _CONFIG_KEYS if k in data}
    out["fits"] = bool(data.get("fits", True))
    out["reason"] = data.get("reason", "")
    memory = data.get("memory", {})
    out.update({k: float(v) for k, v in memory.items()})
    out["peak_gib"] = float(memory.get("peak_bytes", 0.0)) / 2**30
    out["step_time_s"] = float(data["step_time_s"])
    out.update({k: float(v) for k, v in data.get("time", {}).items()})
    for key in ("tokens_per_s", "tflops_per_gpu", "mfu"):
        out[key] = float(data[key])
    out["stages"] = len(data.get("stages", [])) or int(data.get("pp", 1))
    for key, value in data.items():  # search extras (id, balancer bottlenecks): keep scalars only
        if key not in out and isinstance(value, (int, float, str, bool)):
            out[key] = value
        elif key not in out and isinstance(value, Mapping) and key.startswith("balancer"):
            out.update({f"{key}_{k}": v for k, v in value.items() if isinstance(v, (int, float))})
    out["label"] = label(out)
    return out


def records(plans: Iterable["Plan | Mapping[str, Any]"]) -> list[dict[str, Any]]:
    """``record`` for each plan, in order.

    >>> rows = records(suggest("vl2", load_cluster(nodes=2), top=2).plans)   # doctest: +SKIP
    """
    return [record(p) for p in plans]


def label(row: Mapping[str, Any]) -> str:
    """A short name of a plan's layout for legends and tables."""
    parts = [f"tp{row.get('tp', 1)}", f"pp{row.get('pp', 1)}", f"dp{row.get('dp', 1)}"]
    if row.get("ep", 1) > 1:
        parts.append(f"ep{row['ep']}")
    if row.get("cp", 1) > 1:
        parts.append(f"cp{row['cp']}" + ("" if row.get("cp_comm", "p2p") == "p2p" else f"-{row['cp_comm']}"))
    parts.append(f"z{row.get('zero_stage', 0)}")
    parts.append(f"mb{row.get('micro_batch', 1)}")
    if row.get("recompute", "none") != "none":
        parts.append(f"rc-{row['recompute']}")
    if row.get("offload", "none") != "none":
        parts.append(f"off-{row['offload']}")
    if row.get("virtual_stages", 1) > 1:
        parts.append(f"v{row['virtual_stages']}")
    if row.get("sequence_parallel"):
        parts.append("sp")
    return " ".join(parts)


def to_dataframe(rows: "Iterable[Any]") -> Any:
    """Records, plans or a ``suggest`` result as a pandas DataFrame; needs pandas installed.

    >>> to_dataframe(suggest("vl2", load_cluster(nodes=2)))[["label", "tokens_per_s"]]   # doctest: +SKIP
    """
    try:
        import pandas as pd
    except ImportError:
        raise UserError("to_dataframe needs pandas: pip install pandas "
                        "(records() gives plain dicts without it)") from None
    if hasattr(rows, "plans"):  # a suggest result
        rows = rows.plans
    rows = [r if isinstance(r, Mapping) and "label" in r else record(r) for r in rows]
    return pd.DataFrame(rows)


def uncertainty(result: Any) -> dict[str, Any]:
    """How far the cost model's measured error reaches in a ``suggest`` result: the figure
    (``model_error``, a fraction of the step time), where it comes from, and ``ties_with_best``,
    the ids of the plans whose predicted step time is within it of #1's, #1 included: a ranking
    among them is not a finding. ``ties_with_best`` is None under the memory objective, which
    ranks by predicted memory, not time (planner/accuracy.py).

    >>> uncertainty(suggest("vl2", load_cluster(nodes=8)))["ties_with_best"]   # doctest: +SKIP
    [1, 2, 3, 4, 5]
    """
    from planner.accuracy import MODEL_ERROR, MODEL_ERROR_SOURCE, ties_with_best

    ties = None
    if result.objective != "memory":
        ties = [result.plans[i].id for i in ties_with_best([rp.plan.step_time_s for rp in result.plans])]
    return {"model_error": MODEL_ERROR, "source": MODEL_ERROR_SOURCE, "compared": "step_time_s",
            "ties_with_best": ties}
