"""What a person reads from ``suggest`` and ``estimate``: the width (COLUMNS, else the terminal,
else PIPE_WIDTH), the legend, the model's error against the plans' differences, thousands
separators, and no breakdown rows for parts that do not apply."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from planner.accuracy import MODEL_ERROR, MODEL_ERROR_RUNS
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
                 "--framework", "megatron", "--allow-oom", columns="60")
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


def _legend(out: str) -> str:
    text = " ".join(out.split())
    return text.split("legend: ")[1].split(" ~ plans")[0].split(" #1 is faster")[0]


def test_the_legend_names_the_abbreviations_that_appear() -> None:
    # Without TP overlap, megatron-deepspeed plans rank among the top 48 too (meg-ds in the table,
    # 3-4% behind Megatron-LM, whose TP gradient reductions hide under its wgrad GEMMs).
    out = dsplan("suggest", *WIDE, "--top", "48", "--no-tp-comm-overlap", columns="250")
    legend = _legend(out)
    table = out.split("legend:")[0]
    for cell, meaning in (("8+sp", "8+sp = TP 8 with sequence parallelism"),
                          (" opt ", "opt = optimizer states offloaded to the CPU"),
                          ("meg-ds", "meg-ds = megatron-deepspeed"),
                          ("2x2 ", "pp 2x2 = 2 pipeline stages x 2 interleaved virtual stages per rank")):
        assert cell in table and meaning in legend, (cell, legend)
    assert "mb x acc = micro-batch x gradient-accumulation steps" in legend
    assert "stage, greedy = the slowest pipeline stage per micro-batch" in legend


def test_the_legend_leaves_out_what_does_not_appear() -> None:
    out = dsplan("suggest", "--model", "gpt3-1.3b", "--nodes", "1", "--tp", "1", "--pp", "1", "--offload", "none",
                 "--framework", "deepspeed", "--top", "3", columns="200")
    legend = _legend(out)
    assert "mb x acc =" in legend
    for absent in ("+sp", "opt", "virtual stages", "meg-ds", "stage, greedy", "/"):
        assert absent not in legend, absent


def test_help_explains_the_abbreviations_and_the_error_figure() -> None:
    text = " ".join(CliRunner().invoke(main, ["suggest", "--help"]).output.split())
    for needle in ("8+sp tensor parallelism 8 with sequence parallelism", "2x4 (pp) 2 pipeline stages x 4",
                   "opt optimizer states offloaded", "meg-ds megatron-deepspeed", "mb x acc micro-batch x",
                   "stage, greedy a pipelined plan's slowest stage", f"({MODEL_ERROR:.1%}, docs/accuracy.md)",
                   "--flash-attention / --no-flash-attention", "--dropout / --no-dropout"):
        assert needle in text, needle


# Plans 15% and more apart, so the model's error covers some of them only.
SPREAD = ("--model", "gpt3-1.3b", "--nodes", "1", "--tp", "1,2", "--pp", "1", "--framework", "deepspeed",
          "--micro-batch", "2,4", "--recompute", "none,full", "--offload", "none", "--zero", "1", "--top", "8")


def test_plans_within_the_models_error_are_called_ties() -> None:
    data = json.loads(CliRunner().invoke(main, ["suggest", *SPREAD, "--json"]).output)
    u = data["uncertainty"]
    assert u["model_error"] == MODEL_ERROR and f"{MODEL_ERROR_RUNS} published runs" in u["source"]
    best = data["plans"][0]["step_time_s"]
    ties = [p["id"] for p in data["plans"] if p["step_time_s"] <= best * (1 + MODEL_ERROR)]
    assert u["ties_with_best"] == ties
    assert 1 < len(ties) < len(data["plans"])  # the case splits: some within the error, some beyond
    out = dsplan("suggest", *SPREAD, columns="200")
    marked = [int(m) for m in re.findall(r"^(\d+)~ ", out, flags=re.M)]
    assert marked == ties[1:]
    text = " ".join(out.split())
    last = ties[-1]
    assert (f"~ plans #1-#{last} predict step times within {MODEL_ERROR:.1%} of #1's, the model's mean error on "
            f"{MODEL_ERROR_RUNS} published runs") in text
    assert "treat them as ties" in text


def test_a_clear_winner_is_said_to_be_one() -> None:
    args = ("--model", "gpt3-1.3b", "--nodes", "1", "--tp", "1", "--pp", "1", "--framework", "deepspeed",
            "--micro-batch", "1", "--recompute", "none,full", "--offload", "none", "--zero", "1", "--top", "4")
    data = json.loads(CliRunner().invoke(main, ["suggest", *args, "--json"]).output)
    assert data["uncertainty"]["ties_with_best"] == [1] and len(data["plans"]) > 1
    text = " ".join(CliRunner().invoke(main, ["suggest", *args]).output.split())
    assert f"#1 is faster than the other plans shown by more than {MODEL_ERROR:.1%} of its step time" in text
    assert "~" not in text


def test_no_ties_under_the_memory_objective() -> None:
    args = ("suggest", *SPREAD, "--objective", "memory")
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    assert data["uncertainty"]["ties_with_best"] is None
    out = CliRunner().invoke(main, list(args)).output
    assert "treat them as ties" not in out and "#1 is faster" not in out


def test_the_totals_line_has_thousands_separators() -> None:
    args = ("suggest", "--model", "vl2", "--nodes", "8")
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    text = " ".join(CliRunner().invoke(main, list(args)).output.split())
    assert data["evaluated"] >= 1000 and data["rejected"]["framework"] >= 1000
    assert f"{data['evaluated']:,} candidates evaluated" in text
    assert f"{data['rejected']['framework']:,} the framework cannot run" in text
    assert f"{data['rejected']['out_of_memory']:,} out of memory" in text


# (flags, the breakdown rows that apply). DeepSpeed (the default runtime) flattens its gradients
# for the reduction even with a DP group of one (runtime_copies.py): "DP comm" applies there too.
LAYOUTS = [
    (("--model", "llama-3.1-8b", "--tp", "1", "--pp", "1", "--dp", "8"), {"compute", "DP comm", "optimizer"}),
    (("--model", "llama-3.1-8b", "--tp", "8", "--pp", "1", "--dp", "1", "--recompute", "full"),
     {"compute", "recompute", "TP comm", "DP comm", "optimizer"}),
    (("--model", "llama-3.1-8b", "--tp", "8", "--pp", "1", "--dp", "1", "--recompute", "full",
      "--framework", "megatron"), {"compute", "recompute", "TP comm", "optimizer"}),
    (("--model", "llama-3.1-8b", "--tp", "1", "--pp", "8", "--dp", "1"),
     {"compute", "PP bubble", "PP comm", "DP comm", "optimizer"}),
    (("--model", "mixtral-8x7b", "--nodes", "4", "--tp", "2", "--pp", "2", "--ep", "8", "--recompute", "selective",
      "--framework", "megatron", "--sequence-parallel"),
     {"compute", "recompute", "TP comm", "PP bubble", "PP comm", "DP comm", "EP comm", "optimizer"}),
]
JSON_KEYS = {"compute": "compute_s", "recompute": "recompute_s", "TP comm": "tp_comm_s", "PP bubble": "pp_bubble_s",
             "PP comm": "pp_comm_s", "DP comm": "dp_comm_s", "EP comm": "ep_comm_s", "optimizer": "optimizer_s"}


@pytest.mark.parametrize(("flags", "rows"), LAYOUTS)
def test_estimate_breakdown_shows_the_parts_that_apply(flags, rows) -> None:
    args = ["estimate", *flags, *(() if "--nodes" in flags else ("--nodes", "1")), "--allow-oom"]
    out = CliRunner().invoke(main, args).output
    table = out.split("Step time (exposed)")[1]
    shown = {name for name in JSON_KEYS if re.search(rf"^\W*{name} ", table, flags=re.M)}
    assert shown == rows
    assert "0.0 us" not in out
    times = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)["time"]
    for name, key in JSON_KEYS.items():  # a part left out is one the plan does not have
        if name not in rows:
            assert times[key] == 0.0, name


def test_suggest_time_line_names_the_parts_that_apply() -> None:
    data = json.loads(CliRunner().invoke(main, ["suggest", "--model", "vl2", "--nodes", "8", "--json"]).output)
    best = data["plans"][0]
    text = " ".join(CliRunner().invoke(main, ["suggest", "--model", "vl2", "--nodes", "8"]).output.split())
    line = text.split("time per step ")[1].split(" memory on")[0]
    assert ("pp bubble" in line) == (best["pp"] > 1) and ("tp comm" in line) == (best["tp"] > 1)
    assert ("ep comm" in line) == (best["ep"] > 1) and ("recompute" in line) == (best["recompute"] != "none")
    assert "compute" in line and "optimizer" in line


def test_zero_time_reads_as_zero() -> None:
    assert human_time(0.0) == "0 s"
    assert human_time(4.2e-6) == "4.2 us" and human_time(0.0123) == "12.30 ms"
