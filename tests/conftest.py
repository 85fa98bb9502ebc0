"""Shared test set-up.

DeepSpeed runs on CPU here: every test process (and the launchers it starts) gets
DS_ACCELERATOR=cpu unless the caller set something else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = REPO_ROOT.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """../shared/reference: published facts the tests check against (present in CI)."""
    assert SHARED_REFERENCE.is_dir(), f"reference data missing at {SHARED_REFERENCE}"
    return SHARED_REFERENCE
