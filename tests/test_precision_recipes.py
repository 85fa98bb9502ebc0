"""Precision recipes (planner/cost/precision.py): what each changes in time and memory, which
GPU and runtime can run it, and the Megatron-LM flags it is written as."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost import efficiency as eff
from planner.cost.layer_cost import ACT
from planner.cost.layers import layer_costs
from planner.cost.parallel import Workload
from planner.cost.precision import RECIPES, split_precision
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from tests.test_emit_scripts import MEGATRON_LM_FLAGS, megatron_flags

LLAMA = load_model("llama-3-8b")


def _decoder(precision: str, tp: int = 2, sp: bool = False):
    wl = Workload(global_batch=8, seq_len=4096, precision=precision)
    costs = layer_costs(LLAMA, wl, tp=tp, sp=sp)
    return next(c for c in costs if c.kind == "decoder"), next(c for c in costs if c.kind == "lm_head")


def test_a_recipe_name_trains_in_bf16_with_that_recipe():
    wl = Workload(global_batch=8, seq_len=128, precision="mxfp8")
    assert (wl.precision, wl.recipe, wl.precision_name) == ("bf16", "mxfp8", "mxfp8")
    assert split_precision("fp16") == ("fp16", None) and split_precision("nvfp4") == ("bf16", "nvfp4")


def test_linear_gemms_run_in_the_recipe_and_attention_and_the_head_do_not():
    layer, head = _decoder("fp8-tensorwise")
    assert layer.gemms and all(g.low for g in layer.gemms)
    assert not any(g.low for g in head.gemms)
    assert layer.attn is not None  # the score and value products: bf16, priced by flash_time
    bf16_layer, _ = _decoder("bf16")
    assert not any(g.low for g in bf16_layer.gemms)
    # The weights the quantized cache holds: Llama-3-8B's q, k, v, o and SwiGLU matrices over tp 2.
    h, kv, ffn = 4096, 1024, 14336
    assert layer.low_params == (h * (h + 2 * kv) + h * h + 3 * h * ffn) / 2


def test_linear_inputs_are_kept_quantized_for_backward():
    """Per token, the QKV and fc1 inputs (replicated without SP) and the output-projection and
    fc2 inputs (split by tp) shrink from 2 bytes to the recipe's element bytes."""
    tp, h, ffn = 2, 4096, 14336
    for name in ("fp8-delayed", "mxfp8", "nvfp4"):
        q = RECIPES[name].element_bytes
        low, _ = _decoder(name, tp)
        base, _ = _decoder("bf16", tp)
        saved = (base.act["none"] - low.act["none"]) / low.tokens
        assert saved == pytest.approx((ACT - q) * (2 * h + (h + ffn) / tp))
        assert base.act["full"] == low.act["full"]  # full recompute keeps the bf16 layer input
    assert RECIPES["mxfp8"].element_bytes == 1 + 1 / 32 and RECIPES["nvfp4"].element_bytes == 0.5 + 1 / 16


def test_tp_all_gathers_move_the_recipes_bytes_and_reduce_scatters_bf16():
    """Under SP, TE gathers a column-parallel input quantized and, backward, a row-parallel output
    gradient: the attention's and the dense MLP's all-gathers at the recipe's element bytes."""
    tp, s, h = 4, 4096, 4096
    full = s * h * ACT  # one (s, h) activation, 16-bit
    for name in ("fp8-tensorwise", "mxfp8", "nvfp4"):
        low, head = _decoder(name, tp, sp=True)
        q = RECIPES[name].element_bytes
        assert low.tp_fwd == (("allgather", full * q / ACT), ("reducescatter", full)) * 2
        assert low.tp_bwd == (("reducescatter", full), ("allgather", full * q / ACT)) * 2
        assert head.tp_fwd == (("allgather", full),)  # the head's input: no recipe there
    bf16, _ = _decoder("bf16", tp, sp=True)
    assert bf16.tp_fwd == (("allgather", full), ("reducescatter", full)) * 2
    no_sp, _ = _decoder("fp8-tensorwise", tp, sp=False)  # all-reduces, 16-bit
    assert no_sp.tp_fwd == (("allreduce", full),) * 2
    moe = load_model("mixtral-8x7b")
    wl = Workload(global_batch=8, seq_len=s, precision="fp8-tensorwise")
    layer = next(c for c in layer_costs(moe, wl, tp=tp, sp=True, ep=2) if c.kind == "decoder")
    assert layer.tp_fwd[0][1] == full / ACT and all(b >= full for op, b in layer.tp_fwd[2:] if op == "allgather")


def test_quantizing_costs_memory_traffic_and_current_scaling_reads_twice():
    base, _ = _decoder("bf16")
    delayed, _ = _decoder("fp8-delayed")
    tensorwise, _ = _decoder("fp8-tensorwise")
    inputs = sum(g.tokens * g.k * g.batch for g in delayed.gemms)
    assert delayed.hbm_fwd - base.hbm_fwd == pytest.approx(inputs * (2 + 2 * 1))  # read bf16, write two fp8 layouts
    assert tensorwise.hbm_fwd - delayed.hbm_fwd == pytest.approx(inputs * 2)  # the amax read


def test_the_low_gemms_run_at_the_formats_measured_rate():
    h100 = load_profile("dgx-h100")
    dev = eff.device(h100, "bf16", "fp8-tensorwise")
    assert dev.low.peak_flops == 1979e12 and dev.low.mamf == 0.709 and dev.low_bytes == 1
    assert eff.device(load_profile("dgx-b200"), "bf16", "nvfp4").low.peak_flops == 9000e12
    # A large GEMM: the fp8 one takes bf16's time x (989 x 0.803) / (1979 x 0.709), launch overhead aside.
    m, n, k = 16384, 8192, 8192
    t16 = float(eff.gemm_time(m, n, k, dev)) - eff.KERNEL_OVERHEAD_S
    t8 = float(eff.gemm_time(m, n, k, dev.low, 1, dev.low_bytes)) - eff.KERNEL_OVERHEAD_S
    assert t8 / t16 == pytest.approx(989 * 0.803 / (1979 * 0.709), rel=1e-9)


H100_70B = dict(tp=4, pp=8, virtual_stages=5, micro_batch=1, global_batch=128, seq_len=8192, framework="megatron",
                zero=1, sequence_parallel=True)


def test_fp8_on_h100_is_faster_and_holds_the_weight_cache():
    cluster = api.load_cluster("dgx-h100", nodes=8)
    bf16 = api.estimate("llama-3-70b", cluster, precision="bf16", **H100_70B)
    fp8 = api.estimate("llama-3-70b", cluster, precision="fp8-tensorwise", fp8_param_gather=False, **H100_70B)
    assert 1.2 < fp8.tokens_per_s / bf16.tokens_per_s < 1.6  # the linear GEMMs at 2x peak, attention not
    # Weights per rank: bf16 weights plus both fp8 layouts of the linear weights (2 bytes each).
    gain = np.array([s.memory.weights for s in fp8.stages]) - np.array([s.memory.weights for s in bf16.stages])
    h, kv, ffn = 8192, 1024, 28672  # Llama-3-70B; rank 1 holds ten of the 80 layers, each split over tp 4
    low = 10 * (h * (h + 2 * kv) + h * h + 3 * h * ffn) / 4
    assert gain[1] == pytest.approx(2 * low, rel=1e-9)
    assert fp8.workload.precision_name == "fp8-tensorwise"
    # With FP8 parameter gather (the default, as Megatron-Bridge runs it) the FP8 weights are the
    # parameters: no bf16 copy of them, and the distributed optimizer all-gathers 1 byte of each.
    gathered = api.estimate("llama-3-70b", cluster, precision="fp8-tensorwise", **H100_70B)
    saved = np.array([s.memory.weights for s in fp8.stages]) - np.array([s.memory.weights for s in gathered.stages])
    assert saved[1] == pytest.approx(2 * low, rel=1e-9)
    assert gathered.time.dp_comm <= fp8.time.dp_comm


def test_fp8_param_gather_is_the_recipes_and_the_distributed_optimizers(tmp_path):
    cluster = api.load_cluster("dgx-h100", nodes=8)
    blockwise = [api.estimate("llama-3-70b", cluster, precision="fp8-blockwise", fp8_param_gather=g, **H100_70B)
                 for g in (True, False)]
    assert blockwise[0].memory.weights == blockwise[1].memory.weights  # Bridge's blockwise recipe has none
    no_zero = {**H100_70B, "zero": 0}
    plain = [api.estimate("llama-3-70b", cluster, precision="fp8-tensorwise", fp8_param_gather=g, **no_zero)
             for g in (True, False)]
    assert plain[0].memory.weights == plain[1].memory.weights  # needs the distributed optimizer
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                                  "megatron", "--zero", "1", "--precision", "fp8-tensorwise", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "--fp8-param-gather" in (out / "megatron_args.sh").read_text()
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                                  "megatron", "--zero", "1", "--precision", "fp8-tensorwise", "--no-fp8-param-gather",
                                  "--out", str(tmp_path / "off")])
    assert r.exit_code == 0, r.output
    assert "--fp8-param-gather" not in (tmp_path / "off" / "megatron_args.sh").read_text()


@pytest.mark.parametrize("hardware, precision, words", [
    ("dgx-a100-80g", "fp8-tensorwise", "needs FP8 tensor cores"),
    ("dgx-h100", "mxfp8", "needs Blackwell's block-scaled tensor cores"),
    ("dgx-h100", "nvfp4", "needs Blackwell's block-scaled tensor cores"),
])
def test_a_recipe_the_gpu_cannot_run_is_one_clear_error(hardware, precision, words):
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--hardware", hardware, "--framework",
                                  "megatron", "--precision", precision])
    assert r.exit_code == 2 and words in r.output and "--precision" in r.output and "Traceback" not in r.output


def test_recipes_need_megatron_and_blackwell_runs_them_all():
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                                  "deepspeed", "--precision", "fp8-delayed"])
    assert r.exit_code == 2 and "no Transformer Engine recipe" in r.output and "--framework megatron" in r.output
    cluster = api.load_cluster("dgx-b200", nodes=1)
    rates = [api.estimate("llama-3-8b", cluster, precision=p, framework="megatron", micro_batch=2, global_batch=128,
                          seq_len=8192).tokens_per_s for p in ("bf16", "fp8-tensorwise", "mxfp8", "nvfp4")]
    assert rates[0] < rates[1] and rates[0] < rates[2] < rates[3]


def test_suggest_with_a_recipe_offers_megatron_plans_only():
    out = api.suggest("llama-3-70b", api.load_cluster("dgx-h100", nodes=8), precision="fp8-tensorwise",
                      global_batch=128, seq_len=8192, top=5)
    assert out.plans and {rp.plan.cfg.framework for rp in out.plans} == {"megatron"}
    assert all(rp.plan.workload.recipe == "fp8-tensorwise" for rp in out.plans)


def test_generate_writes_the_recipe_as_megatron_flags(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-b200", "--nodes", "1",
                                  "--framework", "megatron", "--precision", "mxfp8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "plan.json").read_text())["precision"] == "mxfp8"
    text = (out / "megatron_args.sh").read_text()
    assert "--bf16" in text and "--fp8-format e4m3" in text and "--fp8-recipe mxfp8" in text
    lm, _ = megatron_flags(out)
    assert set(lm) <= MEGATRON_LM_FLAGS, set(lm) - MEGATRON_LM_FLAGS
    assert json.loads((out / "ds_config.json").read_text())["bf16"] == {"enabled": True}


def test_suggest_searches_a_list_of_precisions_and_ranks_them_together():
    cluster = api.load_cluster("dgx-h100", nodes=8)
    common = dict(global_batch=128, seq_len=8192, top=4)
    both = api.suggest("llama-3-70b", cluster, precision=("bf16", "fp8-tensorwise", "mxfp8"), **common)
    fp8 = api.suggest("llama-3-70b", cluster, precision="fp8-tensorwise", **common)
    bf16 = api.suggest("llama-3-70b", cluster, precision="bf16", **common)
    pooled = sorted([rp.plan.step_time_s for rp in fp8.plans + bf16.plans])[:4]
    assert [rp.plan.step_time_s for rp in both.plans] == pooled  # one ranking over both searches
    assert [rp.id for rp in both.plans] == [1, 2, 3, 4] and both.evaluated == fp8.evaluated + bf16.evaluated
    assert both.inputs["precision"] == "bf16,fp8-tensorwise,mxfp8"
    assert any("mxfp8" in str(n) and "left out" in str(n) for n in both.notes)  # H100 cannot run it
    r = CliRunner().invoke(main, ["suggest", "--model", "llama-3-70b", "--hardware", "dgx-h100", "--nodes", "8",
                                  "--global-batch", "128", "--seq-len", "8192", "--precision", "bf16,fp8-tensorwise",
                                  "--top", "2"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "megatron fp8-tensorwise" in r.output
    r = CliRunner().invoke(main, ["suggest", "--model", "llama-3-8b", "--precision", "mxfp8,nvfp4"])
    assert r.exit_code == 2 and "Blackwell" in r.output  # nothing of the list runs on an A100: the first reason


def test_fp8_gemms_without_a_measured_mamf_take_hoppers_fp8_to_bf16_ratio():
    """B200 has a measured bf16 MAMF (77.6%) and none for FP8: its FP8 GEMMs run at 77.6% x 0.90,
    the FP8 / bf16 MAMF ratio measured on H100 (70.9 / 80.3) and H200 (73.4 / 80.3); H100 keeps
    its own measured 70.9%, and bf16 is untouched."""
    from planner.cost import efficiency as eff
    from planner.cost.efficiency import FP8_MAMF_RATIO
    from planner.hardware.load import load_profile

    assert FP8_MAMF_RATIO == pytest.approx((70.9 / 80.3 + 73.4 / 80.3) / 2, abs=0.005)
    b200 = eff.device(load_profile("dgx-b200"), "bf16", "mxfp8")
    assert b200.mamf == pytest.approx(0.776) and b200.low.mamf == pytest.approx(0.776 * FP8_MAMF_RATIO)
    assert eff.device(load_profile("dgx-h100"), "bf16", "fp8-tensorwise").low.mamf == pytest.approx(0.709)
    assert eff.device(load_profile("gb300-nvl72"), "bf16", "nvfp4").low.mamf == pytest.approx(0.776)  # no ratio known
