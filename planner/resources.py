"""Locate the data that ships with dsplan (templates, hardware profiles).

In a wheel they are the data packages ``planner.templates`` and ``planner.hardware_profiles``;
in a source checkout they sit at the top of the repository. Callers never care which.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _data_dir(package: str, repo_dir: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if Path(location).is_dir():
                return Path(location)
    return _REPO_ROOT / repo_dir


def templates_dir() -> Path:
    """Directory holding the Jinja2 templates (``*.j2``)."""
    return _data_dir("planner.templates", "templates")


def hardware_profiles_dir() -> Path:
    """Directory holding the built-in hardware profile YAML files."""
    return _data_dir("planner.hardware_profiles", "hardware_profiles")
