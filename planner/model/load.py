"""``--model`` resolution, the one entry point other modules call.

A thin re-export of the catalog so callers need not know where presets live:
``load_model("vl2")``, ``load_model("./my-model")`` or ``load_model("config.json")``.
"""

from __future__ import annotations

from planner.model.catalog import list_presets, load_model, load_model_with_warnings, load_preset, resolve_preset_name
from planner.model.hf_import import HFImportWarning, spec_from_hf_config

__all__ = [
    "HFImportWarning",
    "list_presets",
    "load_model",
    "load_model_with_warnings",
    "load_preset",
    "resolve_preset_name",
    "spec_from_hf_config",
]
