"""Megatron-Core's precision-aware optimizer (``--precision-aware-optimizer``): bf16 Adam moments
and, where TE's FusedAdam holds the master weights, their 16-bit remainders; priced in memory
and in the optimizer step, refused where the runtime has no such optimizer, and emitted as
Megatron-LM's flags."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost import efficiency as eff
from planner.model.catalog import load_model
from tests.test_emit_scripts import MEGATRON_LM_FLAGS

SHAPE = {"micro_batch": 1, "global_batch": 64, "seq_len": 4096, "framework": "megatron", "zero": 1}


def _estimate(**kw):
    cluster = api.load_cluster("dgx-h100", nodes=1)
    return api.estimate("llama-3-8b", cluster, **{**SHAPE, **kw})


@pytest.mark.parametrize("precision, per_param", [
    ("bf16", 2 + 2 * 2),  # 16-bit master remainders + two bf16 moments
    ("fp8-delayed", 2 + 2 * 2),  # TE's FusedAdam still holds the master weights
    ("fp8-tensorwise", 4 + 2 * 2),  # current scaling: Megatron-Core keeps fp32 master weights
])
def test_optimizer_states_per_parameter_over_the_distributed_optimizer(precision, per_param):
    params = load_model("llama-3-8b").total_params()
    on = _estimate(precision=precision, precision_aware_optimizer=True).stages[0].memory
    off = _estimate(precision=precision).stages[0].memory
    assert on.optimizer == pytest.approx(per_param * params / 8, rel=1e-9)
    assert off.optimizer == pytest.approx(12 * params / 8, rel=1e-9)
    assert on.weights == off.weights and on.grads == off.grads  # bf16 weights, fp32 main_grad stay


def test_the_step_moves_24_bytes_per_parameter_instead_of_34():
    assert eff.adam_step_bytes() == eff.ADAM_STEP_BYTES == 34.0
    assert eff.adam_step_bytes(moment_bytes=2, master_bytes=2) == 24.0  # 4 + 8 moments + 4 grad + 2 + 2 + 4
    on, off = _estimate(precision_aware_optimizer=True), _estimate()
    assert on.time.optimizer == pytest.approx(off.time.optimizer * 24 / 34, rel=0.05)


@pytest.mark.parametrize("args", [
    ["--framework", "deepspeed", "--zero", "1"],
    ["--framework", "megatron", "--zero", "3"],
    ["--framework", "megatron", "--zero", "1", "--offload", "optimizer"],
    ["--framework", "megatron", "--zero", "1", "--optimizer", "sgd"],
    ["--framework", "megatron", "--zero", "1", "--precision", "fp16"],
])
def test_where_it_cannot_run_is_one_clear_error(args):
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--global-batch",
                                  "64", "--precision-aware-optimizer", *args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--precision-aware-optimizer" in lines[0] and "--zero 1" in lines[0], r.output


def test_suggest_searches_only_plans_that_can_run_it():
    cluster = api.load_cluster("dgx-h100", nodes=2)
    out = api.suggest("llama-3-8b", cluster, global_batch=128, precision_aware_optimizer=True, top=5)
    assert out.plans
    for ranked in out.plans:
        cfg = ranked.plan.cfg
        assert (cfg.framework, cfg.zero_stage, cfg.offload) == ("megatron", 1, "none")
    assert out.plans[0].plan.to_json()["precision_aware_optimizer"] is True


def _generate(tmp_path, *args):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out, entry = tmp_path / "run", tmp_path / "pretrain_gpt.py"
    entry.write_text("# Megatron-LM's entry point stands here\n")
    r = CliRunner().invoke(main, ["generate", "--entry", str(entry), "--model", "llama-3-8b", "--hardware", "dgx-h100",
                                  "--framework", "megatron", "--zero", "1", "--dp", "8", "--global-batch", "64",
                                  "--out", str(out), *args])
    assert r.exit_code == 0, r.output
    return (out / "megatron_args.sh").read_text(), json.loads((out / "plan.json").read_text())


def test_generate_emits_the_optimizer_flags_megatron_lm_takes(tmp_path):
    text, plan = _generate(tmp_path, "--precision-aware-optimizer")
    for flag in ("--use-precision-aware-optimizer", "--exp-avg-dtype bf16", "--exp-avg-sq-dtype bf16"):
        assert flag in text, flag
        assert flag.split()[0] in MEGATRON_LM_FLAGS
    assert plan["precision_aware_optimizer"] is True
    plain, _ = _generate(tmp_path / "off")
    assert "--use-precision-aware-optimizer" not in plain and "--exp-avg-dtype" not in plain


@pytest.mark.parametrize("precision, gathers", [("fp8-tensorwise", False), ("fp8-delayed", True)])
def test_fp8_parameter_gather_with_optimizer_offload_only_under_delayed_scaling(tmp_path, precision, gathers):
    """Megatron-LM asserts that --fp8-param-gather with --optimizer-cpu-offload needs
    --fp8-recipe delayed (arguments.py): elsewhere the plan keeps its bf16 weights, priced so."""
    text, _ = _generate(tmp_path, "--offload", "optimizer", "--precision", precision)
    assert ("--fp8-param-gather" in text) == gathers
    assert text.count("--use-precision-aware-optimizer") == 1  # the offload's own
    on = _estimate(precision=precision, offload="optimizer").stages[0].memory
    kept = _estimate(precision=precision, offload="optimizer", fp8_param_gather=False).stages[0].memory
    assert (on.weights < kept.weights) == gathers
