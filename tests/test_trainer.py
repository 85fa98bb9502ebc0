"""The reference trainer (planner.run.trainer) with real DeepSpeed on CPU.

Every ``deepspeed``-marked test starts the real ``deepspeed`` launcher with two CPU ranks
(gloo) on a tiny-scale model for a few steps and checks what the run wrote: per-rank metrics,
what each rank built (run_info), checkpoints. The first test in a fresh machine JIT-builds
DeepSpeed's comm op (a few minutes); later runs, and `dsplan run --local`, reuse the cache
planner.run.local.extensions_dir names (tests/conftest.py).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from planner.emit.plan_file import PlanFile
from planner.errors import UserError
from planner.model.load import load_model
from planner.run import checkpoint
from planner.run.data import SyntheticData
from planner.run.metrics import metrics_path
from planner.run.model_scale import SMALL, TINY, parse_scale, scale_spec
from planner.run.rundir import read_plan
from tests.conftest_deepspeed import (
    DEEPSPEED,
    LAUNCH_TIMEOUT_S,
    REPO_ROOT,
    free_port,
    launcher_env,
    llama_like,
    make_run_dir,
    moe_like,
    read_info,
    read_metrics,
    run_deepspeed,
    vl2_like,
)

FAST_LR = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
STEPS = 4


def assert_trained(run_dir: Path, steps: int = STEPS, ranks: int = 2) -> list[float]:
    """Both ranks logged every step, the loss is finite, falls, and is the same on every rank."""
    per_rank = [read_metrics(run_dir, r) for r in range(ranks)]
    for rank, records in enumerate(per_rank):
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        assert all(r["rank"] == rank for r in records)
        for r in records:
            assert math.isfinite(r["loss"]) and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
            assert r["peak_memory_bytes"] > 50 * 2**20  # a Python process with torch: tens of MiB at least
    losses = [r["loss"] for r in per_rank[0]]
    for records in per_rank[1:]:
        assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)
    assert losses[-1] < losses[0], losses
    assert 4.0 < losses[0] < 7.5  # ~ln(512) at the start: tiny vocabulary, untrained model
    return losses


# -- fast checks (no launcher) -------------------------------------------------------------

def test_scale_keeps_structure_and_maps_the_planners_stages():
    spec = vl2_like(vit_layers=6, layers=4)  # 16 blocks
    scaled = scale_spec(spec, TINY, [(0, 5), (5, 16)])
    kinds = [b.kind for b in scaled.spec.blocks]
    assert kinds == ["vision_embed", "vision", "vision", "vision", "vision", "norm", "projector", "embedding",
                     "decoder", "decoder", "decoder", "norm", "lm_head"]
    # stage 0 (vision_embed + 4 ViT blocks) keeps 2 ViT blocks; stage 1 keeps its own 2
    assert scaled.parts == [0, 3, 13]
    assert [scaled.origin[i] for i in range(scaled.parts[1])] == [0, 1, 2]
    assert all(scaled.origin[i] >= 5 for i in range(scaled.parts[1], len(kinds)))
    dense, *moe = scaled.spec.decoder_blocks
    assert not dense.is_moe and all(b.is_moe for b in moe)
    assert moe[0].mlp.routed_experts == 4 and moe[0].mlp.top_k == 2 and moe[0].mlp.shared_ffn > 0
    assert scaled.spec.hidden == 64 and scaled.spec.vocab == 512
    assert scaled.spec.vision.patches_per_tile == 16 and scaled.spec.vision.tokens_per_tile == 4


def test_scale_keeps_gqa_and_gives_each_tp_rank_a_kv_head():
    spec = llama_like(layers=8)
    tiny = scale_spec(spec, TINY, tp=2).spec.decoder_blocks[0].attention
    assert (tiny.kind, tiny.heads, tiny.kv_heads) == ("gqa", 4, 2)
    small = scale_spec(spec, SMALL).spec
    assert small.hidden == 128 and small.num_layers == 4
    full = scale_spec(spec, parse_scale("1")).spec
    assert full.total_params() == spec.total_params()  # F = 1 is the real model
    half = scale_spec(spec, parse_scale("0.5")).spec
    assert half.num_layers == 4 and half.hidden == 2048


def test_scale_rejects_a_partition_for_another_model():
    with pytest.raises(UserError, match="stage_blocks ends at block 9"):
        scale_spec(llama_like(layers=8), TINY, [(0, 4), (4, 9)])
    with pytest.raises(UserError, match="--scale"):
        parse_scale("huge")


def test_synthetic_data_is_a_function_of_step_micro_and_dp_rank():
    data = SyntheticData(vocab=512, seq_len=32, micro_batch=2, image_tokens=8, tiles=3, patches_per_tile=16,
                         patch_pixels=12)
    (tokens, tiles), labels = data.batch(5, 1, 0)
    (tokens2, tiles2), labels2 = data.batch(5, 1, 0)
    assert tokens.equal(tokens2) and tiles.equal(tiles2) and labels.equal(labels2)
    assert not data.batch(5, 1, 1)[0][0].equal(tokens)  # another data-parallel rank, another batch
    assert not data.batch(6, 1, 0)[0][0].equal(tokens)
    assert tokens.shape == (2, 32) and tiles.shape == (2, 3, 16, 12)
    assert (labels[:, :8] == -100).all() and labels[:, 8:].equal(data.batch(5, 1, 0)[1][:, 8:])
    assert labels[:, 8:-1].eq(tokens[:, 9:]).all()  # labels are the next tokens


def test_plan_file_validation_and_metrics_names(tmp_path):
    fields = {"model": "m", "nodes": 1, "gpus_per_node": 2, "dp": 1, "pp": 2, "micro_batch": 1, "global_batch": 1,
              "seq_len": 32}
    plan = PlanFile.model_validate({**fields, "stage_blocks": [[0, 3], [3, 7]], "planner_extra": 1})
    assert plan.stage_blocks == [(0, 3), (3, 7)] and plan.world_size == 2
    with pytest.raises(ValueError, match="contiguous"):
        PlanFile.model_validate({**fields, "stage_blocks": [[0, 3], [4, 7]]})
    with pytest.raises(ValueError, match="start at block 0"):
        PlanFile.model_validate({**fields, "stage_blocks": [[1, 3], [3, 7]]})
    assert metrics_path(tmp_path / "metrics.jsonl", 3) == tmp_path / "metrics.rank3.jsonl"
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(UserError, match="plan.json: not valid JSON"):
        read_plan(tmp_path)


def test_latest_good_ignores_unpublished_checkpoints(tmp_path):
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / checkpoint.COMPLETE).write_text("2\n")
    (tmp_path / "step_00000004").mkdir()  # saved by the ranks, never published
    (tmp_path / checkpoint.LATEST).write_text("step_00000004\n")
    assert checkpoint.latest_good(tmp_path) is None  # a pointer to an incomplete tag is not trusted
    (tmp_path / checkpoint.LATEST).write_text("step_00000002\n")
    assert checkpoint.latest_good(tmp_path) == "step_00000002"


def test_trainer_bad_run_dir_exits_2_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "planner.run.trainer", "--run-dir", str(tmp_path)],
                          cwd=REPO_ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a run directory" in proc.stderr and "Traceback" not in proc.stderr


# -- real DeepSpeed runs -------------------------------------------------------------------

@pytest.mark.deepspeed
@pytest.mark.parametrize("stage, recompute, grad_accum", [(1, "none", 2), (2, "none", 1), (3, "full", 1)])
def test_zero_stages(tmp_path, stage, recompute, grad_accum):
    run_dir = make_run_dir(tmp_path / "run", llama_like(), FAST_LR, zero_stage=stage, recompute=recompute,
                           grad_accum=grad_accum)
    proc = run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    info = read_info(run_dir, 0)
    assert info["zero_stage"] == stage and info["recompute"] == recompute
    # DeepSpeed's CPU all-reduce buffers (66 MB of RAM per rank) do not outlive the job.
    assert proc.shm_left == 0
    records = read_metrics(run_dir, 0)
    assert records[0]["tokens"] == 2 * grad_accum * 2 * 32  # micro x accumulation x dp x seq
    assert "step 4/4 loss" in (run_dir / "launcher.log").read_text()


@pytest.mark.deepspeed
def test_zero2_with_optimizer_offload(tmp_path):
    cfg = dict(FAST_LR, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    run_dir = make_run_dir(tmp_path / "run", llama_like(), cfg, zero_stage=2, recompute="selective")
    run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    info = read_info(run_dir, 0)
    assert info["basic_optimizer"] == "DeepSpeedCPUAdam" and info["recompute"] == "selective"


@pytest.mark.deepspeed
def test_pipeline_uses_the_planners_partition(tmp_path):
    spec = llama_like(layers=8)  # blocks: embedding, 8 decoders, norm, head
    run_dir = make_run_dir(tmp_path / "run", spec, FAST_LR, dp=1, pp=2, zero_stage=1, grad_accum=2,
                           stage_blocks=[[0, 3], [3, 11]])
    run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    expected = scale_spec(spec, TINY, [(0, 3), (3, 11)]).parts
    assert expected == [0, 3, 7]  # stage 0: embedding + 2 decoders; stage 1: 2 decoders, norm, head
    for rank in (0, 1):
        info = read_info(run_dir, rank)
        assert info["pipeline_parts"] == expected  # what DeepSpeed's PipelineModule used
        assert info["pipeline_stage"] == rank
        assert info["local_layers"] == expected[rank:rank + 2]
    assert read_info(run_dir, 0)["layer_kinds"][:3] == ["embedding", "decoder", "decoder"]


@pytest.mark.deepspeed
def test_autotp_shards_attention_and_mlp(tmp_path):
    spec = llama_like()
    run_dir = make_run_dir(tmp_path / "run", spec, FAST_LR, dp=1, tp=2, zero_stage=1)
    run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    full = scale_spec(spec, TINY, tp=2).spec
    sharded = sum(b.attention.params(b.hidden) + b.mlp.params(b.hidden) for b in full.decoder_blocks)
    head = full.blocks[-1]
    sharded += head.vocab * head.hidden  # the untied LM head, split by vocabulary
    infos = [read_info(run_dir, r) for r in (0, 1)]
    assert all(i["dp_rank"] == 0 and i["tp_size"] == 2 for i in infos)  # one TP group, same batches
    # each rank holds half of every decoder block's projections and of the LM head, the rest replicated
    assert infos[0]["params_on_rank"] == full.total_params() - sharded // 2


@pytest.mark.deepspeed
def test_moe_expert_parallel_2(tmp_path):
    run_dir = make_run_dir(tmp_path / "run", moe_like(), FAST_LR, zero_stage=2, ep=2)
    run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    info = read_info(run_dir, 0)
    # tiny scale: 4 routed experts per MoE layer, 2 on each rank; 2 MoE layers kept
    assert info["moe_local_experts"] == [2, 2] and info["ep_size"] == 2


@pytest.mark.deepspeed
def test_deepseek_vl2_preset_with_pipeline_2(tmp_path):
    """The catalog's deepseek-vl2 (SigLIP tower, projector, MLA, dense then MoE) at tiny scale, pp=2."""
    spec = load_model("deepseek-vl2")
    n = len(spec.blocks)  # 63: vision_embed, 27 ViT, norm, projector, embedding, 30 decoders, norm, head
    stages = [(0, 36), (36, n)]  # the tower, projector, embedding and 5 decoders on stage 0
    run_dir = make_run_dir(tmp_path / "run", spec, FAST_LR, model="deepseek-vl2", dp=1, pp=2, zero_stage=0,
                           grad_accum=2, seq_len=48, stage_blocks=[list(s) for s in stages],
                           images_per_sample=1, tiles_per_image=2)
    run_deepspeed(run_dir, "--steps", str(STEPS))
    assert_trained(run_dir)
    info0, info1 = read_info(run_dir, 0), read_info(run_dir, 1)
    assert info0["model"] == "deepseek-vl2"
    assert info0["pipeline_parts"] == info1["pipeline_parts"] == scale_spec(spec, TINY, stages).parts == [0, 9, 13]
    assert info0["layer_kinds"][:9] == ["vision_embed", "vision", "vision", "norm", "projector", "embedding",
                                        "decoder", "decoder", "decoder"]
    assert info0["image_tokens"] == (2 + 1) * 4  # 2 local tiles + the global view, 4 tokens per tile
    assert info0["moe_local_experts"] == [4, 4] and info1["moe_local_experts"] == [4, 4]


@pytest.mark.deepspeed
def test_two_nodes_on_localhost(tmp_path):
    run_dir = make_run_dir(tmp_path / "run", llama_like(), FAST_LR, zero_stage=2, nodes=2, gpus_per_node=1)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(free_port())
    procs = [subprocess.Popen([DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                               "--master_addr", "127.0.0.1", "--master_port", port, "--module", "planner.run.trainer",
                               "--run-dir", str(run_dir), "--steps", str(STEPS)],
                              cwd=REPO_ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # each launcher's session: its ranks too
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "step 4/4 loss" in outputs[0]  # rank 0 lives on node 0
    assert_trained(run_dir)
    assert [read_info(run_dir, r)["world_size"] for r in (0, 1)] == [2, 2]


@pytest.mark.deepspeed
def test_checkpoint_resume_continues_step_and_loss(tmp_path):
    spec = llama_like()
    straight = make_run_dir(tmp_path / "straight", spec, FAST_LR, zero_stage=2)
    run_deepspeed(straight, "--steps", "6")
    reference = [r["loss"] for r in read_metrics(straight, 0)]

    run_dir = make_run_dir(tmp_path / "run", spec, FAST_LR, zero_stage=2)
    ckpt = run_dir / "checkpoints"
    crashed = run_deepspeed(run_dir, "--steps", "6", "--checkpoint-every", "2", "--fault", "save",
                            "--fault-step", "4", check=False)
    assert crashed.returncode != 0
    # step 4's files are on disk but it was never published: the good one is still step 2
    assert (ckpt / "step_00000004").is_dir() and not checkpoint.is_complete(ckpt, "step_00000004")
    assert checkpoint.latest_good(ckpt) == "step_00000002"

    run_deepspeed(run_dir, "--steps", "6", "--checkpoint-every", "2", "--resume")
    info = read_info(run_dir, 0)
    assert info["resumed_from"] == "step_00000002" and info["start_step"] == 2
    records = read_metrics(run_dir, 0)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 3, 4, 5, 6]  # crashed after 4, resumed at 3
    resumed = [r["loss"] for r in records[4:]]
    assert resumed == pytest.approx(reference[2:], rel=1e-4)  # same weights, optimizer state, data
    assert checkpoint.latest_good(ckpt) == "step_00000006"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]  # keep 2
    assert all(checkpoint.is_complete(ckpt, p.name) for p in ckpt.glob("step_*"))

    # The newest checkpoint damaged after it was published (a truncated file): the restart falls
    # back to the one before it, and the steps after it run again with the losses they had.
    victim = max((p for p in (ckpt / "step_00000006").rglob("*.pt")), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert not checkpoint.is_readable(ckpt, "step_00000006") and checkpoint.is_readable(ckpt, "step_00000004")
    run_deepspeed(run_dir, "--steps", "6", "--checkpoint-every", "2", "--resume")
    info = read_info(run_dir, 0)
    assert info["resumed_from"] == "step_00000004" and info["start_step"] == 4
    records = read_metrics(run_dir, 0)
    assert [r["step"] for r in records[8:]] == [5, 6]
    assert [r["loss"] for r in records[8:]] == pytest.approx(reference[4:], rel=1e-4)


@pytest.mark.deepspeed
def test_a_second_copy_is_what_a_restart_falls_back_to(tmp_path):
    spec = llama_like()
    run_dir = make_run_dir(tmp_path / "run", spec, FAST_LR, zero_stage=1)
    ckpt, copy = run_dir / "checkpoints", tmp_path / "copy"
    run_deepspeed(run_dir, "--steps", "2", "--checkpoint-every", "2", "--checkpoint-copy", str(copy))
    assert checkpoint.is_readable(copy, "step_00000002") and checkpoint.latest_good(copy) == "step_00000002"
    assert checkpoint.manifest(copy / "step_00000002") == checkpoint.manifest(ckpt / "step_00000002")
    import shutil

    shutil.rmtree(ckpt)  # the first location lost
    run_deepspeed(run_dir, "--steps", "3", "--resume", "--checkpoint-copy", str(copy))
    info = read_info(run_dir, 0)
    assert info["resumed_from"] == "step_00000002" and info["start_step"] == 2
    assert [r["step"] for r in read_metrics(run_dir, 0)] == [1, 2, 3]
