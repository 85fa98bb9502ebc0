"""What a person reads from ``suggest`` and ``estimate``: the width (COLUMNS, else the terminal,
else PIPE_WIDTH), and no breakdown rows for parts that do not apply."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cli.output import PIPE_WIDTH, human_time, output_width

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


# (flags, the breakdown rows that apply)
LAYOUTS = [
    (("--model", "llama-3.1-8b", "--tp", "1", "--pp", "1", "--dp", "8"), {"compute", "DP comm", "optimizer"}),
    (("--model", "llama-3.1-8b", "--tp", "8", "--pp", "1", "--dp", "1", "--recompute", "full"),
     {"compute", "recompute", "TP comm", "optimizer"}),
    (("--model", "llama-3.1-8b", "--tp", "1", "--pp", "8", "--dp", "1"),
     {"compute", "PP bubble", "PP comm", "optimizer"}),
    (("--model", "mixtral-8x7b", "--nodes", "4", "--tp", "2", "--pp", "2", "--ep", "8", "--recompute", "selective",
      "--framework", "megatron"),
     {"compute", "recompute", "TP comm", "PP bubble", "PP comm", "DP comm", "EP comm", "optimizer"}),
]
JSON_KEYS = {"compute": "compute_s", "recompute": "recompute_s", "TP comm": "tp_comm_s", "PP bubble": "pp_bubble_s",
             "PP comm": "pp_comm_s", "DP comm": "dp_comm_s", "EP comm": "ep_comm_s", "optimizer": "optimizer_s"}


@pytest.mark.parametrize(("flags", "rows"), LAYOUTS)
def test_estimate_breakdown_shows_the_parts_that_apply(flags, rows) -> None:
    args = ["estimate", *flags, *(() if "--nodes" in flags else ("--nodes", "1"))]
    out = CliRunner().invoke(main, args).output
    table = out.split("Step time (exposed)")[1]
    shown = {name for name in JSON_KEYS if re.search(rf"^\W*{name} ", table, flags=re.M)}
    assert shown == rows
    assert "0.0 us" not in out
    times = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)["time"]
    for name, key in JSON_KEYS.items():  # a part left out is one the plan does not have
        if name not in rows:
            assert times[key] == 0.0, name


def test_zero_time_reads_as_zero() -> None:
    assert human_time(0.0) == "0 s"
    assert human_time(4.2e-6) == "4.2 us" and human_time(0.0123) == "12.30 ms"
