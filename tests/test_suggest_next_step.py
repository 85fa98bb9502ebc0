"""``suggest`` ends with the ``dsplan generate`` command that writes plan #1's run directory,
and that command, run as printed, does so."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cli.next_step import default_out, shell_lines

# The fields that make a plan: its layout, its workload and its predictions.
PLAN_FIELDS = ("model", "hardware", "nodes", "gpus_per_node", "framework", "dp", "tp", "pp", "ep", "zero_stage",
               "offload", "micro_batch", "grad_accum", "recompute", "sequence_parallel", "virtual_stages",
               "global_batch", "seq_len", "precision", "optimizer", "flash_attention", "dropout", "stage_blocks")


def printed_command(output: str) -> str:
    """The command under the ``next:`` line, continuation lines joined."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    command = []
    for line in lines[start + 1:]:
        command.append(line.strip().removesuffix("\\").strip())
        if not line.endswith("\\"):
            break
    return " ".join(command)


CASES = [
    ("--model", "vl2", "--nodes", "2", "--pp", "1,2", "--no-ep-comm-overlap", "--top", "3"),
    ("--model", "llama-3.1-8b", "--nodes", "1", "--tp", "1,2", "--recompute", "none,full", "--no-sequence-parallel",
     "--global-batch", "64", "--seq-len", "2048", "--balancer", "greedy", "--objective", "cost", "--top", "2"),
    ("--model", "gpt3-350m", "--nodes", "1", "--gpus-per-node", "4", "--dropout", "--no-flash-attention",
     "--precision", "fp16", "--framework", "megatron,deepspeed", "--virtual-stages", "1,2", "--top", "1"),
]


@pytest.mark.parametrize("args", CASES)
def test_the_printed_command_writes_plan_one(args, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    human = runner.invoke(main, ["suggest", *args])
    assert human.exit_code == 0, human.output
    data = json.loads(runner.invoke(main, ["suggest", *args, "--json"]).output)
    command = printed_command(human.output)
    assert command == data["next_command"]
    argv = shlex.split(command)
    assert argv[:2] == ["dsplan", "generate"] and argv[-4:] == ["--rank", "1", "--out", argv[-1]]
    assert "--top" not in argv and "--json" not in argv
    # every flag given is there, spelled as given (the preset name, not the model's full name)
    given = [a for a in args if a.startswith("--") and a != "--top"]
    assert sorted(a for a in argv if a.startswith("--") and a not in ("--hardware", "--rank", "--out")) == sorted(given)
    for flag, value in zip(args, args[1:]):
        if flag.startswith("--") and not value.startswith("--") and flag != "--top":
            assert argv[argv.index(flag) + 1] == value
    result = runner.invoke(main, argv[1:])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / argv[-1] / "plan.json").read_text())
    best = data["plans"][0]
    assert {k: plan[k] for k in PLAN_FIELDS} == {k: best[k] for k in PLAN_FIELDS}
    assert plan["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-12)


def test_default_out_names_the_model_and_the_nodes() -> None:
    assert default_out("deepseek-vl2", 8) == "runs/deepseek-vl2-8n"
    assert default_out("my model/v2", 1) == "runs/my-model-v2-1n"


@pytest.mark.parametrize("width", [50, 80, 200])
def test_shell_lines_fit_the_width_and_paste_back(width) -> None:
    argv = ["dsplan", "generate", "--model", "/data/my models/config.json", "--hardware", "dgx-a100-80g", "--nodes",
            "8", "--pp", "2,4", "--no-flash-attention", "--rank", "1", "--out", "runs/x-8n"]
    lines = shell_lines(argv, width)
    assert all(len(line) <= width for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert shlex.split(" ".join(line.removesuffix("\\") for line in lines)) == argv
    assert (len(lines) == 1) == (width == 200)
    # an option stays with its value, even where the two overflow the width
    assert not any(line.rstrip(" \\").endswith(("--model", "--nodes", "--pp", "--out")) for line in lines)
    assert "    --model '/data/my models/config.json' \\" in shell_lines(argv, 20)


def test_no_next_step_when_nothing_fits() -> None:
    result = CliRunner().invoke(main, ["suggest", "--model", "llama-3.1-70b", "--tp", "8", "--zero", "0",
                                       "--framework", "megatron"])
    assert result.exit_code == 2 and "next:" not in result.output and "--rank 1" not in result.output
