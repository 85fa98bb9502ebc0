"""dsplan: plan, configure and run distributed training with DeepSpeed and Megatron-style 3D parallelism.

Importing this package must stay cheap: no torch, no deepspeed (those live behind planner.run),
no matplotlib or pandas. The Python API (planner/api.py) is re-exported lazily, so
``from planner import load_model, load_cluster, estimate, suggest`` loads it on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = (
    "SEARCH_AXES", "constraints", "estimate", "label", "load_cluster", "load_hardware", "load_model", "make_workload",
    "parallel_config", "record", "records", "suggest", "to_dataframe", "uncertainty", "with_calibration",
    "with_fabric",
)
_SUBMODULES = ("explore", "plots")

__all__ = ["__version__", *_API, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    import importlib

    if name in _API:
        value = getattr(importlib.import_module("planner.api"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"planner.{name}")
    else:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
