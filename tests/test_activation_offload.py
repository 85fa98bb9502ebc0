"""Activation offload (Megatron-Core --cpu-offloading-num-layers, TE's CPU offload context):
memory moved to the host, the copies' exposed time, the search's choice of the fewest layers
that fit, the runtime's rules, and the flag Megatron-LM reads (planner/cost/activation_offload.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost import memory as mem
from planner.cost.activation_offload import exposed_seconds, layers_to_fit
from planner.cost.block_times import BlockTables
from planner.cost.context import CostContext
from planner.cost.parallel import RECOMPUTES
from planner.errors import UserError
from planner.model.catalog import load_model
from tests.scalar_oracle import oracle_estimate

# NVIDIA's Megatron-Bridge 25.11 GB200 Llama 3 70B FP8 recipe: Megatron-FSDP over 64 GPUs, micro-batch 2,
# sequence 8192, no recomputation, 40 of 80 layers' activations offloaded (perf_recipes/llama/gb200/llama3.py).
ROW = dict(framework="megatron", zero=3, micro_batch=2, global_batch=256, seq_len=8192, precision="fp8-tensorwise",
           recompute="none")
GIB = 2**30


def _gb200():
    return api.load_cluster("gb200-nvl72", nodes=16)


def _layer_bytes(model_name: str, cluster, plan) -> float:
    """One llama decoder layer's stored activations per micro-batch, read off the block table."""
    model = load_model(model_name)
    w = plan.workload
    tables = BlockTables(model, cluster, w, CostContext.of(cluster, w).dev)
    table = tables.table(plan.cfg.tp, int(plan.cfg.sequence_parallel), plan.cfg.ep, (plan.cfg.micro_batch,))
    decoder = [i for i, b in enumerate(model.blocks) if b.kind == "decoder"]
    per_layer = table.act[RECOMPUTES.index(plan.cfg.recompute), decoder]
    assert np.allclose(per_layer, per_layer[0])  # a uniform stack
    return float(per_layer[0]) * plan.cfg.micro_batch


def test_offloaded_layers_leave_the_gpu_for_pinned_host_memory() -> None:
    cluster = _gb200()
    base = api.estimate("llama-3-70b", cluster, **ROW)
    layer = _layer_bytes("llama-3-70b", cluster, base)
    logits = 4 * 2 * 8192 * 128256  # the head's fp32 logits: besides the 80 layers, most of the rest
    assert logits < base.memory.activations - 80 * layer < 1.1 * logits
    for k in (20, 40):
        plan = api.estimate("llama-3-70b", cluster, activation_offload=k, **ROW)
        assert base.memory.activations - plan.memory.activations == pytest.approx(k * layer, rel=1e-12)
        assert base.memory.peak - plan.memory.peak == pytest.approx(mem.GROWTH * k * layer, rel=1e-12)
        # four GPUs per tray, each pinning its k layers (memory.cpu_bytes_per_node's 1.5 for pinned rounding)
        assert plan.cpu_bytes_per_node == pytest.approx(4 * k * layer * mem.CPU_BUFFER_FACTOR, rel=1e-12)
        assert plan.cfg.activation_offload == k and plan.to_json()["activation_offload"] == k
    # NVIDIA's 40 layers fit, 20 do not; 60 fill the GPU less but overflow the trays' host memory
    fits = {k: api.estimate("llama-3-70b", cluster, activation_offload=k, **ROW).fits for k in (20, 40, 60)}
    assert fits == {20: False, 40: True, 60: False}
    assert "host memory" in api.estimate("llama-3-70b", cluster, activation_offload=60, **ROW).why_not()


def test_copies_hide_under_compute_until_the_host_link_cannot_keep_up() -> None:
    # one layer's copy 1 ms; 12 layers, 10 offloaded: 10 ms each way
    k, layers, b, bw = np.array([10, 10, 10, 11, 0]), 12, 1e9, 1e12
    fwd = np.array([12e-3, 6e-3, 24e-3, 24e-3, 1e-3])
    bwd = 2 * fwd
    got = exposed_seconds(k, np.full(5, layers), np.full(5, b), fwd, bwd, bw)
    # forward hides under 11/12 of its compute, backward under 10/12 (its first layer frees the slot)
    assert got[0] == pytest.approx(0.0)  # 10 ms vs 11 ms forward, 20 ms backward
    assert got[1] == pytest.approx((10e-3 - 5.5e-3) + 0.0)  # 6 ms forward: 5.5 ms hides; backward's 10 ms does
    assert got[2] == pytest.approx(0.0)
    assert got[3] == pytest.approx(2 * 11e-3)  # one slot left: nothing overlaps (TE warns of it)
    assert got[4] == 0.0


def test_fewest_layers_that_fit() -> None:
    cap, layer = 100.0, 10.0 / mem.GROWTH  # each layer offloaded frees 10 bytes of peak
    peaks = np.array([99.0, 100.0, 100.5, 120.0, 189.9, 191.0])
    assert layers_to_fit(peaks, cap, np.full(6, layer), np.full(6, 10)).tolist() == [0, 0, 1, 2, 9, 0]


def test_exposed_time_on_pcie_matches_the_formula_and_the_oracle() -> None:
    """On DGX H100's PCIe (gen5 x16, 63 GB/s, a switch uplink shared by two GPUs) offloading most of
    Llama 3 8B's layers shows."""
    cluster = api.load_cluster("dgx-h100", nodes=1)
    knobs = dict(framework="megatron", zero=1, micro_batch=4, global_batch=64, seq_len=8192, recompute="none")
    base = api.estimate("llama-3-8b", cluster, **knobs)
    layer = _layer_bytes("llama-3-8b", cluster, base)
    mb = base.stages[0].microbatch
    for k in (4, 8, 24, 31):
        plan = api.estimate("llama-3-8b", cluster, activation_offload=k, **knobs)
        copies = k * layer / 31.5e9
        per_mb = (2 * copies if 32 - k < 2 else
                  max(0.0, copies - mb.fwd * 31 / 32) + max(0.0, copies - mb.bwd * 30 / 32))
        assert plan.time.act_offload == pytest.approx(plan.cfg.grad_accum * per_mb, rel=1e-12)
        assert plan.step_time_s == pytest.approx(base.step_time_s + plan.time.act_offload, rel=1e-12)
        oracle = oracle_estimate(load_model("llama-3-8b"), cluster, plan.workload, plan.cfg, partition=plan.partition)
        assert oracle.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
        assert oracle.memory.peak == pytest.approx(plan.memory.peak, rel=1e-9)
        assert oracle.cpu_bytes_per_node == pytest.approx(plan.cpu_bytes_per_node, rel=1e-9)
    assert api.estimate("llama-3-8b", cluster, activation_offload=4, **knobs).time.act_offload == 0.0
    assert api.estimate("llama-3-8b", cluster, activation_offload=8, **knobs).time.act_offload > 0.0


def test_suggest_offloads_the_fewest_layers_that_fit_and_estimate_agrees() -> None:
    cluster = _gb200()
    pins = dict(tp=1, pp=1, cp=1, ep=1, framework="megatron", zero=3, micro_batch=2)
    result = api.suggest("llama-3-70b", cluster, global_batch=256, seq_len=8192, precision="fp8-tensorwise", top=2,
                         **pins)
    best = result.plans[0].plan
    k = best.cfg.activation_offload
    assert 30 < k < 40 and best.fits
    again = api.estimate("llama-3-70b", cluster, activation_offload=k, **ROW)
    assert again.to_json()["step_time_s"] == best.to_json()["step_time_s"]
    assert again.memory.peak == best.memory.peak
    assert not api.estimate("llama-3-70b", cluster, activation_offload=k - 1, **ROW).fits
    # without it the same pins leave only full recomputation, a third slower
    off = api.suggest("llama-3-70b", cluster, global_batch=256, seq_len=8192, precision="fp8-tensorwise", top=2,
                      activation_offload=False, **pins)
    assert all(p.plan.cfg.activation_offload == 0 for p in off.plans)
    assert off.plans[0].plan.cfg.recompute == "full"
    assert off.plans[0].plan.step_time_s > 1.25 * best.step_time_s


@pytest.mark.parametrize(("knobs", "says"), [
    (dict(framework="deepspeed", zero=1), "framework deepspeed has none"),
    (dict(framework="megatron", zero=1, pp=2), "only without pipeline parallelism"),
    (dict(framework="megatron", zero=1, recompute="selective"), "while recomputing"),
    (dict(framework="megatron", zero=1, activation_offload=32), "use at most 31"),
])
def test_runtime_rules(knobs, says) -> None:
    cluster = api.load_cluster("dgx-h100", nodes=1)
    with pytest.raises(UserError, match=says):
        api.estimate("llama-3-8b", cluster, global_batch=64, seq_len=4096,
                     **{"activation_offload": 4, **knobs})


def test_not_priced_beside_the_expert_all_to_all_overlap() -> None:
    cluster = api.load_cluster("dgx-h100", nodes=1)
    knobs = dict(framework="megatron", zero=1, ep=8, global_batch=64, seq_len=4096, activation_offload=4)
    with pytest.raises(UserError, match="not priced"):
        api.estimate("mixtral-8x7b", cluster, **knobs)
    assert api.estimate("mixtral-8x7b", cluster, ep_comm_overlap=False, **knobs).cfg.activation_offload == 4


def test_cli_flags_json_and_errors(tmp_path) -> None:
    runner = CliRunner()
    base = ["--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework", "megatron", "--zero", "1",
            "--global-batch", "64", "--seq-len", "8192", "--micro-batch", "1"]
    r = runner.invoke(main, ["estimate", *base, "--activation-offload", "24", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["activation_offload"] == 24 and data["time"]["act_offload_s"] > 0
    assert data["memory"]["cpu_bytes_per_node"] > 0
    r = runner.invoke(main, ["estimate", *base, "--activation-offload", "24"])
    assert "activations of 24 layers offloaded" in r.output and "activation offload" in r.output
    r = runner.invoke(main, ["estimate", *base, "--activation-offload", "8", "--pp", "2"])
    assert r.exit_code == 2 and "--pp 1 or --activation-offload 0" in r.output and "Traceback" not in r.output
    r = runner.invoke(main, ["estimate", *base, "--activation-offload", "-1"])
    assert r.exit_code == 2
    r = runner.invoke(main, ["suggest", "--model", "llama-3-8b", "--activation-offload", "sometimes"])
    assert r.exit_code == 2 and "auto" in r.output


def test_generate_writes_the_megatron_flag(tmp_path) -> None:
    runner = CliRunner()
    est = runner.invoke(main, ["estimate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                               "megatron", "--zero", "1", "--global-batch", "64", "--seq-len", "8192",
                               "--micro-batch", "1", "--activation-offload", "24", "--json"])
    (tmp_path / "plan.json").write_text(est.stdout)
    entry = tmp_path / "pretrain_gpt.py"
    entry.write_text("")
    r = runner.invoke(main, ["generate", "--plan", str(tmp_path / "plan.json"), "--entry", str(entry), "--out",
                             str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "run" / "megatron_args.sh").read_text()
    assert "--cpu-offloading-num-layers 24" in text
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["activation_offload"] == 24


def test_layer_count_is_the_mean_decoder_layer() -> None:
    """DeepSeek-V2-Lite: one dense layer then 26 MoE layers; offload moves k mean layers."""
    cluster = api.load_cluster("dgx-h100", nodes=1)
    knobs = dict(framework="megatron", zero=1, ep=8, global_batch=64, seq_len=4096, ep_comm_overlap=False)
    base = api.estimate("deepseek-v2-lite", cluster, **knobs)
    plan = api.estimate("deepseek-v2-lite", cluster, activation_offload=13, **knobs)
    moved = base.memory.activations - plan.memory.activations
    model = load_model("deepseek-v2-lite")
    w = base.workload
    table = BlockTables(model, cluster, w, CostContext.of(cluster, w).dev).table(1, 0, 8, (1,))
    decoder = [i for i, b in enumerate(model.blocks) if b.kind == "decoder"]
    assert moved == pytest.approx(13 * float(table.act[0, decoder].mean()), rel=1e-12)
    assert not math.isclose(float(table.act[0, decoder[0]]), float(table.act[0, decoder[1]]))
