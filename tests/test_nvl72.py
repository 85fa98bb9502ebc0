"""NVL72 systems: a multi-node NVLink domain (node.nvlink_domain_nodes) priced on NVLink inside,
on the NICs across domains; the gb200-nvl72 and gb300-nvl72 profiles."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.collectives import collective_time
from planner.errors import UserError
from planner.hardware.cluster import Cluster
from planner.hardware.load import list_profiles, load_profile, profile_from_dict
from planner.hardware.placement import GroupShape, contiguous_shape, links_crossed, pipeline_hops, strided_shape

NVL72 = ("gb200-nvl72", "gb300-nvl72")
MiB = 2**20


def _cluster(name: str, nodes: int) -> Cluster:
    return Cluster.build(load_profile(name), nodes)


def _allreduce(cluster: Cluster, size: int, nbytes: float = 256 * MiB):
    return collective_time(cluster, "allreduce", contiguous_shape(cluster, size), nbytes)


# --- the profiles -------------------------------------------------------------------------


def test_nvl72_profiles_carry_the_datasheet_numbers(reference_dir: Path):
    """Per GPU: the rack datasheets' sparse peaks halved over 72 GPUs, 186 / 288 GB of HBM3e at
    8 TB/s, NVLink 5 at 900 GB/s per direction with NVLS; a node is a tray of 4 GPUs and 2 Grace
    (2 x 480 GB LPDDR5X, 144 cores), 18 trays per NVLink domain; one NIC per GPU."""
    with open(reference_dir / "mamf_max_achievable_matmul_measured.csv", newline="") as f:
        (b200,) = [r for r in csv.DictReader(f) if r["accelerator"] == "NVIDIA B200 SXM" and r["dtype"] == "bf16"]
    gb200, gb300 = (load_profile(n) for n in NVL72)
    for p in (gb200, gb300):
        assert (p.node.gpus, p.node.nvlink_domain_nodes, p.nvlink_domain_gpus) == (4, 18, 72)
        assert (p.node.intra.kind, p.node.intra.bw_GBps, p.node.intra.nvls) == ("nvswitch", 900, True)
        assert p.gpu.peak_TFLOPs["bf16"] == 360e3 / 2 / 72 == 2500
        assert p.gpu.peak_TFLOPs["fp8"] == 720e3 / 2 / 72 == 5000
        assert p.gpu.hbm_GBps == 576e3 / 72
        assert (p.node.host_memory_GiB, p.node.cpu_cores, p.node.nics.count) == (2 * 480, 2 * 72, 4)
        assert p.node.pcie_GBps == 900 / 2 / 2  # NVLink-C2C: 900 GB/s bidirectional per Grace and its 2 GPUs
        assert p.gpu.matmul_efficiency == pytest.approx(float(b200["efficiency_pct"]) / 100, abs=5e-4)  # borrowed
        assert any("datasheet" in s for s in p.sources)
    assert (gb200.gpu.memory_GiB, gb300.gpu.memory_GiB) == (186, 288)
    assert (gb200.gpu.peak_TFLOPs["fp4"], gb300.gpu.peak_TFLOPs["fp4"]) == (1440e3 / 2 / 72, 1080e3 / 72)
    assert (gb200.nic_bw_per_gpu, gb300.nic_bw_per_gpu) == (50e9, 100e9)
    assert (gb200.fabric.kind, gb300.fabric.kind) == ("infiniband_ndr", "infiniband_xdr")


def test_every_other_profile_keeps_the_node_as_its_nvlink_domain():
    """Default 1: the domain is the node, and the cluster routes the node's own graph, so every
    existing number is computed as before (benchmarks/numbers_snapshot.py --compare: no change)."""
    for name in set(list_profiles()) - set(NVL72):
        c = _cluster(name, 4)
        assert c.profile.node.nvlink_domain_nodes == 1
        assert (c.domain_gpus, c.fabric_key) == (c.gpus_per_node, c.key[0])


def _edited(**node: object) -> dict:
    data = load_profile("dgx-b200").model_dump()
    data["node"].update(node)
    return data


@pytest.mark.parametrize(("node", "words"), [
    ({"nvlink_domain_nodes": 0}, "node.nvlink_domain_nodes"),
    ({"nvlink_domain_nodes": 2.5}, "node.nvlink_domain_nodes"),
    ({"nvlink_domain_nodes": 100}, "800 GPUs in one NVLink domain"),
])
def test_bad_domains_are_refused_naming_the_field(node: dict, words: str):
    with pytest.raises(UserError, match=words):
        profile_from_dict(_edited(**node))


def test_a_domain_of_several_nodes_needs_an_nvlink_switch():
    data = _edited(nvlink_domain_nodes=2)
    data["node"]["intra"].update(kind="nvlink_mesh")
    with pytest.raises(UserError, match=r"node.nvlink_domain_nodes 2 needs node.intra.kind nvswitch"):
        profile_from_dict(data)
    assert profile_from_dict(_edited(nvlink_domain_nodes=2)).nvlink_domain_gpus == 16


# --- pricing ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [8, 16, 64])
def test_groups_inside_the_domain_are_priced_on_nvlink(size: int):
    """16 trays = 64 GPUs in one domain: TP/EP groups of 8, 16 and 64 never touch a NIC. On
    DGX B200 (8 GPUs a node, same NVLink 5 and NICs) 16 and 64 cross InfiniBand; 8 is alike."""
    nvl, dgx = _cluster("gb200-nvl72", 16), _cluster("dgx-b200", 8)
    shape = contiguous_shape(nvl, size)
    assert (shape.ranks_per_node, shape.nodes_spanned) == (size, 1)
    assert links_crossed(nvl, shape) == ("nvlink",)
    ours, theirs = _allreduce(nvl, size), _allreduce(dgx, size)
    assert "nvswitch" in ours.bottleneck and ours.algorithm == "nvls/Simple"
    for op in ("allreduce", "alltoall", "allgather"):
        a = collective_time(nvl, op, shape, 256 * MiB).time_s
        b = collective_time(dgx, op, contiguous_shape(dgx, size), 256 * MiB).time_s
        assert a == pytest.approx(b) if size == 8 else a < 0.8 * b
    if size > 8:
        assert "network" in theirs.bottleneck


def test_a_group_of_two_domains_crosses_the_network():
    """144 GPUs on 36 trays: two full domains of 72, joined by InfiniBand (NVLS inside each,
    a tree between); a small message pays the network steps."""
    c = _cluster("gb200-nvl72", 36)
    shape = contiguous_shape(c, 144)
    assert (shape.ranks_per_node, shape.nodes_spanned) == (72, 2)
    assert "network" in links_crossed(c, shape)
    assert _allreduce(c, 144).algorithm == "nvls_tree/Simple"
    assert _allreduce(c, 144, 64 * 1024).time_s > _allreduce(c, 72, 64 * 1024).time_s


def test_a_group_split_by_a_domain_boundary_is_priced_as_its_split():
    """72 is no multiple of 16: on 36 trays TP group 4 holds ranks 64-79, 8 in each domain,
    and the step waits for it. Its shape is DGX B200's 16-GPU group's (8 per NVLink domain, 8
    NICs of 50 GB/s between), and so is its time."""
    c = _cluster("gb200-nvl72", 36)
    shape = strided_shape(c, 1, 16, "tp")
    assert (shape.ranks_per_node, shape.nodes_spanned) == (8, 2)
    b200 = _cluster("dgx-b200", 18)
    assert _allreduce(c, 16).time_s == pytest.approx(_allreduce(b200, 16).time_s)


def _every_group(cluster: Cluster, stride: int, size: int) -> tuple[int, int, int, int]:
    """(domains, fewest members on a domain among groups that cross, leaves, pods) from every group."""
    spans, fewest, leaves, pods = 1, size, 1, 1
    ft = cluster.fat_tree
    for base in range(cluster.num_gpus):
        if (base // stride) % size:
            continue
        ranks = base + stride * np.arange(size)
        domains, counts = np.unique(ranks // cluster.domain_gpus, return_counts=True)
        spans = max(spans, len(domains))
        fewest = min(fewest, int(counts.min())) if len(domains) > 1 else fewest
        nodes = ranks // cluster.gpus_per_node
        leaves = max(leaves, len(np.unique(nodes // ft.nodes_per_leaf)))
        pods = max(pods, len(np.unique(nodes // ft.nodes_per_pod)))
    return spans, fewest, leaves, pods


@pytest.mark.parametrize(("nodes", "stride", "size"), [
    (20, 1, 16), (20, 8, 10), (20, 4, 20), (40, 1, 32), (40, 2, 40), (40, 16, 10), (72, 4, 72), (72, 1, 288),
    (36, 8, 18), (54, 1, 24), (54, 72, 3),
])
def test_domain_shapes_match_every_group(nodes: int, stride: int, size: int):
    """Partial last domains (20, 40 trays) and sizes 72 does not divide: the shape is the worst
    group's, checked against each group's ranks."""
    c = _cluster("gb200-nvl72", nodes)
    s = strided_shape(c, stride, size)
    spans, fewest, leaves, pods = _every_group(c, stride, size)
    if spans == 1:  # no traffic reaches the network: no leaves or pods to count
        leaves = pods = 1
    assert (s.size, s.stride, s.nodes_spanned, s.leaf_blocks, s.pods) == (size, stride, spans, leaves, pods)
    assert s.ranks_per_node == (size if spans == 1 else fewest)


def test_pipeline_hops_cross_only_between_domains():
    """pp 36 over 36 trays with tp 4: 18 stages per domain, so 2 of 36 hops leave one (17 -> 18
    and the wrap-around 35 -> 0); the others are NVLink sends inside the domain, also where the
    domain (72 GPUs) is no multiple of twice the stride."""
    c = _cluster("gb200-nvl72", 36)
    crosses, near = pipeline_hops(c, 4, 36)
    assert [r for r, x in enumerate(crosses) if x] == [17, 35]
    assert near == GroupShape(2, 4, 2, 1, 36)
    crosses, near = pipeline_hops(c, 16, 9)
    assert sum(crosses) == 2 and near is not None and links_crossed(c, near) == ("nvlink",)


# --- search and CLI -----------------------------------------------------------------------


def test_search_offers_tp_across_trays_inside_the_domain():
    """TP 8 spans two 4-GPU trays but stays in the NVLink domain: offered without
    allow_tp_across_nodes, as on an 8-GPU node; the same trays without the domain need it."""
    nvl = api.load_cluster("gb200-nvl72", 16)
    out = api.suggest("llama-3-8b", nvl, global_batch=64, seq_len=4096, tp=8, top=1)
    assert out.plans and out.plans[0].plan.cfg.tp == 8
    data = load_profile("gb200-nvl72").model_dump()
    data["node"]["nvlink_domain_nodes"] = 1
    trays = Cluster.build(profile_from_dict(data), 16)
    with pytest.raises(UserError, match="spans more than a node's 4 GPUs"):
        api.suggest("llama-3-8b", trays, global_batch=64, seq_len=4096, tp=8, top=1)


def test_topo_shows_the_domain():
    run = CliRunner().invoke(main, ["topo", "--hardware", "gb200-nvl72", "--nodes", "20"])
    assert run.exit_code == 0, run.output
    assert "NVLink domain" in run.output and "72 GPUs" in run.output
    data = json.loads(CliRunner().invoke(main, ["topo", "--hardware", "gb200-nvl72", "--nodes", "20", "--json"]).output)
    assert (data["nvlink_domain_nodes"], data["nvlink_domain_gpus"], data["nvlink_domains"]) == (18, 72, 2)
    assert data["segment_nodes"] == 10 and "--segment=10" in run.output
    plain = CliRunner().invoke(main, ["topo", "--hardware", "dgx-b200", "--nodes", "2"])
    assert plain.exit_code == 0 and "NVLink domain" not in plain.output


def test_tp_across_trays_of_a_rack_is_emitted_with_the_overlap_it_was_priced_with(tmp_path):
    """TP 8 on 4-GPU trays stays in the NVLink domain: priced with TE's overlap (paid.py), and the
    run directory turns it on."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-70b", "--hardware", "gb200-nvl72", "--nodes", "8",
                                  "--framework", "megatron", "--tp", "8", "--sequence-parallel", "--global-batch",
                                  "64", "--entry", str(script), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "--tp-comm-overlap" in (out / "megatron_args.sh").read_text()


def test_a_job_takes_the_same_trays_from_each_domain():
    """As NVIDIA's Megatron-Bridge launcher asks Slurm (--segment: the largest count of trays up
    to a rack's 18 that divides the job's), so 64 trays are 4 domains of 16 and an EP group of 64
    GPUs stays on NVLink; up to one rack the job is one domain."""
    nvl = load_profile("gb200-nvl72")
    assert [nvl.for_job(n).node.nvlink_domain_nodes for n in (8, 18, 20, 36, 64, 19)] == [18, 18, 10, 18, 16, 1]
    assert load_profile("dgx-h100").for_job(64) == load_profile("dgx-h100")
    c = api.load_cluster("gb200-nvl72", 64)
    assert (c.domain_gpus, c.summary()["nvlink_domains"]) == (64, 4)
    assert strided_shape(c, 1, 64, "ep").nodes_spanned == 1
    assert strided_shape(Cluster(nvl, 18), 1, 64, "ep").nodes_spanned == 1


def test_the_slurm_script_asks_for_the_segment_it_was_priced_with(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "gb200-nvl72", "--nodes", "64",
                                  "--framework", "megatron", "--tp", "1", "--pp", "1", "--global-batch", "256",
                                  "--entry", str(script), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "#SBATCH --segment=16" in (out / "slurm.sbatch").read_text()
    plain = tmp_path / "plain"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--nodes", "2",
                                  "--framework", "megatron", "--tp", "1", "--pp", "1", "--global-batch", "64",
                                  "--entry", str(script), "--out", str(plain)])
    assert r.exit_code == 0, r.output
    assert "--segment" not in (plain / "slurm.sbatch").read_text()
