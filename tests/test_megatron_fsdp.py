"""Megatron-FSDP: ``--framework megatron --zero 3`` shards weights, gradients and optimizer
states over the DP x CP group, gathers each block per micro-batch, and launches with
Megatron-LM's FSDP flags."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.model.catalog import load_model

EMBED = 128256 * 4096  # Llama-3-8B's embedding and (untied) output layer: its largest blocks
SHAPE = {"micro_batch": 1, "global_batch": 64, "seq_len": 4096}


def _estimate(**kw):
    cluster = api.load_cluster("dgx-h100", nodes=kw.pop("nodes", 1))
    return api.estimate("llama-3-8b", cluster, framework="megatron", **{**SHAPE, **kw})


def test_model_states_shard_16_bytes_per_parameter_and_two_blocks_stay_gathered():
    params = load_model("llama-3-8b").total_params()
    m = _estimate(zero=3).stages[0].memory
    # bf16 weights and gradients (main-grads dtype "auto"), fp32 main weights + Adam moments,
    # all over 8 ranks; the unit computing and the one prefetched are whole (2 bytes each).
    assert m.weights == pytest.approx(2 * params / 8 + 2 * 2 * EMBED, rel=1e-9)
    assert m.grads == pytest.approx(2 * params / 8 + 2 * 2 * EMBED, rel=1e-9)
    assert m.optimizer == pytest.approx(12 * params / 8, rel=1e-9)
    dist_opt = _estimate(zero=1).stages[0].memory  # weights whole, fp32 main_grad whole
    assert dist_opt.weights == pytest.approx(2 * params, rel=1e-9)
    assert dist_opt.grads == pytest.approx(4 * params, rel=1e-9)


def test_the_group_is_dp_times_cp():
    params = load_model("llama-3-8b").total_params()
    m = _estimate(zero=3, nodes=2, cp=2, seq_len=8192).stages[0].memory
    assert m.optimizer == pytest.approx(12 * params / 16, rel=1e-9)


def test_fp8_parameter_gather_keeps_one_byte_shards_and_moves_less():
    on = _estimate(zero=3, nodes=4, precision="fp8-tensorwise")
    off = _estimate(zero=3, nodes=4, precision="fp8-tensorwise", fp8_param_gather=False)
    assert on.stages[0].memory.weights < off.stages[0].memory.weights
    assert on.time.dp_comm <= off.time.dp_comm


def test_exposed_gathers_grow_with_the_group_and_hide_behind_compute():
    """Per-block all-gathers (forward and backward) and reduce-scatters are priced against the
    micro-batch's compute: on one node they hide, on 32 nodes with a short micro-batch they show."""
    near = _estimate(zero=3, micro_batch=1, seq_len=4096)
    far = _estimate(zero=3, nodes=32, micro_batch=1, seq_len=1024, global_batch=256)
    assert near.time.dp_comm == 0.0
    assert far.time.dp_comm > 0.0


@pytest.mark.parametrize("args, words", [
    (["--zero", "2"], "not ZeRO-2"),
    (["--zero", "3", "--offload", "optimizer"], "Megatron-FSDP"),
    (["--zero", "3", "--pp", "2"], "without a pipeline"),
])
def test_what_megatron_fsdp_cannot_run_is_one_clear_error(args, words):
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--nodes", "2",
                                  "--framework", "megatron", *args])
    assert r.exit_code == 2, r.output
    assert words in r.output and "--zero" in r.output and "Traceback" not in r.output


def test_generate_refuses_megatron_zero_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                                  "megatron", "--zero", "2", "--dp", "8", "--out", str(out)])
    assert r.exit_code == 2 and "not ZeRO-2" in r.output and not out.exists()


def test_generate_writes_megatron_fsdp_flags_and_leaves_queues_free(tmp_path):
    out, entry = tmp_path / "run", tmp_path / "pretrain_gpt.py"
    entry.write_text("# Megatron-LM's entry point stands here\n")
    r = CliRunner().invoke(main, ["generate", "--entry", str(entry), "--model", "llama-3-8b", "--hardware", "dgx-h100",
                                  "--nodes", "2", "--framework", "megatron", "--zero", "3", "--tp", "2",
                                  "--sequence-parallel", "--precision", "fp8-tensorwise", "--out", str(out)])
    assert r.exit_code == 0, r.output
    args = (out / "megatron_args.sh").read_text()
    for flag in ("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                 "--ckpt-format fsdp_dtensor", "--init-model-with-meta-device", "--fp8-param-gather"):
        assert flag in args, flag
    assert "--use-distributed-optimizer" not in args  # Megatron-FSDP v1 sets it itself
    # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 under Megatron-FSDP, even with TP.
    env = (out / "nccl.env").read_text()
    assert 'CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"' in env and "CONNECTIONS:-1}" not in env
    assert json.loads((out / "plan.json").read_text())["zero_stage"] == 3


def test_suggest_picks_fsdp_where_the_distributed_optimizer_does_not_fit():
    """Llama-3-8B at 8K tokens on 8 H100 without TP or recompute: the distributed optimizer's
    whole weights and fp32 gradients (~45 GiB) leave no room; FSDP's shards do."""
    cluster = api.load_cluster("dgx-h100", nodes=1)
    out = api.suggest("llama-3-8b", cluster, framework="megatron", tp=1, pp=1, micro_batch=1, recompute="none",
                      precision="fp8-tensorwise", global_batch=128, seq_len=8192, top=3)
    assert out.plans and out.plans[0].plan.cfg.zero_stage == 3


def test_fsdp2_reduces_fp32_gradients_megatron_fsdp_its_own_dtype():
    """The wire bytes of the gradient reduce-scatter: torchtitan's FSDP2 reduces in fp32
    (mixed_precision_reduce), Megatron-FSDP in bf16 ("auto"); Megatron's distributed optimizer
    reduces its fp32 main_grad."""
    from planner.cost.context import CostContext
    from planner.cost.parallel import FRAMEWORKS, Workload

    cluster = api.load_cluster("dgx-h100", nodes=1)
    ctx = CostContext.of(cluster, Workload(global_batch=64, seq_len=4096))
    assert ctx.grad_bytes(FRAMEWORKS.index("torchtitan"), zero=3) == 4
    assert ctx.grad_bytes(FRAMEWORKS.index("megatron"), zero=3) == 2
    assert ctx.grad_bytes(FRAMEWORKS.index("megatron"), zero=1) == 4
