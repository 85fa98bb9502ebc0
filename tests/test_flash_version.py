"""The FlashAttention generation (Workload.flash_version): FlashAttention-1 and its Triton port run
the attention core at half FlashAttention-2's rate (Dao 2023, abstract), forward, backward and the
recomputed forward alike; Transformer Engine's attention runs neither; the choice reaches plans,
plan files and the search's inputs, and a contradiction exits 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost import efficiency as eff
from planner.cost.kernel_times import attention_seconds
from planner.cost.layers import layer_costs
from planner.errors import UserError


def test_flash1_takes_twice_flash2s_kernel_time():
    dev2 = eff.device(api.load_cluster("dgx-a100-80g", nodes=1).profile)
    dev1 = eff.device(api.load_cluster("dgx-a100-80g", nodes=1).profile, flash_version=1)
    flops = np.array([1e12, 3e13])
    for backward in (False, True):
        t2 = eff.flash_time(flops, 128, True, dev2, backward) - eff.KERNEL_OVERHEAD_S
        t1 = eff.flash_time(flops, 128, True, dev1, backward) - eff.KERNEL_OVERHEAD_S
        assert t1 == pytest.approx(2.0 * t2, rel=1e-12)
    # FlashAttention-2 at head dim 128 lands inside the paper's 50-73% band, FlashAttention-1 inside 25-40%
    assert 0.50 <= float(eff.flash_efficiency(128, dev2)) / dev2.gemm_sustained * eff.GEMM_SUSTAINED <= 0.73
    assert 0.25 <= float(eff.flash_efficiency(128, dev1)) / dev1.gemm_sustained * eff.GEMM_SUSTAINED <= 0.40


def _plan(hardware: str = "dgx-a100-80g", **kw):
    cluster = api.load_cluster(hardware, nodes=1)
    knobs = {"framework": "deepspeed", "zero": 3, "dp": 8, "micro_batch": 2, "global_batch": 32, "seq_len": 4096}
    return api.estimate("llama-3.1-8b", cluster, **{**knobs, **kw})


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_step_pays_the_slower_attention_in_every_pass(recompute):
    """grad_accum 2 micro-batches of 2 samples: the step grows by the attention core's extra time
    forward and backward, and once more forward where the blocks are recomputed."""
    fa2, fa1 = _plan(recompute=recompute), _plan(recompute=recompute, flash_version=1)
    model = api.load_model("llama-3.1-8b")
    costs = layer_costs(model, fa2.workload)
    profile = api.load_cluster("dgx-a100-80g", nodes=1).profile
    bs = np.array([2.0])
    f2, b2 = attention_seconds(costs, bs, eff.device(profile))
    f1, b1 = attention_seconds(costs, bs, eff.device(profile, flash_version=1))
    passes = 2.0 if recompute == "full" else 1.0
    extra = (passes * (f1 - f2).sum() + (b1 - b2).sum()) * 2  # two micro-batches
    assert fa1.step_time_s - fa2.step_time_s == pytest.approx(extra, rel=1e-6)
    assert fa1.memory.peak == fa2.memory.peak  # the same kernel structure keeps the same bytes


@pytest.mark.parametrize("hardware", ["dgx-a100-80g", "dgx-h100"])
def test_transformer_engines_attention_runs_neither(hardware):
    kw = {"framework": "megatron", "zero": 1, "recompute": "none"}
    same = _plan(hardware, **kw).step_time_s
    assert _plan(hardware, flash_version=1, **kw).step_time_s == pytest.approx(same, rel=1e-12)
    off = {**kw, "te_attention": False}
    assert _plan(hardware, flash_version=1, **off).step_time_s > _plan(hardware, **off).step_time_s


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_bad_generations_exit_2_naming_the_flags():
    both = _cli("estimate", "--model", "llama-3.1-8b", "--no-flash-attention", "--flash-version", "1")
    assert both.exit_code == 2 and "Traceback" not in both.output
    assert "--flash-version 1" in both.output and "--flash-attention" in both.output
    assert _cli("estimate", "--model", "llama-3.1-8b", "--flash-version", "3").exit_code == 2
    with pytest.raises(UserError, match="flash_version"):
        api.make_workload("llama-3.1-8b", flash_version=3)
    with pytest.raises(UserError, match="flash_attention"):
        api.make_workload("llama-3.1-8b", flash_version=1, flash_attention=False)


def test_the_generation_reaches_the_header_the_plan_file_and_the_search(tmp_path):
    fits = ("--model", "llama-3.1-8b", "--framework", "deepspeed", "--zero", "3", "--recompute", "full")
    text = _cli("estimate", *fits, "--flash-version", "1")
    assert text.exit_code == 0 and "FlashAttention-1" in text.output
    out = tmp_path / "out"
    gen = _cli("generate", *fits, "--flash-version", "1", "--out", str(out))
    assert gen.exit_code == 0, gen.output
    assert json.loads((out / "plan.json").read_text())["flash_version"] == 1
    again = _cli("generate", "--plan", str(out / "plan.json"), "--out", str(tmp_path / "again"))
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "again" / "plan.json").read_text())["flash_version"] == 1
    found = _cli("suggest", "--model", "llama-3.1-8b", "--nodes", "1", "--flash-version", "1", "--top", "1", "--json")
    assert found.exit_code == 0 and json.loads(found.output)["inputs"]["flash_version"] == 1
