"""What a person reads from ``suggest`` and ``estimate``: the width (COLUMNS, else the terminal,
else PIPE_WIDTH)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from planner.cli.output import PIPE_WIDTH, output_width

WIDE = ("--model", "llama-3.1-70b", "--nodes", "4", "--tp", "8", "--pp", "2,4", "--zero", "1",
        "--virtual-stages", "1,2")


def dsplan(*args: str, columns: str | None) -> str:
    """dsplan's standard output, piped (no terminal), with COLUMNS set or unset."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    proc = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(("columns", "width", "table"),
                         [("80", 80, False), ("200", 200, True), (None, PIPE_WIDTH, True)])
def test_suggest_honours_columns_then_the_pipe_default(columns, width, table) -> None:
    out = dsplan("suggest", *WIDE, columns=columns)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    assert ("peak / cap" in out) == table  # the table, or two lines per plan where it cannot fit
    if width == 200:  # wide enough: nothing is folded, so the long lines come out whole
        assert max(len(line) for line in lines) > 160
    assert "…" not in out


def test_estimate_honours_columns() -> None:
    out = dsplan("estimate", "--model", "llama-3.1-70b", "--nodes", "4", "--tp", "8", "--pp", "4",
                 "--framework", "megatron", columns="60")
    assert max(len(line) for line in out.splitlines()) <= 60


def test_the_width_rule(monkeypatch) -> None:
    class Pipe:
        def isatty(self) -> bool:
            return False

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "93")
    assert output_width(Pipe()) == output_width(Terminal()) == 93
    monkeypatch.setenv("COLUMNS", "wide")  # not a number: as if unset
    assert (output_width(Pipe()), output_width(Terminal())) == (PIPE_WIDTH, None)
    monkeypatch.delenv("COLUMNS")
    assert (output_width(Pipe()), output_width(Terminal())) == (PIPE_WIDTH, None)
