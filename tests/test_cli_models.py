"""`dsplan models` and `dsplan models show`: table, JSON keys, block groups, user files, exit-2 errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.model.catalog import list_presets, load_model

DATA = Path(__file__).parent / "data" / "hf_configs"


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_list_json_has_every_preset_with_stable_keys():
    result = _run("models", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list_presets()
    for key in ("name", "family", "aliases", "total_params", "activated_params", "layers", "hidden", "heads",
                "kv_heads", "attention", "routed_experts", "shared_experts", "top_k", "vision", "train_seq_len"):
        assert all(key in r for r in rows), key
    vl2 = next(r for r in rows if r["name"] == "deepseek-vl2")
    spec = load_model("vl2")
    assert vl2["total_params"] == spec.total_params() and vl2["activated_params"] == spec.activated_params()
    assert (vl2["layers"], vl2["hidden"], vl2["routed_experts"], vl2["top_k"], vl2["vision"]) == (30, 2560, 72, 6, True)
    assert vl2["aliases"] == ["vl2"]
    llama = next(r for r in rows if r["name"] == "llama-3-8b")
    assert (llama["routed_experts"], llama["vision"], llama["kv_heads"]) == (0, False, 8)


def test_list_table_names_every_preset():
    result = _run("models")
    assert result.exit_code == 0, result.output
    for name in list_presets():
        assert name in result.output
    assert "vl2 = deepseek-vl2" in result.output
    assert "27.5B" in result.output  # VL2's total, human units


def test_show_json_groups_identical_blocks():
    result = _run("models", "show", "VL2", "--json")
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert s["name"] == "deepseek-vl2"
    groups = s["blocks"]
    assert [(g["kind"], g["count"]) for g in groups] == [
        ("vision_embed", 1), ("vision", 27), ("norm", 1), ("projector", 1), ("embedding", 1),
        ("decoder", 1), ("decoder", 29), ("norm", 1), ("lm_head", 1)]
    assert groups[6]["label"] == "decoder (MoE, MLA)" and groups[6]["first_index"] == 32
    assert groups[6]["params_total"] == 29 * groups[6]["params_each"]
    assert sum(g["params_total"] for g in groups) == s["total_params"] == 27_480_134_248
    assert sum(g["activated_params_total"] for g in groups) == s["activated_params_incl_embedding"]
    assert s["tiling"]["tokens_per_tile"] == 196 and s["tiling"]["patches_per_tile"] == 729
    assert s["vision_params"] == 428_225_600 + 18_360_320
    assert s["defaulted"] == [] and s["notes"]


def test_show_table_has_rows_totals_and_tiling():
    result = _run("models", "show", "deepseek-vl2")
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps at the terminal width
    assert "decoder (MoE, MLA)" in out and "905,012,808" in out and "27,480,134,248" in out
    assert "729 patches -> 196 tokens per tile" in out and "global view" in out


def test_show_a_user_config_lists_defaults_and_prints_warnings_to_stderr():
    result = _run("models", "show", str(DATA / "deepseek_vl2"))
    assert result.exit_code == 0, result.output
    assert "language_config.num_hidden_layers" in result.stdout and "filled by defaults" in result.stdout
    unknown = _run("models", "show", str(DATA / "unknown_type.json"), "--json")
    assert unknown.exit_code == 0, unknown.output
    assert "fancy_llm" in unknown.stderr and "warning" in unknown.stderr
    assert json.loads(unknown.stdout)["family"] == "fancy_llm"


@pytest.mark.parametrize("args", [("models", "--help"), ("models", "show", "--help")])
def test_help_has_examples(args):
    result = _run(*args)
    assert result.exit_code == 0
    assert "Examples:" in result.output and "dsplan models show" in result.output


def _config_with(tmp_path: Path, **changes) -> str:
    raw = json.loads((DATA / "llama.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _assert_user_error(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: ")
    for word in words:
        assert word in result.stderr, result.stderr


def test_unknown_preset_suggests_close_names():
    _assert_user_error(_run("models", "show", "lama-3-8b"), "lama-3-8b", "llama-3-8b", "dsplan models")


def test_malformed_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4096,')
    _assert_user_error(_run("models", "show", str(path)), str(path), "malformed JSON", "line 1")


def test_wrong_type(tmp_path):
    path = _config_with(tmp_path, num_hidden_layers="32")
    _assert_user_error(_run("models", "show", path), path, "num_hidden_layers", "integer")


def test_zero_size(tmp_path):
    path = _config_with(tmp_path, intermediate_size=0)
    _assert_user_error(_run("models", "show", path), path, "intermediate_size", "positive")


def test_negative_size(tmp_path):
    path = _config_with(tmp_path, vocab_size=-1)
    _assert_user_error(_run("models", "show", path), path, "vocab_size", "positive")


def test_heads_not_dividing_hidden(tmp_path):
    path = _config_with(tmp_path, num_attention_heads=24, num_key_value_heads=8, hidden_size=4100)
    _assert_user_error(_run("models", "show", path), path, "num_attention_heads", "(24)", "4100")


def test_missing_keys(tmp_path):
    path = _config_with(tmp_path, num_hidden_layers=None, vocab_size=None)
    _assert_user_error(_run("models", "show", path), path, "missing", "num_hidden_layers", "vocab_size")


def test_missing_file_and_empty_directory(tmp_path):
    _assert_user_error(_run("models", "show", str(tmp_path / "nope.json")), "nope.json", "no such file")
    _assert_user_error(_run("models", "show", str(tmp_path)), str(tmp_path), "no config.json")
