"""planner/limits.py: one table of the largest inputs, used where each input enters (the API, the
CLI's parse functions, a hardware profile's fields, a config.json's keys), with messages that
name the input and the bound; and the fixes behind the bounds (exact divisors, int64 key codes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner import api, limits
from planner.cli.flags import FLAGS
from planner.cli.options import parse_int_list, seconds_type
from planner.errors import UserError, whole_number
from planner.hardware.load import load_profile, profile_from_dict
from planner.model.catalog import PRESETS_DIR, load_model
from planner.model.hf_import import spec_from_hf_config
from planner.resources import hardware_profiles_dir
from planner.search.keys import group_by_key
from planner.search.space import Space, divisors

GPT3 = json.loads((PRESETS_DIR / "gpt3-125m.json").read_text())["config"]


def test_every_bounded_input_reads_as_its_flag_on_the_cli() -> None:
    not_inputs = {"gpus", "tokens_per_step"}  # products of inputs: their messages name the inputs
    assert set(limits.BOUNDS) - not_inputs <= set(FLAGS), sorted(set(limits.BOUNDS) - not_inputs - set(FLAGS))


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "8"])
def test_below_the_range_reads_as_whole_number_does(value) -> None:
    messages = []
    for check in (limits.count, whole_number):
        with pytest.raises(UserError) as err:
            check("tp", value)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize(("value", "shown"), [
    (2**24 + 1, "16,777,217"), (2**62, "2**62"), (2**62 + 1, "4.61e+18"), (10**400, "a 401-digit number"),
    (-(10**5000), "a negative 5,001-digit number"),
], ids=["over", "power-of-two", "large", "401-digits", "5001-digits-negative"])
def test_above_the_bound_says_the_bound_and_why_for_any_size(value: int, shown: str) -> None:
    with pytest.raises(UserError) as err:
        limits.count("global_batch", value)
    if value > 0:
        assert str(err.value) == (f"global_batch: {shown} is above the largest supported 16,777,216 samples (a "
                                  "thousand times the largest published batches); give at most 16,777,216")
    else:
        assert str(err.value) == f"global_batch: need a whole number >= 1, got {shown}"
    assert limits.count("global_batch", 2**24) == 2**24


def test_nesting_counts_levels_without_recursing_and_survives_cycles() -> None:
    def nested(levels: int) -> dict:
        out: dict = {}
        for i in range(levels - 1):
            out = [out] if i % 2 else {"a": out}
        return out

    limits.nesting(nested(64), "f.json")
    with pytest.raises(UserError, match=r"^f.json: nested more than 64 levels deep"):
        limits.nesting(nested(65), "f.json")
    with pytest.raises(UserError):
        limits.nesting(nested(100_000), "f.json")  # recursion would die at ~1,000
    loop: list = []
    loop.append(loop)
    limits.nesting({"a": loop, "b": [loop, loop]}, "f.yaml")  # YAML aliases can build cycles


def test_the_api_bounds_the_cluster_the_workload_and_the_search() -> None:
    with pytest.raises(UserError, match=r"^nodes: 2\*\*50 is above the largest supported 1,048,576 nodes"):
        api.load_cluster(nodes=2**50)
    with pytest.raises(UserError, match=r"^nodes 131,073 x 8 GPUs per node = 1,048,584 GPUs is above the largest "
                                        r"supported 1,048,576 .*give at most 131,072 nodes of dgx-a100-80g$"):
        api.load_cluster(nodes=2**17 + 1)
    assert api.load_cluster(nodes=2**17).num_gpus == 2**20
    with pytest.raises(UserError, match="^global_batch 8,192 x seq_len 1,048,576 = 8,589,934,592 tokens per step"):
        api.make_workload("gpt3-125m", global_batch=2**13, seq_len=2**20)
    with pytest.raises(UserError, match=r"^seq_len: 2,097,152 is above the largest supported 1,048,576 tokens"):
        api.make_workload("gpt3-125m", seq_len=2**21)
    with pytest.raises(UserError, match=r"^tp: 2\*\*62 is above"):
        api.constraints(tp=[8, 2**62])
    cluster = api.load_cluster(nodes=1)
    with pytest.raises(UserError, match=r"^top: 2\*\*62 is above the largest supported 10,000 plans"):
        api.suggest("gpt3-125m", cluster, top=2**62)
    with pytest.raises(UserError, match=r"^micro_batch: 1,073,741,824 is above"):
        api.estimate("gpt3-125m", cluster, micro_batch=2**30)
    with pytest.raises(UserError, match=r"^global_batch: 2\*\*62 is above"):
        api.estimate("gpt3-125m", cluster, workload=api.make_workload("gpt3-125m").model_copy(
            update={"global_batch": 2**62}))
    with pytest.raises(UserError, match=r"^images_per_sample: 1,099,511,627,776 is above"):
        api.make_workload("vl2", images_per_sample=2**40)


def test_cli_lists_are_bounded_even_past_pythons_digit_limit() -> None:
    assert parse_int_list("--tp", "1,2,1048576") == (1, 2, 2**20)
    with pytest.raises(UserError) as err:
        parse_int_list("--tp", "2," + "7" * 5000)
    assert str(err.value).startswith("tp: a 5,000-digit number is above the largest supported 1,048,576 GPUs")
    with pytest.raises(UserError, match=r"^--dp: a 5,000-digit negative number is below 1"):
        parse_int_list("--dp", "-" + "7" * 5000)
    with pytest.raises(UserError, match=r"^micro_batch: 2\*\*62 is above"):
        parse_int_list("--micro-batch", str(2**62))
    assert parse_int_list("--zero", "0,3", minimum=0) == (0, 3)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0.5", "604801", "soon"])
def test_seconds_are_finite_and_in_range(text: str) -> None:
    import click

    kind = seconds_type(1, limits.MAX_TIMEOUT_S, "a week")
    assert kind.convert("600", None, None) == 600.0
    with pytest.raises(click.BadParameter, match="is not a number of seconds from 1 to 604,800 \\(a week\\)"):
        kind.convert(text, None, None)


def _profile(**node_changes) -> dict:
    import yaml

    data = yaml.safe_load((hardware_profiles_dir() / "dgx-a100-80g.yaml").read_text())
    data["node"].update(node_changes)
    return data


@pytest.mark.parametrize(("change", "message"), [
    ({"nics": {"count": 2**64, "speed_gbit": 200}}, "node.nics.count: Input should be less than or equal to 1152"),
    ({"gpus": 577}, "node.gpus: Input should be less than or equal to 576"),
    ({"host_memory_GiB": 1e300}, "node.host_memory_GiB: Input should be less than or equal to 1048576"),
    ({"pcie_GBps": 2e6}, "node.pcie_GBps: Input should be less than or equal to 1000000"),
])
def test_a_profile_number_past_its_bound_is_refused_with_the_reason(change: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        profile_from_dict(_profile(**change), source="p.yaml")
    assert str(err.value).startswith(f"p.yaml: invalid field(s): {message}")
    assert "the bound is" in str(err.value)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("n_embd", 1e30, "field 'n_embd' must be at most 131,072 (six times the widest published model"),
    ("n_layer", 5000, "field 'n_layer' must be at most 4,096 (the deepest published models have ~200), got 5,000"),
    ("vocab_size", 2**62, "field 'vocab_size' must be at most 16,777,216"),
    ("n_positions", 2**31, "field 'n_positions' must be at most 1,073,741,824"),
    ("layer_norm_epsilon", float("inf"), "field 'layer_norm_epsilon' must be a finite number, got inf"),
    ("layer_norm_epsilon", 10**400, "field 'layer_norm_epsilon' must be a finite number, got a 401-digit number"),
])
def test_a_config_key_past_its_bound_names_the_key_and_the_bound(key: str, value, message: str) -> None:
    with pytest.raises(UserError) as err:
        spec_from_hf_config({**GPT3, key: value}, name="m", source="c.json")
    assert str(err.value).startswith(f"c.json: {message}")


def test_a_model_over_2_to_the_50_parameters_is_refused() -> None:
    wide = {**GPT3, "n_embd": 2**17, "n_head": 2**10, "n_inner": 2**20, "n_layer": 4096}
    with pytest.raises(UserError, match=r"^c.json: the model has \d\.\d+e\+15 parameters, above the largest supported "
                                        "1,125,899,906,842,624"):
        spec_from_hf_config(wide, name="m", source="c.json")


def test_config_files_that_json_cannot_read_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    cases = {
        '{"n_embd": NaN}': "NaN is not a JSON number (a config's values are finite numbers)",
        '{"n_embd":\n ' + "7" * 5000 + "}": "a number at line 2 has 5,000 digits, more than Python reads",
        '{"a": ' * 5000 + "1" + "}" * 5000: "nested too deeply to read",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(UserError) as err:
            load_model(str(path))
        assert str(err.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("name", ["a" * 5000, "a\x00b", "x" * 300 + ".json", ("d/" * 3000) + "c.json"])
def test_names_that_cannot_be_paths_are_unknown_names_not_os_errors(name: str) -> None:
    assert limits.path_kind(Path(name)) is None
    with pytest.raises(UserError, match="unknown model|no such file"):
        load_model(name)
    with pytest.raises(UserError, match="unknown hardware profile|not found"):
        load_profile(name)


def test_divisors_are_exact_where_a_float_square_root_is_not() -> None:
    n = (2**26 + 1) ** 2  # float(n) ** 0.5 rounds; math.isqrt does not
    assert 2**26 + 1 in divisors(n)
    assert divisors(2**24) == [2**i for i in range(25)]


def _space(columns: dict[str, list[int]]) -> Space:
    n = len(next(iter(columns.values())))
    base = {k: np.zeros(n, dtype=np.int64) for k in ("dp", "tp", "pp", "ep", "vs", "zero", "offload", "recompute",
                                                    "sp", "framework", "micro_batch", "grad_accum")}
    base.update({k: np.array(v, dtype=np.int64) for k, v in columns.items()})
    return Space(base)


def test_key_codes_that_would_overflow_int64_group_like_the_rows_themselves() -> None:
    # a million GPUs and a 2**24 batch: radix tp x ep x micro x pp x dp x ... is past 2**63
    rng = np.random.default_rng(0)
    pick = lambda values: rng.choice(values, 400).tolist()  # noqa: E731
    cols = {"tp": pick([1, 8, 2**20]), "ep": pick([1, 2**16]), "micro_batch": pick([1, 2**24]),
            "pp": pick([1, 4, 2**20]), "vs": pick([1, 2]), "dp": pick([1, 2**20]), "sp": pick([0, 1]),
            "zero": pick([0, 3])}
    ks = group_by_key(_space(cols))
    order = ("tp", "sp", "ep", "micro_batch", "recompute", "pp", "vs", "dp", "framework")
    rows = np.stack([ks.columns[k] for k in order], axis=1)
    rows[:, 1] = np.where(rows[:, 0] > 1, 2, rows[:, 1])  # the TP style: framework 0 is DeepSpeed, AutoTP
    unique = np.unique(rows, axis=0)
    assert ks.keys.tolist() == unique.tolist()  # each distinct row once, in order
    assert (ks.keys[ks.inverse] == rows).all()  # every candidate maps to its own row
    for g in range(len(ks.keys)):
        assert (rows[ks.members(g)] == ks.keys[g]).all()
    assert ks.micro == {(tp, sp, ep): tuple(sorted({int(m) for t, s, e, m in rows[:, :4].tolist()
                                                     if (t, s, e) == (tp, sp, ep)}))
                        for tp, sp, ep in {tuple(r) for r in rows[:, :3].tolist()}}
