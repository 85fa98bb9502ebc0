"""The built-in model catalog and ``--model`` resolution.

Each preset (presets/<name>.json, shipped inside the package) is a Hugging Face-style config
plus a small header: family, aliases, the authors' stated parameter counts and the training
sequence length. Presets are built by the same importer as user files, so every preset
exercises it. ``load_model`` accepts a preset name or alias (any case), a config.json path, or
a directory holding a config.json.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

from planner.errors import UserError, arg
from planner.limits import path_kind, shown_path, shown_text
from planner.model.hf_import import HFImportWarning, spec_from_hf_config
from planner.model.hf_keys import read_config_file
from planner.model.spec import ModelSpec

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


@functools.lru_cache(maxsize=1)
def _headers() -> dict[str, dict[str, Any]]:
    """Preset name -> its JSON document (header and config), read once."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(PRESETS_DIR.glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        out[doc["name"]] = doc
    return out


@functools.lru_cache(maxsize=1)
def _aliases() -> dict[str, str]:
    """Lower-case name or alias -> preset name."""
    table: dict[str, str] = {}
    for name, doc in _headers().items():
        table[name.lower()] = name
        for alias in doc.get("aliases", []):
            table[alias.lower()] = name
    return table


def list_presets() -> list[str]:
    """Preset names (not aliases), sorted."""
    return sorted(_headers())


def preset_aliases() -> dict[str, str]:
    """Alias -> preset name (names themselves left out)."""
    return {a: n for a, n in _aliases().items() if a != n.lower()}


def preset_info(name: str) -> dict[str, Any]:
    """A preset's header: family, aliases, stated counts and their wording, notes, source."""
    resolved = resolve_preset_name(name)
    if resolved is None:
        raise _unknown(name)
    doc = _headers()[resolved]
    return {k: v for k, v in doc.items() if k != "config"}


def resolve_preset_name(name: str) -> str | None:
    """The preset a name or alias (any case) refers to, or None."""
    return _aliases().get(name.strip().lower())


@functools.lru_cache(maxsize=None)
def load_preset(name: str) -> ModelSpec:
    """Build a preset by name or alias (cached: the search asks for the same model often)."""
    resolved = resolve_preset_name(name)
    if resolved is None:
        raise _unknown(name)
    if resolved != name:
        return load_preset(resolved)
    doc = _headers()[resolved]
    spec = spec_from_hf_config(doc["config"], name=resolved, source=f"preset {resolved}")
    defaulted = [d for d in spec.defaulted if d != "train_seq_len"]  # the header states it
    return spec.model_copy(update={
        "family": doc["family"],
        "train_seq_len": min(doc["train_seq_len"], spec.max_seq_len),
        "stated_total_params": doc.get("stated_total_params"),
        "stated_activated_params": doc.get("stated_activated_params"),
        "defaulted": defaulted,
    })


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name/alias, a config.json file, or a directory holding config.json."""
    text = str(name_or_path).strip()
    if not text:
        raise UserError(f"{arg('model')} is empty; give a preset name (see `dsplan models`) or a path to a config.json")
    if resolve_preset_name(text) is not None:
        return load_preset(text)
    path = Path(text).expanduser()
    kind = path_kind(path)
    if kind == "dir":
        config = path / "config.json"
        if path_kind(config) != "file":
            raise UserError(f"{path}: directory has no config.json; point {arg('model')} at a Hugging Face model "
                            "directory or its config.json")
        return _load_file(config)
    if kind == "file":
        return _load_file(path)
    if path.suffix == ".json" or "/" in text or "\\" in text:
        raise UserError(f"{shown_path(path)}: no such file; give an existing config.json or a preset name "
                        "(see `dsplan models`)")
    raise _unknown(text)


def load_model_with_warnings(name_or_path: str | Path) -> tuple[ModelSpec, list[str]]:
    """``load_model`` plus the import warnings as messages, for a CLI to print to stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HFImportWarning)
        spec = load_model(name_or_path)
    messages = []
    for w in caught:
        if issubclass(w.category, HFImportWarning):
            messages.append(str(w.message))
        else:  # not ours: hand it back to the normal machinery
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return spec, messages


def _load_file(path: Path) -> ModelSpec:
    config = read_config_file(path)
    name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    return spec_from_hf_config(config, name=name or "model", source=str(path))


def _unknown(name: str) -> UserError:
    import difflib  # only for a mistyped name: off the start-up path

    close = difflib.get_close_matches(name.strip().lower(), list(_aliases()), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return UserError(f"unknown model {shown_text(name)}: not a preset, an alias or an existing config.json path.{hint} "
                     "Run `dsplan models` for the list of presets.")
