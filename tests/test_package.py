"""The package installs as a plain wheel, ships its data, and imports cheaply."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_import_planner_does_not_import_torch_or_deepspeed():
    code = (
        "import sys, planner, planner.cli, planner.model.spec, planner.hardware.profile, planner.cost.parallel;"
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_wheel_ships_templates_and_profiles_and_runs_from_elsewhere(tmp_path: Path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
         str(REPO_ROOT)],
        check=True,
    )
    (wheel,) = wheel_dir.glob("dsplan-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("planner/hardware_profiles/") and n.endswith(".yaml") for n in names)
    assert any(n.startswith("planner/templates/") and n.endswith(".j2") for n in names)
    assert any(n.startswith("planner/model/presets/") and n.endswith(".json") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import planner, planner.resources as r;"
        "assert str(r.templates_dir()).startswith(%r), r.templates_dir();"
        "assert any(r.hardware_profiles_dir().glob('*.yaml'));"
        "print(planner.__file__)"
    ) % str(target)
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target))
    cli = subprocess.run([sys.executable, "-m", "planner", "hardware", "--json"], cwd=elsewhere, env=env,
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "dgx-a100-80g" in cli.stdout
