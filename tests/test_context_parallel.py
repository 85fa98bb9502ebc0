"""Context parallelism: the per-rank work and memory it leaves, the exchange it prices, where it
overlaps, its rules, and how generate emits it (cost/context_parallel.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.collectives import collective_time_array
from planner.cost.context_parallel import cp_groups, cp_seconds
from planner.cost.layers import layer_costs
from planner.cost.parallel import Workload
from planner.errors import UserError
from planner.search.context_splits import context_splits
from planner.search.space import Constraints

LLAMA = api.load_model("llama-3.1-8b")


def _decoder(cp: int, tp: int = 1, seq: int = 8192):
    return next(c for c in layer_costs(LLAMA, Workload(global_batch=1, seq_len=seq), tp=tp, cp=cp)
                if c.kind == "decoder")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_rank_holds_one_cpth_of_the_sequence_and_of_the_attention(cp):
    one, split = _decoder(1), _decoder(cp)
    assert split.tokens == one.tokens // cp
    assert split.gemm_flops == pytest.approx(one.gemm_flops / cp)
    # Causally balanced: each rank does 1/cp of the whole s^2 attention, not (s/cp)^2.
    assert split.attn.flops == pytest.approx(one.attn.flops / cp)
    assert split.act["none"] == pytest.approx(one.act["none"] / cp)


def test_the_ring_passes_kv_and_the_all_to_all_moves_qkv_and_the_output():
    c = _decoder(2)
    a = LLAMA.decoder_blocks[0].attention
    tokens = 8192 // 2
    kv = tokens * 2 * a.kv_heads * a.head_dim * 2  # K and V, bf16
    assert c.extra["cp_kv"] == kv
    assert c.extra["cp_qkv"] == tokens * (a.heads + 2 * a.kv_heads) * a.head_dim * 2
    assert c.extra["cp_o"] == tokens * a.heads * a.head_dim * 2
    assert "cp_kv" not in _decoder(1).extra


def test_ring_steps_hide_under_attention_and_show_the_excess():
    cluster = api.load_cluster("dgx-h100", nodes=2)
    groups = cp_groups(cluster, 8, 2, "p2p")  # tp 8 fills a node: the CP pair crosses the network
    assert groups.ring.crosses_nodes and groups.a2a_size == 1
    kv = np.array([[64e6]])
    t = float(collective_time_array(cluster, "p2p", groups.ring, kv)[0, 0])
    long_f, long_b = cp_seconds(cluster, groups, kv, kv, kv, np.array([[10 * t]]), np.array([[20 * t]]))
    assert long_f[0, 0] == 0.0 and long_b[0, 0] == 0.0  # 1/2 of the attention per step hides it
    f, b = cp_seconds(cluster, groups, kv, kv, kv, np.array([[0.5 * t]]), np.array([[t]]))
    assert f[0, 0] == pytest.approx(t - 0.25 * t)  # one step sends, its attention half hides a quarter
    t2 = float(collective_time_array(cluster, "p2p", groups.ring, 2 * kv)[0, 0])
    assert b[0, 0] == pytest.approx(t2 - 0.5 * t)  # backward passes K, V and their gradients


def test_all_to_all_is_never_hidden():
    cluster = api.load_cluster("dgx-h100", nodes=1)
    groups = cp_groups(cluster, 1, 4, "a2a")
    assert groups.ring_size == 1 and groups.a2a_size == 4
    qkv, out = np.array([[30e6]]), np.array([[10e6]])
    f, b = cp_seconds(cluster, groups, qkv, qkv, out, np.array([[1.0]]), np.array([[2.0]]))
    expected = sum(float(collective_time_array(cluster, "alltoall", groups.a2a, x)[0, 0]) for x in (qkv, out))
    assert f[0, 0] == pytest.approx(expected) and b[0, 0] == pytest.approx(expected)


def test_hierarchical_splits_a2a_inside_the_node_and_the_ring_across():
    cluster = api.load_cluster("dgx-h100", nodes=4)
    groups = cp_groups(cluster, 4, 8, "a2a+p2p")  # tp 4: two CP ranks per node, four nodes
    assert groups.a2a_size == 2 and not groups.a2a.crosses_nodes
    assert groups.ring_size == 4 and groups.ring.crosses_nodes


def _estimate(**knobs):
    return api.estimate("llama-3.1-405b", api.load_cluster("dgx-b200", 16), framework="megatron",
                        precision="fp8-tensorwise", seq_len=8192, global_batch=64, **knobs)


def test_the_published_405b_layout_prices_with_cp_and_shards_over_dp_times_cp():
    # NVIDIA's DGX-B200 Llama 3.1 405B recipe: tp 4, pp 8, cp 2, vp 8, mb 1 on 128 GPUs.
    plan = _estimate(tp=4, pp=8, cp=2, virtual_stages=8, sequence_parallel=True, recompute="none")
    assert plan.cfg.dp == 2 and plan.cfg.dp_ranks == 4 and plan.gpus == 128
    assert plan.time.cp_comm >= 0.0 and "cp_comm_s" in plan.to_json()["time"]
    # Context-parallel ranks hold the same weights: the distributed optimizer shards over dp x cp,
    # so the optimizer states per GPU equal those of dp 4 without CP (same tp, pp).
    no_cp = api.estimate("llama-3.1-405b", api.load_cluster("dgx-b200", 16), framework="megatron",
                         precision="fp8-tensorwise", seq_len=8192, global_batch=64, tp=4, pp=8, virtual_stages=8,
                         sequence_parallel=True)
    assert plan.memory.optimizer == pytest.approx(no_cp.memory.optimizer)
    assert plan.memory.activations < 0.6 * no_cp.memory.activations  # each rank keeps half the tokens
    assert plan.cfg.grad_accum == 2 * no_cp.cfg.grad_accum == 32  # 64 samples over dp 2, not 4


def test_a_ring_across_nodes_costs_time_the_same_ring_inside_one_does_not():
    inside = api.estimate("llama-3.1-8b", api.load_cluster("dgx-h100", 2), framework="megatron", tp=1, cp=2,
                          seq_len=8192, global_batch=16)
    across = api.estimate("llama-3.1-8b", api.load_cluster("dgx-h100", 2), framework="megatron", tp=8, cp=2,
                          seq_len=8192, global_batch=16)
    assert inside.time.cp_comm == 0.0  # NVLink: each K/V step hides under its attention
    assert across.time.cp_comm > 0.0


@pytest.mark.parametrize(("knobs", "seq", "needle"), [
    ({"cp": 2, "framework": "megatron"}, 8190, "does not split into 4 equal chunks"),
    ({"cp": 8, "tp": 2, "cp_comm": "a2a", "framework": "megatron"}, 8192, "does not divide them"),
    ({"cp": 2, "framework": "deepspeed"}, 8192, "its context parallelism is DeepSpeed Ulysses"),
    ({"cp": 2, "cp_comm": "a2a", "framework": "deepspeed", "pp": 2}, 8192, "without a pipeline"),
    ({"cp": 3, "framework": "megatron"}, 8192, "does not divide the 16 GPUs"),
])
def test_rules(knobs, seq, needle):
    with pytest.raises(UserError, match=needle):
        api.estimate("llama-3.1-8b", api.load_cluster("dgx-h100", 2), seq_len=seq, global_batch=8, **knobs)


def test_no_flash_attention_and_vision_models_are_refused():
    with pytest.raises(UserError, match="needs fused"):
        api.estimate("llama-3.1-8b", api.load_cluster("dgx-h100", 1), framework="megatron", cp=2, seq_len=8192,
                     global_batch=8, flash_attention=False)
    with pytest.raises(UserError, match="vision-language"):
        api.estimate("deepseek-vl2-tiny", api.load_cluster("dgx-h100", 1), framework="megatron", cp=2,
                     global_batch=8)


def test_estimate_cli_names_the_flag_and_exits_2():
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--framework",
                                  "megatron", "--cp", "2", "--seq-len", "8190", "--global-batch", "8"])
    assert r.exit_code == 2 and "--seq-len 8190" in r.output and "--cp 2" in r.output
    assert "Traceback" not in r.output


def test_the_splits_a_search_tries():
    assert context_splits(Constraints(), LLAMA, 2048, True, 8) == [(1, "p2p")]
    assert context_splits(Constraints(), LLAMA, 8192, True, 8) == [(1, "p2p"), (2, "p2p"), (2, "a2a"), (4, "p2p"),
                                                                      (4, "a2a")]
    assert context_splits(Constraints(), LLAMA, 8192, True, 2) == [(1, "p2p"), (2, "p2p"), (2, "a2a")]
    assert context_splits(Constraints(), LLAMA, 8192, False, 8) == [(1, "p2p")]
    assert context_splits(Constraints(cp=(2,), cp_comm=("a2a+p2p",)), LLAMA, 4096, True, 8) == [(2, "a2a+p2p")]
    with pytest.raises(UserError, match="does not split"):
        context_splits(Constraints(cp=(2,)), LLAMA, 4094, True, 8)
    with pytest.raises(UserError, match="cannot divide the 8 GPUs"):
        context_splits(Constraints(cp=(3,)), LLAMA, 8192, True, 8)


def test_suggest_pins_cp_and_ranks_the_splits_together():
    cluster = api.load_cluster("dgx-h100", 1)
    pinned = api.suggest("llama-3.1-8b", cluster, seq_len=8192, global_batch=64, cp=2, framework="megatron", top=3)
    assert {rp.plan.cfg.cp for rp in pinned.plans} == {2}
    assert all(rp.plan.cfg.dp * rp.plan.cfg.tp * rp.plan.cfg.pp * 2 == 8 for rp in pinned.plans)
    free = api.suggest("llama-3.1-8b", cluster, seq_len=8192, global_batch=64, framework="megatron", top=40)
    assert {rp.plan.cfg.cp for rp in free.plans} > {1}  # the CP splits are searched and ranked with the rest
    steps = [rp.plan.step_time_s for rp in free.plans]
    assert steps == sorted(steps)


def test_suggest_table_shows_the_cp_column():
    r = CliRunner().invoke(main, ["suggest", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--seq-len", "8192",
                                  "--global-batch", "64", "--cp", "2", "--cp-comm", "a2a", "--framework", "megatron",
                                  "--top", "2"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("#"))
    assert " cp " in header
    assert "cp 2a = context parallel over 2 ranks, a2a" in " ".join(r.output.split())


def test_generate_emits_megatron_cp(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--seq-len", "8192",
                                  "--global-batch", "64", "--cp", "2", "--framework", "megatron", "--cp-comm", "p2p",
                                  "--entry", str(script), "--out", str(out)])
    assert r.exit_code == 0, r.output
    args = (out / "megatron_args.sh").read_text()
    assert "--context-parallel-size 2" in args and "--cp-comm-type p2p" in args
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cp"] == 2 and plan["dp"] * plan["tp"] * plan["pp"] * 2 == 8


def test_the_reference_trainer_refuses_cp(tmp_path):
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--seq-len", "8192",
                                  "--global-batch", "64", "--cp", "2", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "--cp 2" in r.output and "context-parallel" in r.output
    assert not (tmp_path / "run").exists()


def test_hierarchical_and_ulysses_flags(tmp_path):
    from planner.emit.megatron_args import megatron_deepspeed_args, megatron_lm_args
    from planner.emit.plan_file import PlanFile

    model = api.load_model("llama-3.1-8b")
    base = dict(model="llama-3.1-8b", hardware="dgx-h100", nodes=2, gpus_per_node=8, micro_batch=1, seq_len=8192)
    hier = PlanFile(**base, framework="megatron", dp=1, tp=4, cp=4, cp_comm="a2a+p2p", global_batch=8, grad_accum=8)
    def shown(args) -> str:
        return " ".join(a.flag if a.value is None else f"{a.flag} {a.value}" for a in args)

    flags = shown(megatron_lm_args(model, hier))
    # tp 4 leaves two CP ranks per 8-GPU node: a2a over those two, the ring over the two nodes
    assert "--hierarchical-context-parallel-sizes 2 2" in flags and "--cp-comm-type a2a+p2p" in flags
    ulysses = PlanFile(**base, framework="megatron-deepspeed", dp=4, cp=4, cp_comm="a2a", zero_stage=1,
                       global_batch=8, grad_accum=2)
    text = shown(megatron_lm_args(model, ulysses) + megatron_deepspeed_args(model, ulysses))
    assert "--ds-sequence-parallel-size 4" in text and "--context-parallel-size" not in text


_DS_CHECK = r"""
import json, os, sys
import torch.multiprocessing as mp


def run(rank, world, port, path, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    c = DeepSpeedConfig(json.load(open(path)))
    if rank == 0:
        json.dump({"world_size": c.world_size, "train_batch_size": c.train_batch_size}, open(out, "w"))


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]), nprocs=int(sys.argv[1]))
"""


def test_deepspeed_reads_the_ulysses_degree_as_deepspeed_does(tmp_path):
    """DeepSpeedConfig, on a real 4-process gloo group, takes the data-parallel world as world /
    sequence_parallel_size: the emitted batch sizes then hold."""
    import os
    import socket
    import subprocess
    import sys

    from planner.emit.ds_config import build_ds_config
    from planner.emit.plan_file import PlanFile

    plan = PlanFile(model="llama-3.1-8b", hardware="dgx-h100", nodes=1, gpus_per_node=4, framework="deepspeed",
                    dp=2, cp=2, cp_comm="a2a", zero_stage=2, micro_batch=1, grad_accum=4, global_batch=8, seq_len=8192)
    config = build_ds_config(plan, api.load_model("llama-3.1-8b"))
    assert config["sequence_parallel_size"] == 2
    path, out, script = tmp_path / "ds.json", tmp_path / "out.json", tmp_path / "check.py"
    path.write_text(json.dumps(config))
    script.write_text(_DS_CHECK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(script), "4", str(port), str(path), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got == {"world_size": 2, "train_batch_size": 8}
