"""Hugging Face config.json import: every supported model_type, DeepSeek's own defaults, bad files.

Expected totals are published parameter counts (model cards / papers) or are recomputed here
with the formulas written out by hand, never copied from the importer's output.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest

from planner.errors import UserError
from planner.model.catalog import load_model
from planner.model.hf_import import HFImportWarning, spec_from_hf_config
from planner.model.hf_keys import read_config_file
from planner.model.spec import MoEMLP

DATA = Path(__file__).parent / "data" / "hf_configs"


def config(name: str) -> dict:
    return read_config_file(DATA / name)


def load(name: str):
    return spec_from_hf_config(config(name), name=name, source=str(DATA / name))


@pytest.mark.parametrize(
    "fixture, published",
    [
        ("gpt2.json", 124_439_808),  # GPT-2 small, the HF model card's count
        ("gpt_neox.json", 162_322_944),  # Pythia-160M (EleutherAI's table: 162,322,944)
        ("bloom.json", 559_214_592),  # BLOOM-560M model card
        ("mistral.json", 7_241_732_096),  # Mistral-7B-v0.1
        ("qwen2.json", 494_032_768),  # Qwen2.5-0.5B (0.49B; tied head)
        ("llama.json", 8_030_261_248),  # Llama-3-8B (8.03B)
        ("mixtral.json", 46_702_792_704),  # Mixtral-8x7B (46.7B)
    ],
)
def test_published_totals(fixture, published):
    assert load(fixture).total_params() == published


def test_deepseek_vl2_as_published_reproduces_the_preset_exactly():
    """The real config omits layers, heads, MLA ranks and use_mla: DeepSeek's defaults fill them."""
    spec = load_model(str(DATA / "deepseek_vl2" / "config.json"))
    preset = load_model("deepseek-vl2")
    assert spec.blocks == preset.blocks
    assert spec.vision == preset.vision
    assert spec.total_params() == preset.total_params() == 27_480_134_248
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "use_mla"):
        assert f"language_config.{key}" in spec.defaulted
    assert "language_config.q_lora_rank" not in spec.defaulted  # explicitly null: no q compression
    assert "language_config.vocab_size" not in spec.defaulted


def test_deepseek_vl2_small_missing_vocab_takes_deepseeks_default_not_transformers():
    raw = config("deepseek_vl2/config.json")
    lc = raw["language_config"]
    del lc["vocab_size"]
    lc.update(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
              num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, topk_method="greedy",
              scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0)
    raw["projector_config"]["n_embed"] = 2048
    spec = spec_from_hf_config(raw, "small", "small.json")
    assert spec.vocab == 102400  # DeepseekV2Config (bundled), not transformers' 32000
    assert "language_config.vocab_size" in spec.defaulted
    assert spec.blocks == load_model("deepseek-vl2-small").blocks


def test_deepseek_vl2_tiny_mha():
    spec = load("deepseek_vl2_tiny.json")
    attn = spec.decoder_blocks[0].attention
    assert (attn.kind, attn.head_dim, attn.mla) == ("mha", 128, None)
    assert spec.blocks == load_model("vl2-tiny").blocks
    moe = spec.decoder_blocks[1].mlp
    assert isinstance(moe, MoEMLP) and not moe.gate_bias  # greedy routing: no noaux_tc bias


def test_deepseek_moe_layer_rule_and_defaults():
    raw = config("deepseek_v2_lite.json")
    raw.update(num_hidden_layers=8, first_k_dense_replace=2, moe_layer_freq=2)
    spec = spec_from_hf_config(raw, "x", "x.json")
    # MoE iff layer >= first_k_dense_replace and layer % moe_layer_freq == 0
    assert [d.is_moe for d in spec.decoder_blocks] == [False, False, True, False, True, False, True, False]
    assert spec.decoder_blocks[0].mlp.ffn == 10944
    del raw["n_routed_experts"]  # null experts: a dense model
    assert not spec_from_hf_config(raw, "x", "x.json").is_moe
    raw = config("deepseek_v2_lite.json")
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim"):
        del raw[key]
    mla = spec_from_hf_config(raw, "x", "x.json").decoder_blocks[0].attention.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim) == (1536, 512, 64)
    raw["q_lora_rank"] = 0  # some ports write 0 for "no q compression"
    assert spec_from_hf_config(raw, "x", "x.json").decoder_blocks[0].attention.mla.q_lora_rank is None


def test_deepseek_v3_imports_its_mtp_depth_and_matches_the_preset():
    spec = load("deepseek_v3.json")
    assert spec.mtp_layers == 1 and spec.blocks[-1].kind == "mtp"
    assert spec.blocks == load_model("deepseek-v3").blocks
    assert spec.decoder_blocks[5].mlp.gate_bias
    assert load("deepseek_v2_lite.json").blocks == load_model("deepseek-v2-lite").blocks


def test_qwen2_moe_shared_expert():
    spec = load("qwen2_moe.json")
    h, v, layers = 2048, 151936, 24
    attn = h * 3 * h + 3 * h + h * h  # q/k/v with biases, o_proj without
    moe = h * 60 + 60 * 3 * h * 1408 + 3 * h * 5632 + h  # router, experts, one shared expert and its gate
    expected = 2 * v * h + layers * (attn + moe + 2 * h) + h
    assert spec.total_params() == expected
    assert abs(expected - 14.3e9) / 14.3e9 < 0.01  # Qwen1.5-MoE-A2.7B: 14.3B
    mlp = spec.decoder_blocks[0].mlp
    assert (mlp.routed_experts, mlp.top_k, mlp.shared_experts, mlp.shared_ffn) == (60, 4, 1, 5632)
    assert mlp.shared_gate
    raw = config("qwen2_moe.json")
    raw.update(decoder_sparse_step=2, mlp_only_layers=[1])
    pattern = [d.is_moe for d in spec_from_hf_config(raw, "x", "x.json").decoder_blocks[:4]]
    assert pattern == [False, False, False, True]


def test_qwen2_vl_vision_defaults_are_flagged():
    spec = load("qwen2_vl.json")
    assert spec.blocks == load_model("qwen2-vl-7b").blocks
    assert "vision_config.depth" in spec.defaulted and "vision_config.embed_dim" in spec.defaulted
    assert spec.blocks[0].temporal_patch == 2 and spec.blocks[0].patch_pixels == 3 * 2 * 14 * 14
    # newer layout: the language keys under text_config
    raw = config("qwen2_vl.json")
    text = {k: raw.pop(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                                    "num_key_value_heads", "vocab_size", "max_position_embeddings")}
    raw["text_config"] = text
    assert spec_from_hf_config(raw, "x", "x.json").blocks == spec.blocks


def test_gpt2_bloom_neox_family_facts():
    gpt2 = load("gpt2.json")
    emb, block = gpt2.blocks[0], gpt2.decoder_blocks[0]
    assert emb.learned_positions == 1024 and gpt2.blocks[-1].tied
    assert block.norm == "layernorm" and block.mlp.act == "gelu_tanh" and block.mlp.bias and block.attention.out_bias
    assert block.mlp.ffn == 4 * 768 and "n_inner" in gpt2.defaulted
    bloom = load("bloom.json")  # early keys: n_embed, num_attention_heads
    assert bloom.hidden == 1024 and bloom.attention_heads == 16
    assert bloom.blocks[0].norm == "layernorm" and bloom.blocks[0].learned_positions == 0
    assert bloom.max_seq_len == 2048 and "max_position_embeddings" in bloom.defaulted
    neox = load("gpt_neox.json")
    assert not neox.blocks[-1].tied and neox.blocks[0].learned_positions == 0


def test_unknown_model_type_imports_with_a_warning():
    with pytest.warns(HFImportWarning, match="fancy_llm"):
        spec = load("unknown_type.json")
    assert spec.family == "fancy_llm"
    h = 2048
    layer = h * (h + 2 * 512) + h * h + 3 * h * 5632 + 2 * h  # GQA 16/4 heads of 128, SwiGLU, RMSNorm
    assert spec.total_params() == 2 * 32000 * h + 22 * layer + h
    raw = config("unknown_type.json")
    del raw["tie_word_embeddings"]
    with pytest.warns(HFImportWarning):
        tied = spec_from_hf_config(raw, "x", "x.json")
    assert tied.blocks[-1].tied and "tie_word_embeddings" in tied.defaulted  # PretrainedConfig's default


def test_known_types_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("gpt2.json", "bloom.json", "mixtral.json", "qwen2_vl.json", "deepseek_vl2_tiny.json"):
            load(name)


def _mutated(name: str, **changes) -> dict:
    raw = copy.deepcopy(config(name))
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


_DELETE = object()


@pytest.mark.parametrize(
    "fixture, changes, words",
    [
        ("llama.json", {"hidden_size": "4096"}, ["hidden_size", "integer", "'4096'"]),
        ("llama.json", {"num_hidden_layers": 0}, ["num_hidden_layers", "positive", "0"]),
        # a typo that would build a billion blocks is refused at once
        ("llama.json", {"num_hidden_layers": 1e9}, ["num_hidden_layers", "at most 4,096", "1,000,000,000"]),
        ("deepseek_v3.json", {"num_hidden_layers": 100_000}, ["num_hidden_layers", "at most 4,096"]),
        ("llama.json", {"intermediate_size": -5}, ["intermediate_size", "positive"]),
        ("llama.json", {"num_attention_heads": 30}, ["num_attention_heads", "(30)", "4096"]),
        ("llama.json", {"num_key_value_heads": 5}, ["num_key_value_heads", "(5)"]),
        ("llama.json", {"tie_word_embeddings": "no"}, ["tie_word_embeddings", "true or false"]),
        ("llama.json", {"hidden_size": 4096.5}, ["hidden_size", "4096.5"]),
        ("llama.json", {"hidden_act": "swoosh"}, ["hidden_act", "swoosh"]),
        ("llama.json", {"hidden_size": _DELETE, "num_attention_heads": _DELETE},
         ["missing", "hidden_size", "num_attention_heads"]),
        ("unknown_type.json", {"num_hidden_layers": _DELETE}, ["missing", "num_hidden_layers / n_layer"]),
        ("mixtral.json", {"num_experts_per_tok": 9}, ["num_experts_per_tok", "(9)", "(8)"]),
        ("qwen2_moe.json", {"num_experts_per_tok": 61}, ["num_experts_per_tok", "(61)"]),
        ("gpt2.json", {"n_head": 7}, ["n_head", "(7)", "768"]),
        ("deepseek_v3.json", {"num_experts_per_tok": 300}, ["num_experts_per_tok", "300"]),
        ("deepseek_v3.json", {"moe_intermediate_size": None}, ["moe_intermediate_size"]),
        ("qwen2_vl.json", {"vision_config": {"num_heads": 7}}, ["vision_config.num_heads", "1280"]),
        ("qwen2_vl.json", {"vision_config": [1, 2]}, ["vision_config", "JSON object"]),
        ("deepseek_vl2/config.json", {"projector_config": {"n_embed": 2048}}, ["projector_config.n_embed", "2560"]),
        ("deepseek_vl2/config.json", {"candidate_resolutions": [[384]]}, ["candidate_resolutions"]),
    ],
)
def test_bad_values_name_the_file_and_field(fixture, changes, words):
    raw = _mutated(fixture, **changes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HFImportWarning)
        with pytest.raises(UserError) as err:
            spec_from_hf_config(raw, "x", f"/tmp/{fixture}")
    msg = str(err.value)
    assert msg.startswith(f"/tmp/{fixture}")
    for word in words:
        assert word in msg, msg


def test_deepseek_vl2_language_errors_are_prefixed_with_their_section():
    raw = config("deepseek_vl2/config.json")
    raw["language_config"]["hidden_size"] = 0
    with pytest.raises(UserError, match=r"language_config\.hidden_size"):
        spec_from_hf_config(raw, "x", "vl2.json")


def test_malformed_and_non_object_files(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",, }')
    with pytest.raises(UserError, match=r"config\.json: malformed JSON at line 1 column"):
        load_model(str(bad))
    bad.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(UserError, match="expected a JSON object"):
        load_model(str(bad))


# Qwen/Qwen3-8B config.json (transformers 4.51.0), the keys the importer reads.
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-06,
            "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36}


def test_qwen3_dense_has_qk_norm_and_the_published_total():
    spec = spec_from_hf_config(QWEN3_8B, "qwen3-8b", "qwen3-8b.json")
    attn = spec.decoder_blocks[0].attention
    assert attn.qk_norm and not attn.qkv_bias and not attn.out_bias and attn.window is None
    h, v, hd = 4096, 151936, 128
    layer = h * (32 + 2 * 8) * hd + 32 * hd * h + 2 * hd + 3 * h * 12288 + 2 * h  # QK-norm: 2 x head_dim
    assert spec.total_params() == 2 * v * h + 36 * layer + h == 8_190_735_360  # model card: 8.2B
    assert spec.total_params() - 2 * v * h == 6_946_075_648  # model card: 6.95B non-embedding
    assert spec.defaulted == ["train_seq_len"] and spec.positions.rope_theta == 1e6  # 40960 capped at 8192


def test_qwen3_moe_and_gpt_oss_import_as_their_presets():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b"):
        doc = json.loads((Path(__file__).parents[1] / "planner/model/presets" / f"{name}.json").read_text())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # known model types: no guess, no warning
            spec = spec_from_hf_config(doc["config"], name, f"{name}.json")
        assert spec.blocks == load_model(name).blocks
    moe = load_model("qwen3-30b-a3b").decoder_blocks[0].mlp
    assert (moe.shared_experts, moe.shared_ffn, moe.router_bias, moe.expert_bias) == (0, 0, False, False)
    oss = load_model("gpt-oss-120b").decoder_blocks
    assert [d.attention.window for d in oss[:4]] == [128, None, 128, None]
    assert all(d.attention.sinks and d.attention.qkv_bias and d.attention.out_bias for d in oss)
    assert all(d.mlp.router_bias and d.mlp.expert_bias and not d.mlp.gate_bias for d in oss)


def test_qwen3_moe_without_the_shared_expert_key_defaults_nothing():
    """Qwen3-MoE has no shared expert (its config class has no such key): nothing is guessed."""
    raw = json.loads((Path(__file__).parents[1] / "planner/model/presets/qwen3-30b-a3b.json").read_text())["config"]
    assert "shared_expert_intermediate_size" not in raw
    assert spec_from_hf_config(raw, "x", "x.json").defaulted == ["train_seq_len"]  # 40960 capped at 8192


def test_gpt_oss_without_layer_types_slides_on_even_layers():
    raw = json.loads((Path(__file__).parents[1] / "planner/model/presets/gpt-oss-120b.json").read_text())["config"]
    raw = {k: v for k, v in raw.items() if k not in ("layer_types", "sliding_window", "attention_bias", "swiglu_limit")}
    spec = spec_from_hf_config(raw, "x", "x.json")
    assert spec.blocks == load_model("gpt-oss-120b").blocks  # GptOssConfig's defaults
    assert {"layer_types", "sliding_window", "swiglu_limit"} <= set(spec.defaulted)


def test_layer_types_windows_any_family():
    raw = dict(QWEN3_8B, num_hidden_layers=4, sliding_window=4096,
               layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    spec = spec_from_hf_config(raw, "x", "x.json")
    assert [d.attention.window for d in spec.decoder_blocks] == [None, 4096, 4096, None]
    assert spec.decoder_blocks[1] is spec.decoder_blocks[2]  # one object per distinct block
    full = spec_from_hf_config(dict(raw, layer_types=["full_attention"] * 4), "x", "x.json")
    assert all(d.attention.window is None for d in full.decoder_blocks)
    assert spec_from_hf_config(dict(QWEN3_8B, sliding_window=4096), "x", "x.json").decoder_blocks[0].attention \
        .window is None  # sliding_window alone is not read (Qwen's use_sliding_window is off)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"layer_types": ["full_attention"] * 3}, ["layer_types", "3 entries for 36 layers"]),
        ({"layer_types": ["linear_attention"] * 36}, ["layer_types", "'linear_attention'"]),
        ({"layer_types": "sliding_attention"}, ["layer_types", "list of strings"]),
        ({"layer_types": ["sliding_attention"] * 36}, ["sliding_window"]),  # null in Qwen3's config
        ({"layer_types": ["sliding_attention"] * 36, "sliding_window": 0}, ["sliding_window", "positive"]),
    ],
)
def test_bad_layer_types_name_the_field(changes, words):
    with pytest.raises(UserError) as err:
        spec_from_hf_config(dict(QWEN3_8B, **changes), "x", "/tmp/qwen3.json")
    for word in words:
        assert word in str(err.value), str(err.value)
