"""Every workload flag of ``estimate`` is a flag of ``suggest``, ``generate`` and ``plot`` too
(one definition: planner/cli/options.py ``workload_options``), reaches the API and changes the
numbers."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cli.estimate import estimate_command
from planner.cli.generate import generate_command
from planner.cli.plot import plot_command
from planner.cli.suggest import suggest_command

# One layout, pinned, so the flags below change its numbers and nothing else.
LAYOUT = ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--offload", "none", "--micro-batch", "2",
          "--recompute", "none", "--virtual-stages", "1", "--framework", "megatron", "--sequence-parallel")
BASE = ("--model", "gpt3-350m", "--nodes", "1", "--global-batch", "64", "--seq-len", "2048")
KNOBS = [(), ("--dropout",), ("--no-flash-attention",), ("--no-flash-attention", "--dropout")]


def _options(command) -> dict[str, list[str]]:
    return {p.name: [*p.opts, *p.secondary_opts] for p in command.params}


@pytest.mark.parametrize("command", [suggest_command, generate_command, plot_command])
def test_every_workload_flag_of_estimate_is_there(command) -> None:
    estimate, other = _options(estimate_command), _options(command)
    for key in api.WORKLOAD_KEYS:
        assert other[key] == estimate[key], key
    assert estimate["flash_attention"] == ["--flash-attention", "--no-flash-attention"]
    assert estimate["dropout"] == ["--dropout", "--no-dropout"]


def _suggest(*flags: str) -> dict:
    result = CliRunner().invoke(main, ["suggest", *BASE, *LAYOUT, *flags, "--top", "1", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _estimate(*flags: str, stage_blocks: list | None = None) -> dict:
    split = ("--stage-blocks", ",".join(f"{a}-{b}" for a, b in stage_blocks)) if stage_blocks else ()
    result = CliRunner().invoke(main, ["estimate", *BASE, *LAYOUT, *flags, *split, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_dropout_and_unfused_attention_change_suggests_prediction_as_estimate_has_it() -> None:
    plans = {knobs: _suggest(*knobs)["plans"][0] for knobs in KNOBS}
    for knobs, plan in plans.items():
        assert plan["dropout"] == ("--dropout" in knobs)
        assert plan["flash_attention"] == ("--no-flash-attention" not in knobs)
        est = _estimate(*knobs, stage_blocks=plan["stage_blocks"])
        assert plan["step_time_s"] == pytest.approx(est["step_time_s"], rel=1e-9)
        assert plan["memory"]["peak_bytes"] == pytest.approx(est["memory"]["peak_bytes"], rel=1e-9)
    plain, dropout, unfused, both = (plans[k] for k in KNOBS)
    # dropout masks: more stored activations and more elementwise work; unfused attention keeps
    # the s^2 scores and runs slower kernels
    assert dropout["step_time_s"] > plain["step_time_s"] and unfused["step_time_s"] > plain["step_time_s"]
    assert dropout["memory"]["activations_bytes"] > plain["memory"]["activations_bytes"]
    assert unfused["memory"]["activations_bytes"] > plain["memory"]["activations_bytes"]
    assert both["memory"]["activations_bytes"] > max(dropout["memory"]["activations_bytes"],
                                                     unfused["memory"]["activations_bytes"])
    inputs = _suggest("--no-flash-attention", "--dropout")["inputs"]
    assert (inputs["flash_attention"], inputs["dropout"]) == (False, True)


def test_suggest_header_names_the_kernel_and_dropout() -> None:
    result = CliRunner().invoke(main, ["suggest", *BASE, *LAYOUT, "--no-flash-attention", "--dropout", "--top", "1"])
    assert "bf16, adamw, unfused attention, dropout |" in " ".join(result.output.split())
    plain = CliRunner().invoke(main, ["suggest", *BASE, *LAYOUT, "--top", "1"])
    assert "unfused" not in plain.output and "dropout" not in plain.output.split("\n")[0]


def test_generate_without_plan_searches_with_the_flags(tmp_path) -> None:
    out, entry = tmp_path / "run", tmp_path / "pretrain_gpt.py"  # Megatron TP plans: not the reference trainer's
    entry.write_text("print('stand-in for Megatron-LM')\n")
    result = CliRunner().invoke(main, ["generate", *BASE, *LAYOUT, "--dropout", "--no-flash-attention",
                                       "--entry", str(entry), "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    best = _suggest("--dropout", "--no-flash-attention")["plans"][0]
    assert (plan["dropout"], plan["flash_attention"]) == (True, False)
    assert plan["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-12)
    assert plan["step_time_s"] > _suggest()["plans"][0]["step_time_s"]


@pytest.mark.parametrize("flag", ["--dropout", "--no-dropout", "--flash-attention", "--no-flash-attention"])
def test_generate_with_plan_refuses_the_flags(tmp_path, flag) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_estimate()))
    result = CliRunner().invoke(main, ["generate", "--plan", str(plan), flag, "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and f"drop {flag}" in result.output


def test_plot_prices_with_the_flags(tmp_path) -> None:
    def heatmap(*flags: str) -> list[dict]:
        result = CliRunner().invoke(main, ["plot", "heatmap", *BASE, "--tp", "1,2", "--pp", "1,2",
                                           "--framework", "megatron", *flags, "--out", str(tmp_path / "h.png"),
                                           "--json"])
        assert result.exit_code == 0, result.output
        return sorted(json.loads(result.output)["rows"], key=lambda r: (r["tp"], r["pp"]))

    plain, slower = heatmap(), heatmap("--dropout", "--no-flash-attention")
    assert [(r["tp"], r["pp"]) for r in plain] == [(r["tp"], r["pp"]) for r in slower]
    assert all(s["tokens_per_s"] < p["tokens_per_s"] for p, s in zip(plain, slower))


def test_the_api_takes_the_knobs() -> None:
    model, cluster = api.load_model("gpt3-350m"), api.load_cluster(nodes=1)
    pins = {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 2, "framework": "megatron", "recompute": "none", "zero": 1,
            "offload": "none", "virtual_stages": 1, "sequence_parallel": True}
    plain = api.suggest(model, cluster, top=1, global_batch=64, seq_len=2048, **pins).plans[0].plan
    knobs = api.suggest(model, cluster, top=1, global_batch=64, seq_len=2048, dropout=True, flash_attention=False,
                        **pins).plans[0].plan
    assert (knobs.workload.dropout, knobs.workload.flash_attention) == (True, False)
    assert knobs.step_time_s > plain.step_time_s
    est = api.estimate(model, cluster, global_batch=64, seq_len=2048, dropout=True, flash_attention=False,
                       partition=knobs.partition, **pins)
    assert est.step_time_s == pytest.approx(knobs.step_time_s, rel=1e-9)
