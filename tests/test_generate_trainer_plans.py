"""``dsplan generate --entry builtin`` (the default) searches only plans the reference trainer runs.

The trainer (DeepSpeed's engine) runs one pipeline chunk per stage and tensor parallelism only as
AutoTP (planner/run/rundir.py ``trainer_refusal``). generate used to pick the search's best plan
anyway, e.g. an interleaved Megatron plan that `dsplan run` then refused. Each chosen plan here
goes through `dsplan run --dry-run`, whose check (``inspect_run_dir``) is the one every rank makes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.run.rundir import trainer_refusal

ISSUE = ["--model", "deepseek-vl2-tiny", "--nodes", "1", "--gpus-per-node", "2", "--pp", "2"]


def generate(out: Path, *args: str):
    return CliRunner().invoke(main, ["generate", *args, "--out", str(out), "--json"])


def runnable(plan, is_moe: bool) -> bool:
    c = plan.cfg
    return trainer_refusal(c.framework, c.tp, c.pp, c.virtual_stages, is_moe, c.cp, c.dp_replicate,
                           c.activation_offload) is None


def test_the_issues_command_picks_a_plan_the_trainer_runs(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    unrestricted = generate(tmp_path / "own", *ISSUE, "--entry", str(script))
    assert unrestricted.exit_code == 0, unrestricted.output
    assert json.loads(unrestricted.stdout)["plan"]["virtual_stages"] == 2  # the search's best: interleaved
    result = generate(tmp_path / "D", *ISSUE, "--entry", "builtin")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["warnings"] == []
    plan = json.loads((tmp_path / "D" / "plan.json").read_text())
    assert plan["virtual_stages"] == 1 and plan["pp"] == 2 and plan["id"] == 1
    # the best of what the trainer runs: the search pinned to virtual stages 1, first runnable
    model = api.load_model("deepseek-vl2-tiny")
    best = api.suggest(model, api.load_cluster("dgx-a100-80g", 1, gpus_per_node=2), top=1, pp=2, virtual_stages=1)
    assert plan["tokens_per_s"] == pytest.approx(best.plans[0].plan.tokens_per_s, rel=1e-12)
    run = CliRunner().invoke(main, ["run", str(tmp_path / "D"), "--local", "--dry-run"])
    assert run.exit_code == 0, run.output  # run's own refusal check accepts it


def test_tensor_parallel_plans_are_kept_only_under_deepspeed(tmp_path: Path):
    """llama-3.1-70b on 4 nodes: the search's 258 best plans are Megatron with tp > 1 (which the
    trainer cannot shard; 103 of them recompute the norms); generate takes the best that remains,
    and --rank 2 the next."""
    model = api.load_model("llama-3.1-70b")
    everything = api.suggest(model, api.load_cluster("dgx-a100-80g", 4), top=512, virtual_stages=1)
    kept = [rp.plan for rp in everything.plans if runnable(rp.plan, False)]
    assert not runnable(everything.plans[0].plan, False) and len(kept) >= 2
    for rank, expected in ((1, kept[0]), (2, kept[1])):
        result = generate(tmp_path / f"r{rank}", "--model", "llama-3.1-70b", "--nodes", "4", "--rank", str(rank))
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)["plan"]
        assert plan["id"] == rank
        assert (plan["framework"], plan["tp"], plan["pp"], plan["dp"], plan["zero_stage"], plan["micro_batch"]) == (
            expected.cfg.framework, expected.cfg.tp, expected.cfg.pp, expected.cfg.dp, expected.cfg.zero_stage,
            expected.cfg.micro_batch)
        assert plan["tokens_per_s"] == pytest.approx(expected.tokens_per_s, rel=1e-12)
        assert CliRunner().invoke(main, ["run", str(tmp_path / f"r{rank}"), "--dry-run"]).exit_code == 0
    readme = (tmp_path / "r2" / "README.md").read_text()
    assert "Ranked #2 by the search, below #1:" in readme  # explained against the trainer's #1, not Megatron's


@pytest.mark.parametrize(("args", "needles"), [
    (["--virtual-stages", "2"], ["--virtual-stages 2", "one contiguous pipeline chunk", "--virtual-stages 1",
                                 "--entry SCRIPT"]),
    (["--tp", "2"], ["--tp 2", "AutoTP", "MoE model", "pin --tp 1", "--entry SCRIPT"]),
    (["--framework", "megatron", "--tp", "2", "--model", "llama-3.1-8b"],
     ["--tp 2 with --framework megatron", "AutoTP (--framework deepspeed)", "pin --tp 1 or --framework deepspeed",
      "--entry SCRIPT"]),
    (["--tp", "2", "--pp", "2", "--model", "llama-3.1-8b"], ["--tp 2 with --pp 2", "pin --tp 1 or --pp 1"]),
])
def test_pins_that_leave_the_trainer_nothing_exit_2_naming_what_to_pin(tmp_path: Path, args, needles):
    flags = ["--model", "deepseek-vl2-tiny", "--nodes", "1", "--gpus-per-node", "8"]
    if "--model" in args:  # a dense model instead
        i = args.index("--model")
        flags[1], args = args[i + 1], args[:i] + args[i + 2:]
    result = CliRunner().invoke(main, ["generate", *flags, *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    for needle in needles:
        assert needle in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_pins_the_trainer_shares_are_kept(tmp_path: Path):
    """--virtual-stages 1,2 keeps 1; --tp 2 on a dense model runs as AutoTP (deepspeed, no pipeline)."""
    result = generate(tmp_path / "a", *ISSUE, "--virtual-stages", "1,2")
    assert result.exit_code == 0 and json.loads(result.stdout)["plan"]["virtual_stages"] == 1
    result = generate(tmp_path / "b", "--model", "llama-3.1-8b", "--nodes", "1", "--tp", "2")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert (plan["framework"], plan["tp"], plan["pp"]) == ("deepspeed", 2, 1)
    assert CliRunner().invoke(main, ["run", str(tmp_path / "b"), "--dry-run"]).exit_code == 0


def test_nothing_fitting_says_which_pins_were_the_trainers(tmp_path: Path):
    result = CliRunner().invoke(main, ["generate", "--model", "llama-3.1-405b", "--nodes", "1",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "--entry builtin searches only what the reference trainer runs, as if given --virtual-stages 1" \
        in result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()
