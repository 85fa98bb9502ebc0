"""DeepSpeed ZeRO-3 as it fetches: one all-gather per module / prefetch bucket, each paying the
ring's latency at the DP group's size, so ZeRO-3 stops hiding its traffic at scale."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cost import frameworks as fw
from planner.cost.collectives import collective_time_array
from planner.cost.estimate import estimate
from planner.cost.layers import layer_costs
from planner.cost.parallel import ParallelConfig, Workload
from planner.cost.zero3_fetch import call_counts, fetch_calls, seconds_over_calls, tensor_count, weight_tensors
from planner.emit.ds_config import build_ds_config
from planner.emit.plan_file import PlanFile
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import contiguous_shape
from planner.model.catalog import load_model

WL = Workload(global_batch=1536, seq_len=2048, precision="fp16", flash_attention=False)


def _decoder(model: str, tp: int = 1):
    costs = layer_costs(load_model(model), WL, tp=tp)
    return next(c for c in costs if c.kind == "decoder"), costs


def test_a_gpt3_layer_is_six_fetches_its_norms_none():
    """GPT-3 175B: q, k, v, o (151M elements each) and fc1, fc2 (604M) each reach the 5e7
    prefetch bucket, so each is a call; norms and biases stay resident (10 x hidden)."""
    layer, costs = _decoder("gpt3-175b")
    h = 12288
    assert sorted(weight_tensors(layer)) == pytest.approx(sorted([h * h] * 4 + [4 * h * h] * 2))
    assert fetch_calls(layer) == pytest.approx(6.0)
    norm = next(c for c in costs if c.kind == "norm")
    assert fetch_calls(norm) == 0.0
    embedding = next(c for c in costs if c.kind == "embedding")  # 50257 x 12288 + positions: one call
    assert fetch_calls(embedding) == 1.0


def test_small_tensors_share_a_bucket():
    """Llama-3-8B: q, k, v, o (16.8M + 4.2M + 4.2M + 16.8M) share 0.84 of a bucket's call;
    gate, up and down (58.7M each) are a call each. Under TP 2 all of them share buckets."""
    layer, _ = _decoder("llama-3-8b")
    attn = (4096 * 4096 * 2 + 4096 * 1024 * 2) / fw.STAGE3_PREFETCH_BUCKET_SIZE
    assert fetch_calls(layer) == pytest.approx(3 + attn, rel=1e-6)
    half, _ = _decoder("llama-3-8b", tp=2)
    assert fetch_calls(half) == pytest.approx((attn * 5e7 + 3 * 4096 * 14336) / 2 / 5e7, rel=1e-6)


def test_calls_split_the_bytes_and_each_pays_the_latency():
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    shape = contiguous_shape(cluster, 1536)
    size = np.array([3.6e9, 0.0, 1e6])
    calls = np.array([6.0, 6.0, 0.0])
    t = seconds_over_calls(cluster, "allgather", shape, size, calls)
    assert t[0] == pytest.approx(6 * collective_time_array(cluster, "allgather", shape, np.array([0.6e9]))[0])
    assert t[0] > collective_time_array(cluster, "allgather", shape, size[:1])[0]  # latency paid six times
    assert t[1] == 0.0 and t[2] == 0.0  # nothing to move; resident tensors make no call
    (g_dense, _), (r_dense, _) = call_counts(np.array([4e8]), np.array([0.0]), np.array([6.0]), True)
    assert g_dense[0] == 6.0 and r_dense[0] == pytest.approx(4e8 / fw.REDUCE_BUCKET_SIZE)
    (g_fsdp, _), (r_fsdp, _) = call_counts(np.array([4e8]), np.array([0.0]), np.array([6.0]), False)
    assert g_fsdp[0] == r_fsdp[0] == 1.0


def _z3(nodes: int, framework: str = "deepspeed"):
    model = load_model("gpt3-175b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    dp = nodes * 8
    cfg = ParallelConfig(dp=dp, tp=1, pp=1, micro_batch=1, grad_accum=1536 // dp, recompute="full",
                         framework=framework, zero_stage=3)
    return estimate(model, cluster, WL, cfg)


def test_zero3_stops_hiding_its_gathers_past_a_few_hundred_gpus():
    """The issue's case: GPT-3 175B, ZeRO-3, one sample per GPU, fp16, unfused attention. On
    512 GPUs the gathers hide under compute; on 1,536 each of the 6 x 96 fetches per pass pays
    a 1,536-rank ring's latency and DP traffic shows (1.47 s of 16.0 s)."""
    small, large = _z3(64), _z3(192)
    assert small.time.dp_comm == 0.0
    assert large.time.dp_comm > 0.05 * large.step_time_s
    assert large.mfu < 0.95 * small.mfu


def test_ds_config_carries_the_persistence_threshold_the_cost_model_used():
    plan = PlanFile(model="gpt3-175b", hardware="dgx-a100-80g", nodes=192, gpus_per_node=8, framework="deepspeed",
                    dp=1536, zero_stage=3, micro_batch=1, grad_accum=1, global_batch=1536, seq_len=2048)
    zero = build_ds_config(plan, load_model("gpt3-175b"))["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == fw.stage3_persistence_threshold(12288) == 122880
    assert zero["stage3_prefetch_bucket_size"] == fw.STAGE3_PREFETCH_BUCKET_SIZE
    assert zero["reduce_bucket_size"] == fw.REDUCE_BUCKET_SIZE


# -- ZeRO++ (--zeropp) ---------------------------------------------------------------------------


def _block(zero_pp: tuple[str, ...], nodes: int = 192) -> dict[str, float]:
    from planner.cost.context import CostContext
    from planner.cost.parallel import FRAMEWORKS
    from planner.cost.zero3_fetch import block_seconds, tensor_count

    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    wl = WL.model_copy(update={"zero_pp": zero_pp})
    ctx = CostContext.of(cluster, wl)
    layer = next(c for c in layer_costs(load_model("gpt3-175b"), wl) if c.kind == "decoder")
    dp = nodes * 8
    one = lambda x: np.array([float(x)])  # noqa: E731
    out = block_seconds(ctx, ctx.layout(1, 1, dp, 1), dp, dp, FRAMEWORKS.index("deepspeed"), one(layer.params_rank),
                        one(0), one(0), one(fetch_calls(layer)), one(tensor_count(layer)))
    return {k: float(v[0]) for k, v in out.items()} | {"params": layer.params_rank, "tensors": tensor_count(layer)}


def test_hpz_gathers_inside_the_node_after_the_first_forward():
    plain, hpz = _block(()), _block(("hpz",))
    assert hpz["first"] == plain["first"] and hpz["reduce"] == plain["reduce"]
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    node = collective_time_array(cluster, "allgather", contiguous_shape(cluster, 8), np.array([2 * hpz["params"] / 6]))
    assert hpz["rest"] == pytest.approx(6 * node[0])
    assert hpz["rest"] < 0.5 * plain["rest"]


def test_qwz_halves_the_gathered_bytes_and_pays_a_dequantize():
    """On 8 nodes (bandwidth-bound), int8 gathers take a little over half the 16-bit time."""
    plain, qwz = _block((), 8), _block(("qwz",), 8)
    assert 0.45 * plain["first"] < qwz["first"] < 0.75 * plain["first"]
    assert qwz["rest"] == qwz["first"] and qwz["reduce"] == plain["reduce"]


def test_qgz_reduces_each_tensor_in_two_int4_all_to_alls():
    from planner.cost.context import CostContext
    from planner.cost.zero3_fetch import QGZ_BYTES, qgz_seconds

    plain, qgz = _block(()), _block(("qgz",))
    assert qgz["reduce"] < 0.5 * plain["reduce"] and qgz["first"] == plain["first"]
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    ctx = CostContext.of(cluster, WL)
    # twice the tensors (each half the size) pay each all-to-all's latency twice as often
    one, two = (qgz_seconds(ctx, 1536, np.array([qgz["params"]]), np.array([n]))[0] for n in (6.0, 12.0))
    assert two > one
    assert QGZ_BYTES == 0.5


def test_zero_plus_plus_end_to_end_memory_time_and_rules():
    model = load_model("gpt3-175b")
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 192)
    cfg = ParallelConfig(dp=1536, micro_batch=1, grad_accum=1, recompute="full", framework="deepspeed", zero_stage=3)
    base = estimate(model, cluster, WL, cfg)
    hpz = estimate(model, cluster, WL.model_copy(update={"zero_pp": ("hpz",)}), cfg)
    extra = hpz.stages[0].memory.weights - base.stages[0].memory.weights
    assert extra == pytest.approx(2 * model.total_params() / 8, rel=0.01)  # the secondary partition
    assert hpz.time.dp_comm < base.time.dp_comm
    from planner.errors import UserError

    with pytest.raises(UserError, match="qwz is DeepSpeed.s ZeRO\\+\\+, which runs on ZeRO-3"):
        estimate(model, cluster, WL.model_copy(update={"zero_pp": ("qwz",)}),
                 cfg.model_copy(update={"framework": "megatron"}))
    from planner.cost.parallel import parse_zero_pp

    assert parse_zero_pp("qgz, QWZ") == ("qwz", "qgz") and parse_zero_pp("none") == ()
    with pytest.raises(UserError, match="unknown ZeRO\\+\\+ option 'qwx'"):
        parse_zero_pp("qwx")


def test_cli_zeropp_on_estimate_and_generate(tmp_path):
    from click.testing import CliRunner

    from planner.cli import main

    base = ["--model", "gpt3-13b", "--nodes", "2", "--framework", "deepspeed", "--zero", "3", "--global-batch", "32"]
    run = CliRunner().invoke(main, ["estimate", *base, "--zeropp", "hpz,qwz", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["zero_pp"] == ["qwz", "hpz"]
    bad = CliRunner().invoke(main, ["estimate", *base, "--zeropp", "hpz,fast"])
    assert bad.exit_code == 2 and "--zeropp: unknown ZeRO++ option 'fast'" in bad.output
    out = tmp_path / "run"
    gen = CliRunner().invoke(main, ["generate", *base, "--zeropp", "qgz", "--out", str(out)])
    assert gen.exit_code == 0, gen.output
    zero = json.loads((out / "ds_config.json").read_text())["zero_optimization"]
    assert zero["zero_quantized_gradients"] is True and "zero_hpz_partition_size" not in zero
    assert json.loads((out / "plan.json").read_text())["zero_pp"] == ["qgz"]


def test_deepspeed_hooks_bound_a_small_model_on_a_fast_gpu():
    """gpt3-125m, one 1,024-token sample per H100: 74 fetched tensors x 1.04 ms of host hooks
    per micro-batch against ~2 ms of device work, so the hooks set the step; Megatron-FSDP has none."""
    model = load_model("gpt3-125m")
    cluster = Cluster.build(load_profile("dgx-h100"), 1)
    wl = Workload(global_batch=16, seq_len=1024)
    tensors = sum(tensor_count(c) for c in layer_costs(model, wl))
    assert tensors == 12 * 6 + 2  # q, k, v, o, fc1, fc2 per layer; the embedding; the (tied) head's weight
    cfg = ParallelConfig(dp=8, micro_batch=1, grad_accum=2, framework="deepspeed", zero_stage=3)
    plan = estimate(model, cluster, wl, cfg)
    host = 2 * tensors * fw.ZERO3_HOST_S_PER_MODULE
    assert plan.time.dp_comm == pytest.approx(host - plan.time.compute, rel=0.01)  # hooks less the device's work
    assert plan.time.dp_comm > 0.5 * plan.step_time_s
    fsdp = estimate(model, cluster, wl, cfg.model_copy(update={"framework": "megatron"}))
    assert fsdp.time.dp_comm < 0.1 * plan.time.dp_comm


def test_the_host_overhead_benchmark_measures_deepspeeds_hooks():
    """The constant's benchmark, small: real DeepSpeed ZeRO-3 against ZeRO-0 on this CPU."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_zero3_host_overhead.py"
    proc = subprocess.run([sys.executable, str(script), "--modules", "60", "--steps", "4", "--json"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["zero3_s"] > got["zero0_s"] and got["modules"] == 60
    assert 0.1 * fw.ZERO3_HOST_S_PER_MODULE < got["host_s_per_module"] < 10 * fw.ZERO3_HOST_S_PER_MODULE


def test_suggest_searches_each_zero_plus_plus_choice_with_auto():
    from click.testing import CliRunner

    from planner import api
    from planner.cli import main

    cluster = api.load_cluster("dgx-a100-80g", nodes=192)
    kw = dict(global_batch=1536, precision="fp16", flash_attention=False, framework="deepspeed", zero=3, top=10)
    result = api.suggest("gpt3-175b", cluster, zero_pp="auto", **kw)
    assert result.inputs["zero_pp"] == "auto"
    chosen = {p.plan.workload.zero_pp for p in result.plans}
    assert len(chosen) > 1 and result.plans[0].plan.workload.zero_pp != ()  # qwZ pays at 1,536 GPUs
    plain = api.suggest("gpt3-175b", cluster, **kw)
    assert result.plans[0].plan.step_time_s < plain.plans[0].plan.step_time_s
    out = CliRunner().invoke(main, ["suggest", "--model", "gpt3-175b", "--nodes", "192", "--global-batch", "1536",
                                    "--precision", "fp16", "--no-flash-attention", "--framework", "deepspeed",
                                    "--zero", "3", "--zeropp", "auto", "--top", "3"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "3++w" in out.output and "ZeRO++ (w qwz" in out.output and "--zeropp auto" in out.output


def test_auto_leaves_out_zero_plus_plus_where_deepspeed_zero3_cannot_run():
    from planner import api

    result = api.suggest("mixtral-8x7b", api.load_cluster("dgx-a100-80g", nodes=2), zero_pp="auto", top=3)
    assert all(p.plan.workload.zero_pp == () for p in result.plans)
    notes = [str(n) for n in result.notes]
    assert sum(n.startswith("left out: ZeRO++ ") for n in notes) == 4
