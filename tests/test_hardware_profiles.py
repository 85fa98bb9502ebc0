"""Built-in hardware profiles load, agree with the reference tables, and bad YAML is refused clearly."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest
import yaml

from planner.errors import UserError
from planner.hardware.load import DEFAULT_PROFILE, list_profiles, load_profile
from planner.hardware.profile import HardwareProfile
from planner.resources import hardware_profiles_dir

EXPECTED = {
    "dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "hgx-h200", "h800", "a100-pcie", "l40s-pcie", "mi250x", "mi300x",
    "dgx-b200", "dgx-b300", "gb200-nvl72", "gb300-nvl72", "cpu-local", "aws-p5", "aws-p5en", "aws-p6-b200",
    "h100-grand-teton",
}
# NVL72 systems: a node is one compute tray of 4 GPUs whose host link is NVLink-C2C (tests/test_nvl72.py).
NVL72 = {"gb200-nvl72", "gb300-nvl72"}


def _rows(reference_dir: Path, name: str) -> list[dict[str, str]]:
    with open(reference_dir / name, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def _spec(reference_dir: Path, device: str) -> dict[str, str]:
    (row,) = [r for r in _rows(reference_dir, "hardware_specs.csv") if r["device"] == device]
    return row


def _first_number(text: str, pattern: str = r"([0-9]+(?:\.[0-9]+)?)") -> float:
    return float(re.search(pattern, text).group(1))  # type: ignore[union-attr]


# --- every built-in profile -------------------------------------------------------------


def test_all_issue_profiles_are_built_in_and_default_is_dgx_a100_80g():
    assert set(list_profiles()) == EXPECTED
    assert DEFAULT_PROFILE == "dgx-a100-80g"
    assert load_profile("default").name == "dgx-a100-80g"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_profile_loads_and_is_self_consistent(name: str):
    p = load_profile(name)
    assert isinstance(p, HardwareProfile)
    assert p.name == name  # file stem and name field agree
    assert p.sources, "every built-in profile cites its sources"
    assert p.description
    if p.gpu.vendor == "cpu":  # a CPU process per rank: its peaks are measured GEMM rates
        assert 1e9 < p.gpu.peak_flops("fp32") < 1e13 and p.gpu.matmul_efficiency == 1.0
        assert p.node.gpus == 2
        return
    assert p.gpu.peak_flops("bf16") > 1e14
    assert 0.4 < p.gpu.matmul_efficiency < 0.95
    assert p.node.gpus == (4 if name in NVL72 else 8)
    # inter-node bandwidth per GPU never exceeds the intra-node fabric's
    assert p.node.intra.bw_GBps * 1e9 > p.nic_bw_per_gpu
    if p.node.intra.kind == "pcie":
        assert p.node.intra.gpus_per_pcie_switch is not None
        assert p.node.intra.bw_GBps == p.node.pcie_GBps
    else:
        assert p.node.intra.links_per_gpu is not None


def test_names_are_case_insensitive_aliases_resolve_and_loads_are_cached():
    assert load_profile("DGX-H100") is load_profile("dgx-h100")
    assert load_profile("h200").name == "hgx-h200"
    assert load_profile(" a100 ").name == "dgx-a100-80g"


# --- numbers agree with reference/ ------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "device"),
    [
        ("dgx-a100-80g", "A100 SXM4 80GB"),
        ("dgx-a100-40g", "A100 SXM4 40GB"),
        ("dgx-h100", "H100 SXM5 80GB"),
        ("hgx-h200", "H200 SXM 141GB"),
        ("h800", "H800 SXM 80GB"),
    ],
)
def test_nvidia_gpu_numbers_match_reference(reference_dir: Path, profile: str, device: str):
    row, p = _spec(reference_dir, device), load_profile(profile)
    assert p.gpu.peak_TFLOPs["bf16"] == float(row["dense_bf16_fp16_TFLOPs"])
    assert p.gpu.peak_TFLOPs["fp16"] == float(row["dense_bf16_fp16_TFLOPs"])
    assert p.gpu.hbm_GBps == float(row["HBM_GBps"])
    # Convention (hardware_profiles/README.md): the vendor's "80 GB" is memory_GiB: 80.
    assert p.gpu.memory_GiB == _first_number(row["memory"])
    assert p.gpu.tdp_W == float(row["TDP_W"])


def test_headline_numbers(reference_dir: Path):
    a100, h100, h200 = load_profile("dgx-a100-80g"), load_profile("dgx-h100"), load_profile("hgx-h200")
    assert (a100.gpu.peak_TFLOPs["bf16"], a100.gpu.hbm_GBps, a100.gpu.memory_GiB) == (312, 2039, 80)
    assert a100.gpu.memory_bytes == 80 * 2**30
    assert h100.gpu.peak_flops("bf16") == 989e12
    assert (h200.gpu.memory_GiB, h200.gpu.hbm_GBps) == (141, 4800)


@pytest.mark.parametrize(
    ("profile", "device"),
    [("dgx-a100-80g", "A100 SXM4 80GB"), ("dgx-a100-40g", "A100 SXM4 80GB"), ("dgx-h100", "H100 SXM5 80GB"),
     ("hgx-h200", "H100 SXM5 80GB")],
)
def test_nvlink_per_direction_bandwidth_matches_reference(reference_dir: Path, profile: str, device: str):
    text = _spec(reference_dir, device)["scale_up_interconnect"]
    per_dir = _first_number(text, r"= ([0-9]+) GB/s/dir")
    links = _first_number(text, r"([0-9]+) links")
    p = load_profile(profile)
    assert p.node.intra.kind == "nvswitch"
    assert p.node.intra.bw_GBps == per_dir
    assert p.node.intra.links_per_gpu == links
    assert p.node.intra.nvls == (profile in ("dgx-h100", "hgx-h200"))


def test_blackwell_profiles_carry_the_published_dense_peaks(reference_dir: Path):
    """B200/B300 (HGX/DGX at their rated power): bf16 2.25 PF, fp8 4.5 PF dense; FP4 9 PF on
    B200 and 1.5x that on Blackwell Ultra; NVLink 5 at 900 GB/s per direction, NVLS."""
    (mamf,) = [r for r in _rows(reference_dir, "mamf_max_achievable_matmul_measured.csv")
               if r["accelerator"] == "NVIDIA B200 SXM"]
    b200, b300 = load_profile("dgx-b200"), load_profile("dgx-b300")
    assert b200.gpu.peak_TFLOPs["bf16"] == float(mamf["theory_TFLOPs"]) == b300.gpu.peak_TFLOPs["bf16"]
    for p in (b200, b300):
        assert p.gpu.peak_TFLOPs["fp8"] == 2 * p.gpu.peak_TFLOPs["bf16"] and p.gpu.hbm_GBps == 8000
        assert (p.node.intra.bw_GBps, p.node.intra.links_per_gpu, p.node.intra.nvls) == (900, 18, True)
    assert b300.gpu.peak_TFLOPs["fp4"] == 1.5 * b200.gpu.peak_TFLOPs["fp4"] == 13500
    assert (b200.gpu.memory_GiB, b300.gpu.memory_GiB) == (180, 288)
    assert b200.nic_bw_per_gpu == 50e9 and b300.nic_bw_per_gpu == 100e9 and b300.fabric.kind == "infiniband_xdr"


def test_h800_nvlink_is_cut_to_400_bidirectional(reference_dir: Path):
    bidir = _first_number(_spec(reference_dir, "H800 SXM 80GB")["scale_up_interconnect"], r"NVLink ([0-9]+) GB/s bidir")
    p = load_profile("h800")
    assert p.node.intra.bw_GBps == bidir / 2
    assert p.nic_bw_per_gpu == 50e9  # DeepSeek-V3 report: IB 50 GB/s per GPU


@pytest.mark.parametrize(
    ("profile", "link"),
    [("dgx-a100-80g", "InfiniBand HDR"), ("dgx-a100-40g", "InfiniBand HDR"), ("dgx-h100", "InfiniBand NDR"),
     ("hgx-h200", "InfiniBand NDR")],
)
def test_nics_match_reference_ib_generation(reference_dir: Path, profile: str, link: str):
    text = _spec(reference_dir, link)["scale_up_interconnect"]
    gbit, gbyte = _first_number(text, r"([0-9]+) Gb/s"), _first_number(text, r"= ([0-9]+) GB/s/dir")
    p = load_profile(profile)
    assert p.node.nics.count == 8 and p.node.nics.gpus_per_nic == 1
    assert p.node.nics.speed_gbit == gbit
    assert p.nic_bw_per_gpu == gbyte * 1e9
    assert p.fabric.kind == "infiniband_" + link.split()[-1].lower()


def test_pcie_host_links_match_reference(reference_dir: Path):
    gen4 = _first_number(_spec(reference_dir, "PCIe Gen4 x16")["scale_up_interconnect"])
    gen5 = _first_number(_spec(reference_dir, "PCIe Gen5 x16")["scale_up_interconnect"])
    for name in list_profiles():
        p = load_profile(name)
        if name in ("mi250x", "cpu-local") or name in NVL72:
            continue  # CPU-GCD is Infinity Fabric (36 GB/s), Grace-GPU NVLink-C2C, a CPU rank's RAM: not PCIe
        expected = gen4 if p.node.pcie_gen == 4 else gen5
        assert abs(p.node.pcie_GBps - expected) / expected < 0.03, name


@pytest.mark.parametrize(
    ("profile", "accelerator"),
    [("dgx-a100-80g", "NVIDIA A100 SXM"), ("a100-pcie", "NVIDIA A100 PCIe"), ("dgx-h100", "NVIDIA H100 SXM"),
     ("hgx-h200", "NVIDIA H100 SXM"), ("dgx-b200", "NVIDIA B200 SXM"), ("dgx-b300", "NVIDIA B200 SXM"),
     ("aws-p5", "NVIDIA H100 SXM"), ("aws-p5en", "NVIDIA H100 SXM"), ("aws-p6-b200", "NVIDIA B200 SXM"),
     ("h100-grand-teton", "NVIDIA H100 SXM")],
)
def test_matmul_efficiency_is_measured_mamf(reference_dir: Path, profile: str, accelerator: str):
    (row,) = [r for r in _rows(reference_dir, "mamf_max_achievable_matmul_measured.csv")
              if r["accelerator"] == accelerator and r["dtype"] == "bf16"]
    assert load_profile(profile).gpu.matmul_efficiency == pytest.approx(float(row["efficiency_pct"]) / 100, abs=5e-4)


def test_mi300x_efficiency_is_measured_tflops_over_its_own_peak(reference_dir: Path):
    (row,) = [r for r in _rows(reference_dir, "mamf_max_achievable_matmul_measured.csv")
              if r["accelerator"] == "AMD MI300X"]
    p = load_profile("mi300x")
    assert p.gpu.peak_flops("bf16") * p.gpu.matmul_efficiency == pytest.approx(float(row["MAMF_TFLOPs"]) * 1e12,
                                                                               rel=1e-3)
    assert (p.gpu.memory_GiB, p.gpu.hbm_GBps, p.gpu.vendor) == (192, 5300, "amd")
    assert p.node.intra.kind == "xgmi_mesh" and p.node.intra.links_per_gpu == 7


def test_mi250x_gcd_is_half_a_module(reference_dir: Path):
    row, p = _spec(reference_dir, "MI250X (OAM, 2 GCDs)"), load_profile("mi250x")
    assert p.gpu.peak_TFLOPs["bf16"] * 2 == float(row["dense_bf16_fp16_TFLOPs"])
    assert p.gpu.hbm_GBps * 2 == float(row["HBM_GBps"])
    assert p.gpu.memory_GiB == _first_number(row["memory"], r"\(([0-9]+) GB per GCD\)")
    assert p.node.intra.bw_GBps == 7 * _first_number(row["scale_up_interconnect"], r"([0-9]+) GB/s/dir per link")
    assert p.nic_bw_per_gpu == 4 * 25e9 / 8  # 4x 200 Gb/s Slingshot shared by 8 GCDs


def test_pcie_only_profiles_have_no_nvlink():
    for name in ("a100-pcie", "l40s-pcie"):
        p = load_profile(name)
        assert p.node.intra.kind == "pcie" and not p.node.intra.nvls
        assert p.node.nics.gpus_per_nic == 2  # one NIC per PCIe switch of two GPUs
        assert p.nic_bw_per_gpu == p.node.nics.count * p.node.nics.speed_gbit * 1e9 / 8 / 8
    assert load_profile("l40s-pcie").gpu.peak_TFLOPs["bf16"] == pytest.approx(733 / 2, rel=0.02)  # dense = sparse / 2
    assert load_profile("l40s-pcie").fabric.kind == "roce"


# --- user YAML files --------------------------------------------------------------------


def _user_profile(tmp_path: Path, **edits) -> Path:
    """A copy of dgx-h100 written as a user file, with dotted-path edits applied."""
    data = yaml.safe_load((hardware_profiles_dir() / "dgx-h100.yaml").read_text())
    data["name"] = "my-cluster"
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("__")
        target = data
        for part in parents:
            target = target[part]
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    path = tmp_path / "my-cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


_DELETE = object()


def test_user_yaml_by_path(tmp_path: Path):
    path = _user_profile(tmp_path, node__nics__count=4, node__nics__gpus_per_nic=2, fabric__oversubscription=2.0)
    p = load_profile(str(path))
    assert p.name == "my-cluster"
    assert p.nic_bw_per_gpu == 4 * 50e9 / 8
    assert p.fabric.oversubscription == 2.0


def test_user_yaml_without_name_takes_the_file_stem_and_edits_are_seen(tmp_path: Path):
    path = _user_profile(tmp_path, name=_DELETE)
    assert load_profile(str(path)).name == "my-cluster"
    first = load_profile(str(path))
    text = path.read_text().replace("memory_GiB: 80", "memory_GiB: 96")
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later edit, even on coarse clocks
    assert first.gpu.memory_GiB == 80
    assert load_profile(str(path)).gpu.memory_GiB == 96


# --- bad input: one UserError naming the file and the field ----------------------------


def test_unknown_name_suggests_close_names():
    with pytest.raises(UserError) as err:
        load_profile("dgx-h10")
    message = str(err.value)
    assert "unknown hardware profile 'dgx-h10'" in message and "did you mean dgx-h100" in message
    assert "dsplan hardware" in message


def test_missing_file_and_directory(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        load_profile(str(tmp_path / "nope.yaml"))
    with pytest.raises(UserError, match="is a directory"):
        load_profile(str(tmp_path))


@pytest.mark.parametrize(
    ("edits", "fields"),
    [
        ({"gpu__hbm_GBps": "fast"}, ["gpu.hbm_GBps"]),
        ({"gpu__memory_GiB": "80"}, ["gpu.memory_GiB"]),  # strict: a quoted number is a string
        ({"gpu__memory_GiB": 0}, ["gpu.memory_GiB", "greater than 0"]),
        ({"node__intra__bw_GBps": -450}, ["node.intra.bw_GBps", "greater than 0"]),
        ({"node__nics__count": 0}, ["node.nics.count"]),
        ({"gpu__matmul_efficiency": 1.5}, ["gpu.matmul_efficiency"]),
        ({"fabric__oversubscription": 0.5}, ["fabric.oversubscription"]),
        ({"fabric__switch_radix": 1}, ["fabric.switch_radix", "greater than or equal to 2"]),
        ({"node__intra__kind": "nvlink5"}, ["node.intra.kind"]),
        ({"gpu__peak_TFLOPs__bf8": 10}, ["gpu.peak_TFLOPs.bf8"]),
        ({"gpu__memory_GB": 80}, ["gpu.memory_GB", "did you mean 'memory_GiB'"]),
        ({"node__nics__count": 3}, ["node.nics.count (3)", "node.gpus (8)"]),
        ({"fabric": _DELETE}, ["fabric", "Field required"]),
        ({"gpu__peak_TFLOPs": {"fp8": 1979}}, ["gpu.peak_TFLOPs", "bf16"]),
    ],
)
def test_invalid_fields_are_named(tmp_path: Path, edits: dict, fields: list[str]):
    path = _user_profile(tmp_path, **edits)
    with pytest.raises(UserError) as err:
        load_profile(str(path))
    message = str(err.value)
    assert message.startswith(str(path.resolve()))
    for field in fields:
        assert field in message
    assert "hardware_profiles/README.md" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ngpu: {name: [unclosed\n", "malformed YAML (line"),
        ("", "the file is empty"),
        ("- a\n- b\n", "expected a mapping"),
        ("name: x\nname: y\n", "duplicate key 'name'"),
    ],
)
def test_malformed_yaml_is_refused_with_file_and_line(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_profile(str(path))
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_readme_example_loads_and_its_error_example_is_real(tmp_path: Path):
    readme = (hardware_profiles_dir() / "README.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", readme, re.S).group(1)  # type: ignore[union-attr]
    path = tmp_path / "my-cluster.yaml"
    path.write_text(example)
    p = load_profile(str(path))
    assert p.name == "rented-h100"
    assert p.nic_bw_per_gpu == 4 * 50e9 / 8
    assert p.gpu.peak_flops("fp16") == 989e12  # bf16 serves for fp16 when only one is given
    path.write_text(example.replace("speed_gbit:", "speed_gbps:"))
    with pytest.raises(UserError) as err:
        load_profile(str(path))
    shown = re.search(r"error: my-cluster.yaml: (invalid field.*?)\n```", readme, re.S).group(1)  # type: ignore[union-attr]
    assert str(err.value).endswith(shown.replace("\n", " "))


def test_readme_documents_every_schema_field():
    readme = (hardware_profiles_dir() / "README.md").read_text()
    from planner.hardware.profile import GPU, NIC, Fabric, IntraNode, Node

    for model in (HardwareProfile, GPU, Node, IntraNode, NIC, Fabric):
        for field in model.model_fields:
            assert f"| `{field}` |" in readme, f"{model.__name__}.{field} is not documented"



def test_yaml_merge_keys_merge_and_local_keys_override() -> None:
    """Anchors and ``<<:`` merges are how people keep variants of one machine in YAML; the
    duplicate-key check must not refuse them, and a key given beside the merge wins."""
    from planner.hardware.load import _load_yaml

    text = "a: &base {x: 1, y: 2}\nb:\n  <<: *base\n  y: 3\n"
    assert _load_yaml(text) == {"a": {"x": 1, "y": 2}, "b": {"x": 1, "y": 3}}
