"""Positions and norm epsilon: read from config.json, restated in megatron_args.sh, and the
runtimes that cannot build a model's attention or positions refused before anything is written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost.framework_rules import check_framework_for
from planner.emit.megatron_args import megatron_lm_args, megatron_notes
from planner.errors import UserError
from planner.model.catalog import load_model
from planner.model.hf_import import spec_from_hf_config
from tests.test_emit_ds_config import make_plan

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096}


def flags(args) -> dict[str, str | None]:
    return {a.flag: a.value for a in args}


def test_presets_carry_their_published_rotary_base_scaling_and_epsilon() -> None:
    llama = load_model("llama-3.1-405b")
    assert llama.positions.kind == "rope" and llama.positions.rope_theta == 500000.0 and llama.norm_eps == 1e-5
    assert llama.positions.scaling_type == "llama3" and llama.positions.rope_scaling["factor"] == 8.0
    assert load_model("llama-2-7b").positions.rope_theta == 10000.0
    assert load_model("mixtral-8x7b").positions.rope_theta == 1e6
    qwen = load_model("qwen2.5-72b")
    assert qwen.positions.rope_theta == 1e6 and qwen.norm_eps == 1e-6
    vl = load_model("qwen2-vl-7b")
    assert vl.positions.kind == "mrope" and vl.positions.rope_scaling["mrope_section"] == [16, 24, 24]
    v3 = load_model("deepseek-v3")
    assert v3.positions.scaling_type == "yarn" and v3.positions.rope_scaling["mscale_all_dim"] == 1.0
    assert load_model("deepseek-v2").positions.rope_scaling["mscale"] == 0.707
    assert load_model("bloom-176b").positions.kind == "alibi" and load_model("gpt3-175b").positions.kind == "learned"
    for name in ("llama-3.1-405b", "deepseek-v3", "gpt3-175b", "bloom-176b", "qwen2-vl-72b"):
        assert not {"rope_theta", "rms_norm_eps", "layer_norm_epsilon"} & set(load_model(name).defaulted), name


def test_a_config_without_the_keys_gets_its_model_classs_defaults_and_says_so() -> None:
    spec = spec_from_hf_config(LLAMA, "tiny", "tiny.json")
    assert spec.positions.rope_theta == 10000.0 and spec.norm_eps == 1e-6  # LlamaConfig's defaults
    assert {"rope_theta", "rms_norm_eps"} <= set(spec.defaulted)
    mixtral = spec_from_hf_config({**LLAMA, "model_type": "mixtral", "num_local_experts": 4,
                                   "num_experts_per_tok": 2}, "m", "m.json")
    assert mixtral.positions.rope_theta == 1e6 and mixtral.norm_eps == 1e-5  # MixtralConfig's
    neox = spec_from_hf_config({"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 256,
                                "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 2048,
                                "rotary_pct": 0.25, "rotary_emb_base": 10000, "layer_norm_eps": 1e-5}, "n", "n.json")
    assert neox.positions.rotary_percent == 0.25 and neox.positions.rope_theta == 10000


@pytest.mark.parametrize("bad, problem", [
    ({"rope_theta": "big"}, "must be a number"),
    ({"rope_theta": -1}, "must be positive"),
    ({"rms_norm_eps": 0}, "must be positive"),
    ({"rope_scaling": 8}, "must be a JSON object or null"),
    ({"partial_rotary_factor": 1.5}, "must be at most 1"),
])
def test_bad_position_keys_are_refused_naming_the_key(bad, problem) -> None:
    with pytest.raises(UserError) as err:
        spec_from_hf_config({**LLAMA, **bad}, "tiny", "tiny.json")
    assert "tiny.json" in str(err.value) and next(iter(bad)) in str(err.value) and problem in str(err.value)


def test_megatron_lm_flags_restate_rotary_base_scaling_and_epsilon() -> None:
    plan, model = make_plan("llama-3.1-8b", 1, framework="megatron", tp=2)
    f = flags(megatron_lm_args(model, plan))
    assert f["--position-embedding-type"] == "rope" and f["--rotary-base"] == "500000"
    assert "--use-rope-scaling" in f and float(f["--rope-scaling-factor"]) == 8.0
    assert float(f["--norm-epsilon"]) == 1e-5
    assert megatron_notes(model, plan) == []  # Megatron's fixed llama3 factors are Llama 3.1's


def test_megatron_deepspeed_spells_them_its_own_way_and_notes_what_it_cannot_scale() -> None:
    plan, model = make_plan("llama-3.1-70b", 8, framework="megatron-deepspeed", tp=8, pp=2, zero_stage=1)
    f = flags(megatron_lm_args(model, plan))
    assert f["--rotary-position-embeddings-theta"] == "500000" and float(f["--layernorm-epsilon"]) == 1e-5
    assert not {"--rotary-base", "--norm-epsilon", "--use-rope-scaling", "--position-embedding-type"} & set(f)
    notes = megatron_notes(model, plan)
    assert len(notes) == 1 and "llama3" in notes[0] and "no Megatron-DeepSpeed flag" in notes[0]


def test_mla_takes_yarn_from_the_mla_flags() -> None:
    plan, model = make_plan("deepseek-v2-lite", 2, framework="megatron", ep=4)
    f = flags(megatron_lm_args(model, plan))
    assert float(f["--rotary-scaling-factor"]) == 40.0
    assert float(f["--mscale"]) == 0.707 and float(f["--mscale-all-dim"]) == 0.707
    assert f["--rotary-base"] == "10000" and float(f["--norm-epsilon"]) == 1e-6
    assert megatron_notes(model, plan) == []  # original 4096, beta 32 / 1 are Megatron's MLA defaults


def megatron_script(tmp_path: Path) -> Path:
    """A stand-in for Megatron-LM's pretrain_gpt.py: the reference trainer (the default entry)
    runs no Megatron tensor parallelism, so generate searches such plans for another entry only."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('megatron')\n")
    return script


def test_mrope_sections_reach_megatron_as_separate_words(tmp_path: Path) -> None:
    """--mrope-section is nargs='+': the script must hand Megatron three integers, not one string."""
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "qwen2-vl-7b", "--nodes", "1", "--framework", "megatron",
                                  "--tp", "4", "--entry", str(megatron_script(tmp_path)), "--out", str(out)])
    assert r.exit_code == 0, r.output
    words = subprocess.run(["bash", str(out / "megatron_args.sh")], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    i = words.index("--mrope-section")
    assert words[i + 1:i + 4] == ["16", "24", "24"] and words[i + 4].startswith("--")
    assert words[words.index("--position-embedding-type") + 1] == "mrope"
    assert words[words.index("--rotary-base") + 1] == "1000000"


def test_notes_are_written_into_megatron_args_sh(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3.1-8b", "--nodes", "1", "--framework",
                                  "megatron-deepspeed", "--tp", "2", "--zero", "1",
                                  "--entry", str(megatron_script(tmp_path)), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = (out / "megatron_args.sh").read_text()
    assert "# note: rope_scaling (llama3, factor 8.0) has no Megatron-DeepSpeed flag" in text
    assert json.loads((out / "plan.json").read_text())["framework"] == "megatron-deepspeed"


def test_a_non_integer_rotary_base_is_noted_not_rounded() -> None:
    spec = spec_from_hf_config({**LLAMA, "rope_theta": 12345.5}, "odd", "odd.json")
    plan, _ = make_plan("llama-3.1-8b", 1, framework="megatron")
    f = flags(megatron_lm_args(spec, plan.model_copy(update={"model": "odd"})))
    assert "--rotary-base" not in f
    assert any("12345.5" in n for n in megatron_notes(spec, plan))


@pytest.mark.parametrize("model, framework, words", [
    ("deepseek-v3", "megatron-deepspeed", "no multi-latent attention"),
    ("bloom-176b", "megatron", "no ALiBi"),
])
def test_runtimes_that_cannot_build_the_model_are_refused(model, framework, words) -> None:
    plan, spec = make_plan(model, 4, framework=framework, zero_stage=1)
    with pytest.raises(UserError) as err:
        check_framework_for(plan.parallel_config(), spec, optimizer="adamw", precision="bf16")
    assert words in str(err.value) and "use framework " in str(err.value)  # the API keyword, not --framework


def test_suggest_never_offers_them_and_estimate_says_why(tmp_path: Path) -> None:
    from planner.search.suggest import suggest

    plans = suggest("bloom-176b", nodes=48, top=50).plans
    assert "megatron" not in {rp.plan.cfg.framework for rp in plans}
    assert not any(rp.plan.cfg.sequence_parallel for rp in plans if rp.plan.cfg.framework == "megatron-deepspeed")
    r = CliRunner().invoke(main, ["estimate", "--model", "deepseek-v2-lite", "--nodes", "2",
                                  "--framework", "megatron-deepspeed", "--ep", "4"])
    assert r.exit_code == 2 and "multi-latent attention" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["generate", "--model", "bloom-176b", "--nodes", "12", "--framework", "megatron",
                                  "--tp", "8", "--pp", "12", "--entry", str(megatron_script(tmp_path)),
                                  "--out", "/nonexistent/never"])
    assert r.exit_code == 2 and "ALiBi" in r.output


def test_the_cost_model_applies_rotary_embeddings_where_the_model_states_them() -> None:
    """layers.uses_rope reads ModelSpec.positions (M-RoPE is rotary too; ALiBi and learned are not)."""
    from planner.cost.layers import uses_rope

    assert uses_rope(load_model("qwen2-vl-7b")) and uses_rope(load_model("deepseek-v3"))
    assert not uses_rope(load_model("bloom-176b")) and not uses_rope(load_model("gpt3-175b"))
    neox = spec_from_hf_config({"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 256,
                                "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 2048},
                               "n", "n.json")
    assert uses_rope(neox) and uses_rope(neox.model_copy(update={"positions": None}))


# The flags of BigScience's fork that dsplan writes for an ALiBi model: each is in its parser
# (bigscience-workshop/Megatron-DeepSpeed @8387ae1 megatron/arguments.py, plus
# deepspeed.add_config_arguments' --deepspeed and --deepspeed_config). Its parser has none of
# --vocab-size, --normalization, --recompute-*, --sequence-parallel or --no-pipeline-parallel.
BIGSCIENCE_FLAGS = {
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--attention-dropout", "--bf16", "--fp16", "--checkpoint-activations",
    "--clip-grad", "--deepspeed", "--deepspeed-activation-checkpointing", "--deepspeed_config", "--embed-layernorm",
    "--ffn-hidden-size", "--global-batch-size", "--hidden-dropout", "--hidden-size", "--kv-channels",
    "--layernorm-epsilon", "--log-interval", "--lr", "--lr-decay-style", "--lr-warmup-iters",
    "--max-position-embeddings", "--micro-batch-size", "--min-lr", "--num-attention-heads", "--num-layers",
    "--optimizer", "--pad-vocab-size-to", "--pipeline-model-parallel-size", "--position-embedding-type",
    "--save", "--save-interval", "--load", "--seq-length", "--tensor-model-parallel-size", "--train-iters",
    "--weight-decay", "--zero-stage",
}
BLOOM_RUN = ["--model", "bloom-176b", "--nodes", "48", "--framework", "megatron-deepspeed", "--tp", "4", "--pp", "12",
             "--zero", "1", "--micro-batch", "2", "--global-batch", "2048", "--recompute", "full"]


def test_blooms_published_layout_is_priced_and_written_for_bigscience_fork(tmp_path) -> None:
    """BLOOM-176B trained on 384 A100-80GB with TP4 x PP12 x DP8, ZeRO-1, micro-batch 2, global
    batch 2048, full activation checkpointing, on BigScience's Megatron-DeepSpeed (BLOOM paper,
    arXiv:2211.05100 sec. 3.4; bigscience-workshop/bigscience train/tr11-176B-ml)."""
    r = CliRunner().invoke(main, ["estimate", *BLOOM_RUN, "--json"])
    assert r.exit_code == 0, r.output
    est = json.loads(r.output)
    assert est["fits"] and est["memory"]["peak_bytes"] < 60e9  # BigScience saw 60 GB per GPU used on this layout
    out = tmp_path / "bloom"
    r = CliRunner().invoke(main, ["generate", *BLOOM_RUN, "--entry", str(megatron_script(tmp_path)), "--out", str(out)])
    assert r.exit_code == 0, r.output
    printed = subprocess.run(["bash", str(out / "megatron_args.sh")], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    used = {t for t in printed if t.startswith("--")}
    assert used <= BIGSCIENCE_FLAGS, used - BIGSCIENCE_FLAGS
    at = {t: printed[i + 1] if i + 1 < len(printed) and not printed[i + 1].startswith("--") else None
          for i, t in enumerate(printed) if t.startswith("--")}
    assert at["--position-embedding-type"] == "alibi" and "--embed-layernorm" in at
    assert at["--pad-vocab-size-to"] == "250880" and "--checkpoint-activations" in at
    assert (at["--tensor-model-parallel-size"], at["--pipeline-model-parallel-size"], at["--zero-stage"]) == \
        ("4", "12", "1")
    assert "bigscience-workshop/Megatron-DeepSpeed" in (out / "megatron_args.sh").read_text()


@pytest.mark.parametrize("flag, words", [("--sequence-parallel", "no sequence parallelism"),
                                         ("--recompute selective", "whole layers only")])
def test_what_bigscience_fork_lacks_is_refused_naming_the_fix(flag, words) -> None:
    args = [a for a in BLOOM_RUN if a not in ("--recompute", "full")] + flag.split()
    r = CliRunner().invoke(main, ["estimate", *args])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output
