"""Files dsplan writes in one step get the mode a plain open() would give, not mkstemp's 0600."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from planner.atomic import replace_atomically, write_bytes_atomically
from planner.run.rundir import write_json_atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_replaced_files_are_0644_under_umask_022(tmp_path: Path, umask_022):
    target = tmp_path / "report.json"
    write_json_atomic(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n' and _mode(target) == 0o644
    write_bytes_atomically(tmp_path / "x.png", b"\x89PNG")
    assert _mode(tmp_path / "x.png") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "x.png"]  # no temporaries left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")

    def fail(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        replace_atomically(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_plot_png_is_group_readable(tmp_path: Path, umask_022):
    from click.testing import CliRunner

    from planner.cli import main

    out = tmp_path / "p.png"
    r = CliRunner().invoke(main, ["plot", "pareto", "--model", "gpt3-125m", "--nodes", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"\x89PNG" and _mode(out) == 0o644
