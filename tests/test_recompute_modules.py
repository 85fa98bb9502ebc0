"""``--recompute-modules``: what Megatron-Core's selective recompute runs again (transformer_config.py
recompute_modules), priced per block (LayerCost.rerun), carried into plans and megatron_args.sh,
and refused where the model or the runtime has no such module."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost import efficiency as eff
from planner.cost.block_times import block_tables
from planner.cost.layers import layer_costs
from planner.cost.layout import layout
from planner.cost.parallel import RECOMPUTES, Workload
from planner.errors import UserError
from planner.model.catalog import load_model

S = 4096


def _layer(model: str, modules: tuple[str, ...], kind: str = "moe", tp: int = 1, sp: bool = False, ep: int = 1,
           recipe: str | None = None):
    w = Workload(global_batch=8, seq_len=S, recompute_modules=modules, precision=recipe or "bf16")
    spec = load_model(model)
    costs = layer_costs(spec, w, tp=tp, sp=sp, ep=ep)
    return next(c for c, b in zip(costs, spec.blocks) if b.kind == "decoder" and b.mlp.kind == kind)


def _freed(model: str, module: str, **kw) -> float:
    """Bytes per sample the module's recompute frees beside Megatron's default (the attention core)."""
    base = _layer(model, ("core_attn",), **kw).act["selective"]
    return base - _layer(model, ("core_attn", module), **kw).act["selective"]


def test_mla_up_proj_frees_the_query_key_and_value_of_deepseek_v3():
    """128 heads x (2 x 192 + 128) bf16 per token: Q and K (nope + rope) and V, 131,072 bytes,
    nine times DeepSeek-V3's 7,168-wide hidden state; halved per rank under TP 2."""
    assert _freed("deepseek-v3", "mla_up_proj") == S * 128 * (2 * 192 + 128) * 2
    assert _freed("deepseek-v3", "mla_up_proj", tp=2, sp=True) == S * 128 * (2 * 192 + 128) * 2 / 2


def test_layernorm_frees_both_norm_outputs_and_under_mxfp8_the_quantized_copies():
    h = load_model("deepseek-v3").hidden
    assert _freed("deepseek-v3", "layernorm") == S * 2 * 2 * h  # the QKV and MLP inputs, bf16
    assert _freed("deepseek-v3", "layernorm", tp=4, sp=True) == S * 2 * 2 * h / 4  # split by SP
    mx = _freed("deepseek-v3", "layernorm", recipe="mxfp8")
    assert S * 2 * 1 * h < mx < S * 2 * 1.1 * h  # one byte per element plus an E8M0 scale per 32


def test_moe_act_frees_the_experts_fc2_input_of_every_routed_copy():
    """Qwen3-30B-A3B: top-8 of 128 experts 768 wide; a rank receives s x 8 copies (balanced), whatever
    its EP degree, and keeps the activation's output for each (768 x 2 bytes)."""
    for ep in (1, 8):
        assert _freed("qwen3-30b-a3b", "moe_act", ep=ep) == S * 8 * 768 * 2


def test_moe_frees_the_whole_layers_inner_tensors_and_dispatches_again():
    """Megatron-Core's "moe" module checkpoints the MoE layer: it keeps none of what the layer kept
    (the router's fp32 logits and probabilities, the routed copies before and after the experts,
    the experts' fc1 outputs and fc2 inputs), its input aside, and runs the layer's forward again:
    its GEMMs, and a third pass of its dispatch and combine. It contains moe_act and
    shared_experts, which add nothing beside it. Megatron-Core refuses the all-to-all overlap
    with it, so the workload turns the overlap off."""
    full = _layer("deepseek-v2-lite", ("core_attn",), ep=4)
    moe = _layer("deepseek-v2-lite", ("core_attn", "moe"), ep=4)
    everything = _layer("deepseek-v2-lite", ("core_attn", "moe", "moe_act", "shared_experts"), ep=4)
    router = 2 * 4.0 * 64  # 64 experts
    kept_copies = 6 * 2 * 2048 * 2  # top-6 copies of the 2,048-wide hidden state, in and out
    fc = 6 * (2 * 1408 + 1408) * 2 + 3 * 2816 * 2  # routed experts' fc1 out + fc2 in, shared experts'
    assert full.act["selective"] - moe.act["selective"] == pytest.approx(S * (router + kept_copies + fc), rel=1e-9)
    assert everything.act["selective"] == moe.act["selective"] and everything.rerun == moe.rerun
    assert moe.rerun.a2a == 1 and full.rerun.a2a == 0
    # the router, the two shared-expert GEMMs and the routed experts' two grouped GEMMs: the layer's last five
    assert len(moe.rerun.gemms) == 5 and moe.rerun.gemms == moe.gemms[-5:]
    w = api.make_workload("deepseek-v2-lite", recompute_modules="moe")
    assert w.ep_comm_overlap is False
    cluster = api.load_cluster("dgx-h100", nodes=1)
    costs = layer_costs(load_model("deepseek-v2-lite"), w, ep=8)
    shapes = layout(cluster, 1, 8, 8, 1)
    table = block_tables([(costs, shapes.tp, shapes.ep)], (1,), eff.device(cluster.profile), cluster)[0]
    sel, none = (table.ep[RECOMPUTES.index(m), 0] for m in ("selective", "none"))
    moe_blocks = np.array([c.rerun.a2a > 0 for c in costs])
    assert moe_blocks.sum() == 26 and (none[moe_blocks] > 0).all()
    assert np.allclose(sel[moe_blocks], 1.5 * none[moe_blocks]) and np.allclose(sel[~moe_blocks], none[~moe_blocks])


def test_mlp_and_shared_experts_free_their_inner_tensors():
    """DeepSeek-V2-Lite: a dense first layer (10,944 wide, SwiGLU: fc1 output 2w and fc2 input w kept)
    and two shared experts (2 x 1,408) in each MoE layer."""
    assert _freed("deepseek-v2-lite", "mlp", kind="dense") == S * 3 * 10944 * 2
    assert _freed("deepseek-v2-lite", "shared_experts") == S * 3 * 2816 * 2
    assert _freed("deepseek-v2-lite", "mlp") == 0  # the MoE layers have no dense MLP


def _rc(model: str, modules: tuple[str, ...], tp: int = 1, sp: bool = False) -> tuple[np.ndarray, np.ndarray, list]:
    """Selective recompute seconds and TP seconds per block at micro-batch 1 on one H100 node."""
    cluster = api.load_cluster("dgx-h100", nodes=1)
    w = Workload(global_batch=8, seq_len=S, recompute_modules=modules)
    costs = layer_costs(load_model(model), w, tp=tp, sp=sp)
    dev = eff.device(cluster.profile)
    shapes = layout(cluster, tp, 1, 8 // tp, 1)
    table = block_tables([(costs, shapes.tp, shapes.ep)], (1,), dev, cluster)[0]
    mode = RECOMPUTES.index("selective")
    return table.rc[mode, 0], table.tp[mode, 0] - table.tp[RECOMPUTES.index("none"), 0], costs


def test_selective_runs_again_exactly_what_its_modules_name():
    dev = eff.device(api.load_cluster("dgx-h100", nodes=1).profile)
    attn, _, costs = _rc("deepseek-v3", ("core_attn",))
    up, _, _ = _rc("deepseek-v3", ("mla_up_proj",))
    both, _, _ = _rc("deepseek-v3", ("core_attn", "mla_up_proj"))
    j = next(i for i, c in enumerate(costs) if c.kind == "decoder")
    c = _layer("deepseek-v3", ("mla_up_proj",), kind="dense")
    gemms = sum(float(eff.gemm_time(g.tokens, g.n, g.k, dev, g.batch)) for g in c.rerun.gemms)
    assert len(c.rerun.gemms) == 2  # the query and key-value up-projections
    assert up[j] == pytest.approx(gemms + float(eff.hbm_time(c.rerun.traffic, dev)), rel=1e-9)
    assert attn[j] > 0 and both[j] == pytest.approx(attn[j] + up[j], rel=1e-9)
    assert (up[: j] == 0).all()  # the embedding recomputes nothing


def test_a_checkpointed_dense_mlp_gathers_and_reduces_again_under_tp():
    """"mlp" checkpoints the module, its sequence-parallel all-gather and reduce-scatter included;
    the output-discarding modules run no collective again."""
    _, tp_mlp, costs = _rc("llama-3-8b", ("core_attn", "mlp"), tp=2, sp=True)
    _, tp_attn, _ = _rc("llama-3-8b", ("core_attn", "layernorm"), tp=2, sp=True)
    j = next(i for i, c in enumerate(costs) if c.kind == "decoder")
    assert tp_attn[j] == 0 and tp_mlp[j] > 0
    assert [op for op, _ in costs[j].rerun.tp] == ["allgather", "reducescatter"]


def test_nvidias_deepseek_v3_module_fits_where_the_attention_core_does_not():
    """GB200 DeepSeek-V3 bf16 as NVIDIA's Megatron-Bridge 25.11 row runs it (PP 4 x VP 4, EP 64):
    selective recompute of the attention core frees nothing under FlashAttention; mla_up_proj,
    moe_act and layernorm together take the busiest stage under the 186 GiB."""
    cluster = api.load_cluster("gb200-nvl72", nodes=64)
    pins = dict(tp=1, pp=4, virtual_stages=4, ep=64, etp=1, micro_batch=1, zero=1, framework="megatron",
                recompute="selective", global_batch=4096, seq_len=S, mtp_layers=0)
    default = api.estimate("deepseek-v3", cluster, **pins, recompute_modules="core_attn")
    nvidia = api.estimate("deepseek-v3", cluster, **pins, recompute_modules="mla_up_proj,moe_act,layernorm")
    assert not default.fits and nvidia.fits
    none = api.estimate("deepseek-v3", cluster, **{**pins, "recompute": "none"})
    assert nvidia.tokens_per_s < none.tokens_per_s  # the norms, the activations and the up-projections again
    assert nvidia.to_json()["recompute_modules"] == ["layernorm", "mla_up_proj", "moe_act"]


@pytest.mark.parametrize(("model", "knobs", "modules"), [
    ("deepseek-v3", {}, ("layernorm", "mla_up_proj", "moe_act")),
    ("llama-3-8b", {}, ("layernorm",)),
    ("deepseek-v3", {"flash_attention": False}, ("core_attn",)),  # the s^2 scores: Korthikanti's selective
    ("deepseek-v3", {"precision": "fp8-delayed"}, ("mla_up_proj",)),  # Megatron refuses the other two there
    ("qwen3-30b-a3b", {"precision": "fp8-delayed"}, ("core_attn",)),
])
def test_left_out_the_modules_are_what_frees_memory_under_the_attention_kernel(model, knobs, modules):
    """Under FlashAttention the attention core's recompute frees nothing, so "auto" takes the
    model's output-discarding modules instead; unfused, Megatron's default core_attn."""
    assert api.make_workload(model, **knobs).recompute_modules == modules
    assert api.make_workload(model, recompute_modules="auto", **knobs).recompute_modules == modules


def test_auto_modules_fit_nvidias_gb300_405b_layout_that_recompute_none_does_not():
    """Megatron-Bridge 25.11 GB300 Llama 3.1 405B FP8-CS (TP 2, PP 8 x VP 4, CP 2, micro-batch 1):
    without recomputation its busiest stage needs 294.6 of 288 GiB; recomputing the two norms
    (auto: layernorm) frees 9.7 GiB of it for 0.6% of the step, where full recomputation costs 24%."""
    cluster = api.load_cluster("gb300-nvl72", nodes=64)
    pins = dict(tp=2, pp=8, virtual_stages=4, cp=2, micro_batch=1, zero=1, framework="megatron",
                sequence_parallel=True, global_batch=1536, seq_len=8192, precision="fp8-tensorwise")
    none, sel, full = (api.estimate("llama-3.1-405b", cluster, **pins, recompute=r)
                       for r in ("none", "selective", "full"))
    assert not none.fits and sel.fits and full.fits
    assert sel.tokens_per_s > 0.99 * none.tokens_per_s and sel.tokens_per_s > 1.25 * full.tokens_per_s


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(("args", "says"), [
    (["--model", "llama-3-8b", "--recompute-modules", "mla_up_proj"], "llama-3-8b has nothing for mla_up_proj"),
    (["--model", "llama-3-8b", "--recompute-modules", "moe_act,core_attn"], "nothing for moe_act"),
    (["--model", "qwen3-30b-a3b", "--recompute-modules", "shared_experts"], "nothing for shared_experts"),
    (["--model", "llama-3-8b", "--recompute-modules", "attention"], "unknown module 'attention'"),
    (["--model", "llama-3-8b", "--recompute-modules", "moe"], "nothing for moe to recompute"),
    (["--model", "llama-3-8b", "--recompute-modules", " , "], "no module given"),
    (["--model", "qwen3-30b-a3b", "--hardware", "dgx-h100", "--precision", "fp8-delayed",
      "--recompute-modules", "moe_act"], "current or block scaling only"),
    (["--model", "llama-3-8b", "--framework", "megatron-deepspeed", "--recompute", "selective",
      "--recompute-modules", "layernorm"], "megatron-deepspeed's selective recompute is the attention core only"),
])
def test_a_module_the_model_or_runtime_lacks_is_one_error(args, says):
    r = _run("estimate", *args)
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
    assert "--recompute-modules" in r.output


def test_megatron_deepspeeds_selective_recompute_is_its_attention_core():
    args = ["estimate", "--model", "llama-3-8b", "--framework", "megatron-deepspeed", "--recompute", "selective"]
    flash = _run(*args)  # auto: layernorm, which that fork cannot recompute
    assert flash.exit_code == 2 and "frees nothing under FlashAttention" in flash.output, flash.output
    unfused = _run(*args, "--no-flash-attention", "--seq-len", "2048", "--micro-batch", "1")
    assert unfused.exit_code == 0, unfused.output


def test_the_api_refuses_them_the_same_way():
    with pytest.raises(UserError, match="nothing for mla_up_proj"):
        api.make_workload("llama-3-8b", recompute_modules=("mla_up_proj",))
    w = api.make_workload("deepseek-v3", recompute_modules="moe_act, mla_up_proj")
    assert w.recompute_modules == ("mla_up_proj", "moe_act")  # Megatron's order, whatever the user's


def test_suggest_and_generate_carry_the_modules_into_the_run_directory(tmp_path):
    out = tmp_path / "run"
    r = _run("generate", "--model", "deepseek-v2-lite", "--hardware", "dgx-h100", "--nodes", "1", "--framework",
             "megatron", "--recompute", "selective", "--recompute-modules", "moe_act,layernorm", "--out", str(out))
    assert r.exit_code == 0, r.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["recompute"] == "selective" and plan["recompute_modules"] == ["layernorm", "moe_act"]
    assert "--recompute-modules layernorm moe_act" in (out / "megatron_args.sh").read_text()
    again = _run("generate", "--plan", str(out / "plan.json"), "--out", str(tmp_path / "again"))
    assert again.exit_code == 0, again.output
    assert "--recompute-modules layernorm moe_act" in (tmp_path / "again" / "megatron_args.sh").read_text()


def test_the_output_names_the_modules_selective_recomputes():
    """A plan's "selective" is whichever modules the workload names: estimate's header and
    suggest's legend say which, and suggest --json records them with its inputs."""
    est = _run("estimate", "--model", "deepseek-v3", "--nodes", "64", "--hardware", "dgx-h100", "--tp", "2",
               "--pp", "8", "--ep", "32", "--recompute", "selective", "--framework", "megatron",
               "--sequence-parallel")
    assert est.exit_code in (0, 3) and "recompute selective (layernorm, mla_up_proj, moe_act)" in est.output
    args = ("suggest", "--model", "vl2", "--nodes", "8", "--recompute", "selective", "--top", "2")
    out = " ".join(_run(*args).output.split())  # the legend as one line, however the terminal wrapped it
    assert "recompute selective = Megatron's selective recompute of layernorm, mla_up_proj, moe_act" in out
    data = json.loads(_run(*args, "--recompute-modules", "core_attn", "--json").output)
    assert data["inputs"]["recompute_modules"] == ["core_attn"]
