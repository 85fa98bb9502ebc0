"""`dsplan hardware` and `dsplan hardware show`: tables, JSON, user files and exit-2 errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.hardware.load import list_profiles, load_profile
from planner.resources import hardware_profiles_dir


def _run(*args: str, columns: int = 160):
    return CliRunner(env={"COLUMNS": str(columns)}).invoke(main, list(args))


def test_list_json_has_every_profile_with_stable_keys():
    result = _run("hardware", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == list_profiles()
    assert [r["name"] for r in rows if r["default"]] == ["dgx-a100-80g"]
    keys = {
        "name", "default", "description", "gpu", "vendor", "gpus_per_node", "memory_GiB", "bf16_TFLOPs", "hbm_GBps",
        "intra_kind", "intra_bw_GBps", "nvlink_domain_nodes", "nvlink_domain_gpus", "nics_per_node", "nic_speed_gbit",
        "nic_bw_per_gpu_GBps", "fabric",
    }
    assert all(set(r) == keys for r in rows)
    by_name = {r["name"]: r for r in rows}
    for name, row in by_name.items():
        p = load_profile(name)
        assert row["bf16_TFLOPs"] == p.gpu.peak_TFLOPs["bf16"]
        assert row["nic_bw_per_gpu_GBps"] * 1e9 == p.nic_bw_per_gpu
    assert by_name["h800"]["intra_bw_GBps"] == 200
    assert {n for n, r in by_name.items() if r["nvlink_domain_nodes"] > 1} == {"gb200-nvl72", "gb300-nvl72"}
    assert by_name["gb200-nvl72"]["nvlink_domain_gpus"] == 72 and by_name["dgx-b200"]["nvlink_domain_gpus"] == 8
    assert by_name["a100-pcie"]["intra_kind"] == "pcie"


def test_list_table_shows_each_profile_and_its_numbers():
    result = _run("hardware")
    assert result.exit_code == 0, result.output
    for name in list_profiles():
        assert name in result.output
    assert "dgx-a100-80g *" in result.output
    assert "8x H200-SXM-141GB" in result.output and "4800" in result.output
    assert "NVSwitch 450" in result.output and "8x400G" in result.output


def test_list_table_keeps_every_name_whole_on_an_80_column_terminal():
    narrow = _run("hardware", columns=80)
    assert narrow.exit_code == 0, narrow.output
    assert max(len(line) for line in narrow.output.splitlines()) <= 80
    names = {line.split()[0] for line in narrow.output.splitlines()[2:] if line[:1].strip()}
    assert set(list_profiles()) <= names


def test_show_json_is_model_dump_plus_derived():
    result = _run("hardware", "show", "DGX-A100-80G", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    derived = data.pop("derived")
    assert data == load_profile("dgx-a100-80g").model_dump(mode="json")
    assert derived["nic_bw_per_gpu_GBps"] == 25.0  # 8x HDR 200 Gb/s over 8 GPUs
    assert derived["nic_bw_per_node_GBps"] == 200.0
    assert derived["gpu_memory_bytes"] == 80 * 2**30
    assert derived["bf16_achievable_flops"] == pytest.approx(312e12 * 0.869)
    assert derived["intra_to_inter_bw_ratio"] == pytest.approx(300 / 25)


def test_show_human_prints_every_section():
    result = _run("hardware", "show", "mi250x")
    assert result.exit_code == 0, result.output
    for text in ("MI250X-GCD", "infinity_fabric", "peak_TFLOPs.bf16", "191.5", "nic_bw_per_gpu_GBps", "12.5",
                 "sources"):
        assert text in result.output


def test_show_user_file(tmp_path: Path):
    data = yaml.safe_load((hardware_profiles_dir() / "hgx-h200.yaml").read_text())
    data["name"] = "lab-h200"
    data["node"]["nics"].update(count=4, gpus_per_nic=2)
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(data))
    result = _run("hardware", "show", str(path), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["name"] == "lab-h200"
    assert out["derived"]["nic_bw_per_gpu_GBps"] == 25.0


def test_help_has_examples():
    for args in (("hardware", "--help"), ("hardware", "show", "--help")):
        result = _run(*args)
        assert result.exit_code == 0
        assert "Examples:" in result.output and "dsplan hardware show" in result.output


def _bad(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _h100_with(tmp_path: Path, section: str, field: str, value) -> Path:
    data = yaml.safe_load((hardware_profiles_dir() / "dgx-h100.yaml").read_text())
    target = data
    for part in section.split("."):
        target = target[part]
    target[field] = value
    return _bad(tmp_path, yaml.safe_dump(data))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda t: _bad(t, "gpu: [1, 2\n"), ["malformed YAML (line"]),
        (lambda t: _h100_with(t, "gpu", "hbm_GBps", "lots"), ["gpu.hbm_GBps", "valid number"]),
        (lambda t: _h100_with(t, "gpu", "memory_GiB", -80), ["gpu.memory_GiB", "greater than 0"]),
        (lambda t: _h100_with(t, "node", "gpus", 0), ["node.gpus", "greater than 0"]),
        (lambda t: _h100_with(t, "node", "gpus", 1000), ["node.gpus", "less than or equal to 576"]),
        (lambda t: _h100_with(t, "node.nics", "speed_gbps", 400),
         ["node.nics.speed_gbps", "did you mean 'speed_gbit'"]),
        (lambda t: _h100_with(t, "fabric", "levels", 7), ["fabric.levels"]),
    ],
)
def test_bad_user_file_exits_2_naming_file_and_field(tmp_path: Path, make, expected: list[str]):
    path = make(tmp_path)
    result = _run("hardware", "show", str(path))
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ")
    assert "cluster.yaml" in result.output
    for text in expected:
        assert text in result.output


def test_unknown_profile_name_exits_2_with_suggestion():
    result = _run("hardware", "show", "dgx-a100-80")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "did you mean dgx-a100-80g" in result.output
    assert "dsplan hardware" in result.output


def test_missing_file_exits_2(tmp_path: Path):
    result = _run("hardware", "show", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 2 and "not found" in result.output and "Traceback" not in result.output
