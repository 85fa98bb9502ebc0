"""The router as each model's config states it (planner/model/hf_router.py), and Megatron-Core's
flags restating it, so a run from megatron_args.sh trains the published router."""

from __future__ import annotations

import pytest

from planner.emit.megatron_args import megatron_lm_args, megatron_notes
from planner.errors import UserError
from planner.model.catalog import load_model
from planner.model.hf_import import spec_from_hf_config
from planner.model.parts import MoEMLP, Router
from tests.test_emit_ds_config import make_plan


def _router(name: str) -> tuple[MoEMLP, Router]:
    moe = next(b.mlp for b in load_model(name).decoder_blocks if isinstance(b.mlp, MoEMLP))
    return moe, moe.router


def test_deepseek_v3_routes_by_sigmoid_in_groups_with_expert_bias():
    """DeepSeek-V3 config: scoring_func sigmoid, noaux_tc, n_group 8, topk_group 4,
    routed_scaling_factor 2.5; report sec. 2.1.2: a sequence-wise loss of 0.0001."""
    moe, r = _router("deepseek-v3")
    assert moe.gate_bias
    assert r == Router(score="sigmoid", renormalise=True, groups=8, group_topk=4, scaling=2.5,
                       balance="seq_aux_loss", aux_coeff=1e-4)


@pytest.mark.parametrize(("name", "want"), [
    ("deepseek-v2", Router(renormalise=False, groups=8, group_topk=3, scaling=16.0, balance="seq_aux_loss",
                           aux_coeff=1e-3)),
    ("deepseek-v2-lite", Router(renormalise=False, balance="seq_aux_loss", aux_coeff=1e-3)),  # greedy: no groups
    ("mixtral-8x7b", Router(aux_coeff=1e-3)),
    ("qwen3-30b-a3b", Router(aux_coeff=1e-3)),
    ("gpt-oss-120b", Router(aux_coeff=0.9)),
])
def test_other_routers(name: str, want: Router):
    assert _router(name)[1] == want


def _flags(name: str, **kw) -> list[str]:
    plan, model = make_plan(name, kw.pop("nodes", 1), framework="megatron", ep=8, grad_accum=4, **kw)
    out = []
    for a in megatron_lm_args(model, plan):
        out += [a.flag] + ([a.value] if a.value is not None else [])
    return out


def _after(flags: list[str], flag: str) -> str:
    return flags[flags.index(flag) + 1]


def test_deepseek_v3_flags_restate_its_router():
    f = _flags("deepseek-v3", nodes=64, pp=8, virtual_stages=1, recompute="full")
    assert _after(f, "--moe-router-score-function") == "sigmoid"
    assert (_after(f, "--moe-router-num-groups"), _after(f, "--moe-router-group-topk")) == ("8", "4")
    assert _after(f, "--moe-router-topk-scaling-factor") == "2.5"
    assert "--moe-router-enable-expert-bias" in f and "--moe-router-pre-softmax" not in f
    assert (_after(f, "--moe-router-load-balancing-type"), _after(f, "--moe-aux-loss-coeff")) == ("seq_aux_loss",
                                                                                                   "0.0001")


def test_softmax_before_top_k_where_the_probabilities_are_not_renormalised():
    assert "--moe-router-pre-softmax" in _flags("deepseek-v2-lite")
    f = _flags("mixtral-8x7b")
    assert "--moe-router-pre-softmax" not in f and "--moe-router-num-groups" not in f
    assert "--moe-router-enable-expert-bias" not in f


def test_qwen3_and_gpt_oss_attention_flags():
    assert "--qk-layernorm" in _flags("qwen3-30b-a3b")
    f = _flags("gpt-oss-120b", nodes=2)
    assert _after(f, "--softmax-type") == "learnable"
    assert (_after(f, "--window-size"), _after(f, "--window-attn-skip-freq")) == ("127,0", "2")
    assert "--qk-layernorm" not in _flags("mixtral-8x7b")


def test_gpt_oss_flags_restate_its_yarn_and_its_gated_quick_gelu():
    """gpt-oss config.json: rope_scaling yarn, factor 32 from 4096, beta_fast 32, beta_slow 1,
    truncate false; swiglu_limit 7 (GptOssExperts: gate * sigmoid(1.702 gate) on clamped halves)."""
    f = _flags("gpt-oss-120b", nodes=2)
    assert _after(f, "--position-embedding-type") == "yarn" and _after(f, "--rotary-base") == "150000"
    assert float(_after(f, "--rotary-scaling-factor")) == 32.0
    assert _after(f, "--yarn-original-max-position-embeddings") == "4096"
    assert (float(_after(f, "--yarn-beta-fast")), float(_after(f, "--yarn-beta-slow"))) == (32.0, 1.0)
    assert "--no-yarn-correction-range-round-to-int" in f
    assert "--quick-geglu" in f and "--swiglu" not in f
    assert (float(_after(f, "--glu-linear-offset")), float(_after(f, "--activation-func-clamp-value"))) == (1.0, 7.0)
    plan, model = make_plan("gpt-oss-120b", 2, framework="megatron", ep=8, grad_accum=4)
    assert megatron_notes(model, plan) == []  # nothing of it left unsaid
    assert _router("gpt-oss-120b")[0].glu_limit == 7.0 and _router("mixtral-8x7b")[0].glu_limit is None
    # Mixtral's plain SwiGLU and unscaled RoPE, DeepSeek-V3's MLA YaRN keep their flags
    mixtral = _flags("mixtral-8x7b")
    assert "--swiglu" in mixtral and _after(mixtral, "--position-embedding-type") == "rope"
    v3 = _flags("deepseek-v3", nodes=64, pp=8, virtual_stages=1, recompute="full")
    assert _after(v3, "--position-embedding-type") == "rope" and "--yarn-beta-fast" not in v3
    assert float(_after(v3, "--rotary-scaling-factor")) == 40.0


def _v3_like(**router) -> dict:
    return {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 16,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "vocab_size": 1000,
            "topk_method": "noaux_tc", **router}


@pytest.mark.parametrize(("router", "match"), [
    ({"scoring_func": "relu"}, "field .scoring_func. must be softmax or sigmoid"),
    ({"n_group": 2, "topk_group": 4}, r"field .topk_group. \(4\) exceeds n_group \(2\)"),
    ({"scoring_func": "sigmoid", "norm_topk_prob": False}, "norm_topk_prob"),
])
def test_a_router_megatron_cannot_restate_is_one_error(router: dict, match: str):
    with pytest.raises(UserError, match=match):
        spec_from_hf_config(_v3_like(**router), "tiny", "config.json")
    assert _router_of(_v3_like(scoring_func="sigmoid", n_group=4, topk_group=2)).groups == 4


def _router_of(config: dict) -> Router:
    spec = spec_from_hf_config(config, "tiny", "config.json")
    return next(b.mlp for b in spec.decoder_blocks if isinstance(b.mlp, MoEMLP)).router


@pytest.mark.parametrize(("args", "message"), [
    (["--tp", "2", "--sequence-parallel"], "experts have biases, which Megatron-Core runs only without expert tensor"),
    (["--cp", "2", "--cp-comm", "p2p"], "sliding-window attention runs under context parallelism only with the "
                                        "all-to-all"),
])
def test_what_megatron_refuses_for_gpt_oss_is_one_message(args: list[str], message: str):
    from click.testing import CliRunner

    from planner.cli import main

    base = ["estimate", "--model", "gpt-oss-120b", "--hardware", "dgx-h100", "--nodes", "8", "--framework", "megatron",
            "--ep", "8", "--global-batch", "256", "--seq-len", "4096"]
    r = CliRunner().invoke(main, base + args)
    assert r.exit_code == 2 and message in r.output, r.output
    ok = CliRunner().invoke(main, base + ["--cp", "2", "--cp-comm", "a2a"])
    assert "Traceback" not in ok.output and "sliding-window" not in ok.output and "cp 2 (a2a)" in ok.output
    out = api_suggest_tp("gpt-oss-120b")  # TP only with the experts folded out of it (expert TP 1)
    assert out and all(p.plan.cfg.etp == 1 for p in out)


def api_suggest_tp(name: str):
    """The search never offers what the rule refuses."""
    from planner import api

    return api.suggest(name, api.load_cluster("dgx-h100", 8), global_batch=256, seq_len=4096, framework="megatron",
                       top=5).plans


def test_the_reference_trainer_runs_gpt_oss_clamped_glu():
    """transformers' GptOssExperts: gate clamped above at 7, up clamped to [-7, 7],
    out = down((up + 1) * gate * sigmoid(1.702 gate)); the scaled model keeps the limit."""
    import torch

    from planner.run.model_layers import FeedForward
    from planner.run.model_scale import TINY, scale_spec

    torch.manual_seed(0)
    ff = FeedForward(8, 16, "swiglu", bias=True, limit=7.0)
    x = torch.randn(64, 8) * 8
    gate, up = ff.gate_proj(x), ff.up_proj(x)
    assert (gate > 7).any() and (up < -7).any() and (up > 7).any()  # both clamps bite
    g = torch.minimum(gate, torch.tensor(7.0))
    want = ff.down_proj((torch.clamp(up, -7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g))
    torch.testing.assert_close(ff(x), want, rtol=1e-5, atol=1e-5)
    swiglu = FeedForward(8, 16, "swiglu", bias=True)
    swiglu.load_state_dict(ff.state_dict())
    assert not torch.allclose(swiglu(x), ff(x))
    scaled = scale_spec(load_model("gpt-oss-120b"), TINY).spec
    assert {b.mlp.glu_limit for b in scaled.decoder_blocks} == {7.0}


def test_qwen2_moe_gates_its_shared_expert_in_megatron_and_the_trainer():
    """Qwen2MoeSparseMoeBlock: shared_expert(x) * sigmoid(shared_expert_gate(x)), a 1-wide gate."""
    import torch

    from planner.run.model_layers import MoEFeedForward

    spec = spec_from_hf_config({"model_type": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64,
                                "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
                                "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 96,
                                "vocab_size": 512, "max_position_embeddings": 4096}, "tiny", "config.json")
    mlp = spec.decoder_blocks[0].mlp
    assert mlp.shared_gate and mlp.gate_params(64) == 64 * 4 + 64
    plan, _ = make_plan("mixtral-8x7b", 1, framework="megatron", ep=4, grad_accum=4)
    flags = [a.flag for a in megatron_lm_args(spec, plan)]
    assert "--moe-shared-expert-gate" in flags
    assert "--moe-shared-expert-gate" not in _flags("deepseek-v2-lite")  # DeepSeek's shared experts are ungated
    layer = MoEFeedForward(64, mlp, 1)
    assert layer.shared_expert_gate is not None and layer.shared_expert_gate.weight.shape == (1, 64)
    x = torch.randn(2, 3, 64)
    routed, _, _ = layer.experts(x)
    want = routed + torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_experts(x)
    torch.testing.assert_close(layer(x)[0], want)
