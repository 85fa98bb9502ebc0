"""``generate --out``: paths that cannot be written into scripts are refused up front (exit 2,
one line, nothing written); legal paths with shell or rich-markup characters simply work, and the
printed next step is shell-quoted; a write killed midway leaves temporaries that the next
successful write removes."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from tests.test_cli_generate import RUN_FILES, write_plan

REPO_ROOT = Path(__file__).resolve().parents[1]


def generate(plan: Path, out: str, *extra: str):
    return CliRunner().invoke(main, ["generate", "--plan", str(plan), "--out", out, *extra])


@pytest.mark.parametrize(("name", "what"), [
    ("run\nx", "a newline"), ("run\rx", "a carriage return"), ("run\u2028x", "a line separator (U+2028)"),
    ("run\x1b[31mx", "an escape character (ESC)"), ("run\tx", "a tab"), ("run\x7fx", "a control character (U+007F)"),
    ("run\udcffx", "a byte that is not UTF-8 (\\xff)"), ("sub\n/run", "a newline"),
])
def test_an_out_path_with_a_control_character_is_refused_before_anything_is_written(tmp_path: Path, name, what):
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    before = sorted(os.listdir(tmp_path))
    out = str(tmp_path / name)
    result = generate(plan, out)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --out {out!r}: the path holds {what}; choose a path of printable characters\n"
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", ["rel[/bold]", "it's [red]a dir[/red]", "a b;$(echo hi)", "ünïcode-\u00e9"])
def test_legal_paths_with_shell_and_markup_characters_work(tmp_path: Path, monkeypatch, name):
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    monkeypatch.chdir(tmp_path)
    result = generate(plan, name)
    assert result.exit_code == 0, result.output
    assert RUN_FILES <= set(os.listdir(tmp_path / name))
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{name}: ")  # printed as it is, not read as markup
    nxt = next(line for line in lines if line.strip().startswith("next:"))
    words = shlex.split(nxt.split("next:", 1)[1].split("(or:")[0])
    assert words == ["cd", name, "&&", "./launch_deepspeed.sh"]
    run, readme = nxt.split("(or: ")[1].rsplit(")", 1)[0].rsplit("; see ", 1)
    assert shlex.split(run) == ["dsplan", "run", name] and shlex.split(readme) == [f"{name}/README.md"]


def test_the_next_step_runs_as_printed(tmp_path: Path, monkeypatch):
    """The hint, pasted into a shell, reaches the run directory (cd part only: no job starts)."""
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    monkeypatch.chdir(tmp_path)
    name = "it's $HOME [x]"
    result = generate(plan, name)
    assert result.exit_code == 0, result.output
    hint = next(line for line in result.stdout.splitlines() if "next:" in line).split("next:", 1)[1]
    cd = hint.split("&&")[0]
    shown = subprocess.run(["bash", "-c", f"{cd} && pwd"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == str((tmp_path / name).resolve())


KILLED_WRITE = """
import os, sys
import planner.emit.write as write
write._commit = lambda *args, **kwargs: os._exit(137)  # killed after staging, before any rename
from planner.cli import main
sys.argv = ["dsplan", "generate", "--plan", sys.argv[1], "--out", sys.argv[2], "--force"]
main()
"""


def test_a_killed_write_leaves_temporaries_the_next_write_removes(tmp_path: Path):
    out = tmp_path / "run"
    first = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    assert generate(first, str(out)).exit_code == 0
    other = write_plan(tmp_path, "gpt3-125m", 1, name="other.json", zero_stage=2)
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(other), str(out)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr
    left = sorted(n for n in os.listdir(out) if n.endswith(".tmp"))
    assert ".dsplan-manifest.json" in " ".join(left) and any(n.startswith(".plan.json.") for n in left)
    mine = [".notes.abcdefgh.tmp", ".plan.json.tmp", ".plan.json.short.tmp"]  # not dsplan's temporaries
    for name in mine:
        (out / name).write_text("keep me")
    result = generate(other, str(out))
    assert result.exit_code == 0, result.output
    assert f"{len(left)} left-over temporary file(s) of an interrupted write removed" in " ".join(result.stdout.split())
    assert sorted(n for n in os.listdir(out) if n.endswith(".tmp")) == sorted(mine)
    assert '"zero_stage": 2' in (out / "plan.json").read_text()
