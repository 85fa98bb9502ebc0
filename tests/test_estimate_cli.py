"""dsplan estimate: JSON keys, human tables, and exit 2 on every broken rule."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner.cli import main

BASE = ["estimate", "--model", "llama-3-8b", "--nodes", "1"]


def run(*args: str):
    return CliRunner().invoke(main, [*BASE, *args])


def test_json_keys_and_values():
    r = run("--tp", "2", "--micro-batch", "1", "--global-batch", "64", "--recompute", "full", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    for key in ("fits", "memory", "step_time_s", "time", "tokens_per_s", "tflops_per_gpu", "mfu", "stages",
                "stage_blocks", "dp", "tp", "pp", "ep", "zero_stage", "offload", "micro_batch", "grad_accum",
                "recompute", "sequence_parallel", "virtual_stages", "framework", "global_batch", "seq_len"):
        assert key in d, key
    for key in ("peak_bytes", "weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes"):
        assert d["memory"][key] > 0, key
    assert "cpu_bytes_per_node" not in d["memory"]
    assert set(d["time"]) == {"compute_s", "recompute_s", "tp_comm_s", "pp_bubble_s", "pp_comm_s", "dp_comm_s",
                              "ep_comm_s", "cp_comm_s", "optimizer_s", "act_offload_s"}
    assert d["dp"] == 4 and d["grad_accum"] == 16 and d["seq_len"] == 8192 and d["zero_stage"] == 1
    assert d["stage_blocks"] == [[0, 35]]
    assert d["fits"] is True and 0 < d["mfu"] < 1
    assert d["step_time_s"] == pytest.approx(sum(d["time"].values()))


def test_pipeline_json_stages_and_uneven_layers():
    r = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-72b", "--nodes", "12", "--tp", "8", "--pp", "12",
                                  "--micro-batch", "1", "--global-batch", "96", "--recompute", "full",
                                  "--framework", "megatron", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    layers = [s["decoder_layers"] for s in d["stages"]]
    assert sum(layers) == 80 and layers[0] == 6 and layers[-1] == 6 and max(layers) == 7
    assert d["stage_blocks"][0][0] == 0 and d["stage_blocks"][-1][1] == 83
    # the last rank's 152k-vocab head is worth about one more layer; the first rank's
    # embedding lookup is nearly free, so its 6 layers make it the lightest
    totals = [s["microbatch_time"]["total_s"] for s in d["stages"]]
    assert totals[0] == min(totals)
    assert totals[-1] > 1.1 * totals[0]


def test_offload_reports_cpu_memory():
    r = run("--micro-batch", "1", "--global-batch", "64", "--zero", "2", "--offload", "optimizer",
            "--recompute", "full", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["memory"]["cpu_bytes_per_node"] > 0 and d["memory"]["optimizer_bytes"] == 0


def test_explicit_partition():
    r = CliRunner().invoke(main, ["estimate", "--model", "llama-2-7b", "--nodes", "1", "--pp", "2",
                                  "--micro-batch", "1", "--global-batch", "16", "--stage-blocks", "0-20,20-35",
                                  "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stage_blocks"] == [[0, 20], [20, 35]]


def test_human_output_tables():
    r = run("--tp", "2", "--micro-batch", "1", "--global-batch", "64", "--recompute", "full")
    assert r.exit_code == 0, r.output
    for text in ("Memory per GPU", "Step time", "compute", "tokens/s", "MFU"):
        assert text in r.output


def test_a_batch_bound_plan_gets_the_same_note_as_in_suggest():
    r = run("--tp", "2", "--pp", "4", "--nodes", "2", "--global-batch", "4", "--framework", "megatron", "--zero", "1")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "note: the pipeline bubble is" in out and "runs 2 micro-batches per step over 4 stages" in out
    assert "--global-batch 24 " in out and "12 micro-batches" in out
    quiet = run("--tp", "2", "--micro-batch", "1", "--global-batch", "64")
    assert quiet.exit_code == 0 and "note:" not in quiet.output


def test_an_interleaved_plan_names_its_micro_batch_group_when_pp_does_not_divide_the_micro_batches():
    args = ("--framework", "megatron", "--tp", "2", "--pp", "4", "--virtual-stages", "2", "--micro-batch", "1")
    r = run(*args, "--global-batch", "6")
    assert r.exit_code == 0, r.output
    assert "pp 4 (v 2, micro-batch group 6)" in " ".join(r.output.split())
    even = run(*args, "--global-batch", "8")
    assert even.exit_code == 0 and "pp 4 (v 2)," in " ".join(even.output.split())
    few = run(*args, "--global-batch", "3")
    assert few.exit_code == 2 and "needs at least --pp 4 micro-batches per step, not 3" in " ".join(few.output.split())


def test_vlm_defaults():
    r = CliRunner().invoke(main, ["estimate", "--model", "deepseek-vl2-tiny", "--nodes", "1", "--micro-batch", "1",
                                  "--global-batch", "8", "--ep", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["images_per_sample"] >= 1 and d["tiles_per_image"] >= 1


@pytest.mark.parametrize("args,needle", [
    (["--gpus-per-node", "100000"], "--gpus-per-node: need a whole number from 1 to 576"),
    (["--gpus-per-node", "0"], "--gpus-per-node: need a whole number from 1 to 576"),
    (["--tp", "3"], "does not divide the 8 GPUs"),
    (["--dp", "3", "--tp", "2"], "multiply"),
    (["--tp", "8", "--dp", "1", "--micro-batch", "3", "--global-batch", "8"], "not divisible"),
    (["--ep", "2"], "mixture-of-experts"),
    (["--zero", "3", "--tp", "2", "--global-batch", "64"], "AutoTP"),
    (["--pp", "2", "--zero", "2", "--global-batch", "64"], "PipelineModule"),
    (["--tp", "2", "--sequence-parallel", "--global-batch", "64"], "sequence parallel"),
    (["--framework", "megatron", "--zero", "2", "--global-batch", "64"], "distributed optimizer"),
    (["--framework", "megatron", "--zero", "3", "--pp", "2", "--global-batch", "64"], "Megatron-FSDP"),
    (["--sequence-parallel", "--global-batch", "64"], "tp > 1"),
    (["--offload", "optimizer", "--zero", "0", "--global-batch", "64"], "ZeRO"),
    (["--offload", "optimizer", "--zero", "2", "--optimizer", "sgd", "--global-batch", "64"],
     "optimizer offload steps Adam on the CPU, not sgd"),
    (["--framework", "megatron", "--zero", "1", "--offload", "optimizer", "--precision", "fp16",
      "--global-batch", "64"],
     "built for bf16 training, not fp16"),
    (["--framework", "megatron", "--zero", "1", "--offload", "optimizer+params", "--global-batch", "64"],
     "parameter offload needs ZeRO-3"),
    (["--seq-len", "999999", "--global-batch", "64"], "maximum context"),
    (["--pp", "2", "--stage-blocks", "0-10", "--global-batch", "64"], "partition"),
])
def test_bad_input_exits_2_with_the_rule(args, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    if needle:
        assert needle in r.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--tiles-per-image", "9999"], "--tiles-per-image 9999 exceeds deepseek-vl2's 9 local tiles per image"),
    # 8 images x (9 local + 1 global) tiles x 196 tokens = 15,680 > 4,096
    (["--images-per-sample", "8", "--tiles-per-image", "9"],
     "--images-per-sample 8 x --tiles-per-image 9 take at least 15,680 of the 4,096 tokens"),
    (["--images-per-sample", "-1"], "--images-per-sample: need a whole number >= 0"),
])
@pytest.mark.parametrize("command", ["estimate", "suggest"])
def test_estimate_and_suggest_share_the_vision_rules(command, args, needle):
    r = CliRunner().invoke(main, [command, "--model", "vl2", "--nodes", "8", "--zero", "2", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_images_that_just_fit_the_sequence_are_accepted():
    # 2 x (9 + 1) x 196 = 3,920 image tokens leave 176 of 4,096 for text (a plan too big for
    # memory, which --allow-oom takes: this is about the inputs)
    r = CliRunner().invoke(main, ["estimate", "--model", "vl2", "--nodes", "8", "--zero", "2",
                                  "--images-per-sample", "2", "--tiles-per-image", "9", "--allow-oom", "--json"])
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["images_per_sample"], json.loads(r.stdout)["tiles_per_image"]) == (2, 9)


@pytest.mark.parametrize("framework", ["deepspeed", "megatron-deepspeed"])
def test_deepspeed_moe_refuses_zero3(framework):
    """DeepSpeed 0.19 asserts 'Native DeepSpeed MoE is not supported with ZeRO Stage 3' when the
    engine starts: the planner refuses the plan up front and never ranks one."""
    r = CliRunner().invoke(main, ["estimate", "--model", "mixtral-8x7b", "--nodes", "2", "--zero", "3", "--ep", "8",
                                  "--framework", framework, "--global-batch", "64"])
    assert r.exit_code == 2, r.output
    assert f"framework {framework}: DeepSpeed's MoE layers do not run under ZeRO-3" in r.output
    s = CliRunner().invoke(main, ["suggest", "--model", "mixtral-8x7b", "--nodes", "4", "--top", "20", "--json"])
    assert s.exit_code == 0, s.output
    plans = json.loads(s.output)["plans"]
    # Megatron-FSDP (megatron, ZeRO-3) shards Megatron-Core's own MoE layers over the expert-DP group.
    assert len(plans) == 20 and all(p["zero_stage"] <= 2 or p["framework"] == "megatron" for p in plans)


def test_tp_must_divide_heads_and_ep_the_experts():
    r = CliRunner().invoke(main, ["estimate", "--model", "qwen2.5-7b", "--nodes", "1", "--tp", "8",
                                  "--global-batch", "8"])
    assert r.exit_code == 2 and "28 attention heads" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["estimate", "--model", "mixtral-8x7b", "--nodes", "2", "--ep", "16",
                                  "--global-batch", "16", "--micro-batch", "1"])
    assert r.exit_code == 2 and "8 routed experts" in r.output


@pytest.mark.parametrize("columns", ["60", "120"])
def test_memory_table_never_cuts_a_number_short(columns):
    """On a narrow terminal the per-rank memory prints as lines, not as a table of '41-…'."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": columns, "TERM": "dumb"}
    args = ["estimate", "--model", "llama-3-70b", "--nodes", "2", "--tp", "8", "--pp", "2", "--global-batch", "64",
            "--zero", "1", "--framework", "megatron"]
    out = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, env=env).stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "planner", *args, "--json"], capture_output=True,
                                     text=True, env=env).stdout)
    flat = " ".join(out.split())
    assert "…" not in out
    for stage in data["stages"]:
        a, b = stage["blocks"][0]
        assert f"{a}-{b}" in flat
        assert f"{stage['memory']['peak_bytes'] / 2**30:.1f}" in flat
