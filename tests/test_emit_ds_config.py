"""ds_config.json and moe.json from plans: checked against DeepSpeed's own DeepSpeedConfig.

DeepSpeed reads the data-parallel world size from torch.distributed, so a child process starts a
one-process gloo group and hands DeepSpeedConfig a stand-in ``mpu`` that reports the plan's DP
size (the config class is DeepSpeed's real one). One child validates the whole matrix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cost import frameworks as fw
from planner.emit.ds_config import TrainSettings, build_ds_config, build_moe_config
from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.errors import UserError
from planner.model.load import load_model
from planner.model.spec import ModelSpec


def even_stages(model: ModelSpec, stages: int) -> list[list[int]]:
    n = len(model.blocks)
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    return [[cuts[i], cuts[i + 1]] for i in range(stages)]


def make_plan(model_name: str, nodes: int, gpus_per_node: int = 8, **overrides) -> tuple[PlanFile, ModelSpec]:
    """A consistent plan dict for ``model_name``: DP fills what TP x PP leave, the batch follows."""
    model = load_model(model_name)
    data = dict(
        model=model.name, hardware="dgx-a100-80g", nodes=nodes, gpus_per_node=gpus_per_node, framework="deepspeed",
        tp=1, pp=1, ep=1, zero_stage=1, offload="none", micro_batch=1, grad_accum=1,
        seq_len=min(4096, model.max_seq_len), recompute="none", precision="bf16", optimizer="adamw",
    )
    data.update(overrides)
    data["dp"] = nodes * gpus_per_node // (data["tp"] * data["pp"])
    data["global_batch"] = data["micro_batch"] * data["grad_accum"] * data["dp"]
    if data["pp"] > 1 and "stage_blocks" not in overrides:
        data["stage_blocks"] = even_stages(model, data["pp"] * data.get("virtual_stages", 1))
    return plan_from_dict(data), model


# (model, nodes, overrides): ZeRO 0-3, offload, bf16/fp16/fp32, pipeline, AutoTP, MoE, 1-16 nodes.
MATRIX = [
    ("gpt3-1.3b", 1, dict(zero_stage=0, precision="fp16", micro_batch=4, grad_accum=2)),
    ("llama-3.1-8b", 1, dict(zero_stage=1, micro_batch=2, grad_accum=8)),
    ("llama-3.1-8b", 2, dict(zero_stage=2, offload="optimizer", recompute="full", grad_accum=4)),
    ("llama-3.1-70b", 16, dict(zero_stage=3, offload="optimizer+params", recompute="full")),
    ("llama-3.1-70b", 4, dict(framework="megatron-deepspeed", zero_stage=3, precision="fp16", recompute="selective",
                              grad_accum=16)),
    ("llama-3.1-70b", 8, dict(zero_stage=1, pp=4, grad_accum=16, recompute="full")),
    ("llama-3.1-70b", 8, dict(framework="megatron-deepspeed", zero_stage=1, tp=8, pp=2, grad_accum=32,
                              sequence_parallel=True)),
    ("llama-3.1-70b", 8, dict(framework="megatron", zero_stage=1, tp=8, pp=2, virtual_stages=2, grad_accum=32)),
    ("llama-3.1-8b", 1, dict(zero_stage=2, tp=4, micro_batch=2, grad_accum=2)),
    ("qwen2.5-7b", 2, dict(zero_stage=1, tp=2, precision="fp16")),
    ("mixtral-8x7b", 4, dict(zero_stage=2, ep=8, grad_accum=2)),
    ("deepseek-vl2-tiny", 2, dict(zero_stage=1, pp=2, ep=4, grad_accum=4, recompute="full")),
    ("deepseek-v2-lite", 1, dict(zero_stage=2, ep=8, offload="optimizer")),
    ("gpt3-125m", 1, dict(zero_stage=3, precision="fp32", optimizer="sgd", micro_batch=8)),
    ("gpt3-125m", 1, dict(zero_stage=0, optimizer="adam")),
    ("gpt3-13b", 4, dict(zero_stage=3, zero_pp=("qwz", "hpz", "qgz"), recompute="full")),
]

# Two long lines of the script are split over adjacent string literals; the script's text is unchanged.
_VALIDATOR = (r"""
import json, os, sys
import deepspeed
import torch
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo", verbose=False)


class DataParallelStandIn:
    # Stands in for the process groups: reports the plan's data-parallel world size.
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_rank(self):
        return 0


def derived(config, dp):
    c = DeepSpeedConfig(config, mpu=DataParallelStandIn(dp))
    z = c.zero_config
    return {
        "world_size": c.world_size,
        "train_batch_size": c.train_batch_size,
        "micro": c.train_micro_batch_size_per_gpu,
        "gas": c.gradient_accumulation_steps,
        "zero_stage": int(c.zero_optimization_stage),
        "bf16": c.bfloat16_config.enabled,
        "fp16": c.float16_config.enabled,
        "dynamic_loss_scale": c.float16_config.loss_scale == 0,
        "offload_optimizer": None if z.offload_optimizer is None else """
    r"""getattr(z.offload_optimizer.device, "value", z.offload_optimizer.device),
        "offload_param": None if z.offload_param is None else """
    r"""getattr(z.offload_param.device, "value", z.offload_param.device),
        "pin_memory": [o.pin_memory for o in (z.offload_optimizer, z.offload_param) if o is not None],
        "reduce_bucket_size": int(z.reduce_bucket_size),
        "prefetch_bucket_size": int(z.prefetch_bucket_size),
        "param_persistence_threshold": int(z.param_persistence_threshold),
        "max_live_parameters": int(z.max_live_parameters),
        "zeropp": [int(z.zero_hpz_partition_size), z.zero_quantized_weights, z.zero_quantized_gradients],
        "autotp_size": c.tensor_parallel_config.autotp_size,
        "pipeline": c.pipeline,
        "optimizer": c.optimizer_name,
        # The engine builds a DeepSpeed optimizer by name, or torch.optim.<name> (engine.py).
        "optimizer_known": c.optimizer_name in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, c.optimizer_name),
        "scheduler": c.scheduler_name,
        "gradient_clipping": c.gradient_clipping,
    }


cases = json.load(open(sys.argv[1]))
out = []
for case in cases:
    full = derived(case["config"], case["dp"])
    # Without train_batch_size DeepSpeed derives it from micro x accumulation x DP world size.
    partial = {k: v for k, v in case["config"].items() if k != "train_batch_size"}
    full["derived_train_batch_size"] = derived(partial, case["dp"])["train_batch_size"]
    out.append(full)
print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory) -> list[tuple[PlanFile, ModelSpec, dict, dict]]:
    built = []
    for name, nodes, overrides in MATRIX:
        plan, model = make_plan(name, nodes, **overrides)
        built.append((plan, model, build_ds_config(plan, model)))
    path = tmp_path_factory.mktemp("dscfg") / "cases.json"
    path.write_text(json.dumps([{"config": cfg, "dp": plan.dp} for plan, _, cfg in built]))
    port = str(29400 + os.getpid() % 500)
    proc = subprocess.run([sys.executable, "-c", _VALIDATOR, str(path), port], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    return [(plan, model, cfg, res) for (plan, model, cfg), res in zip(built, results)]


def test_deepspeed_accepts_every_config_and_derives_the_plans_batch(matrix_results):
    assert len(matrix_results) == len(MATRIX)
    for plan, _model, _cfg, got in matrix_results:
        assert got["world_size"] == plan.dp
        assert got["train_batch_size"] == plan.global_batch == plan.micro_batch * plan.grad_accum * plan.dp
        assert got["derived_train_batch_size"] == plan.global_batch
        assert (got["micro"], got["gas"]) == (plan.micro_batch, plan.grad_accum)
        assert got["zero_stage"] == plan.zero_stage


def test_deepspeed_reads_precision_offload_and_parallel_sections(matrix_results):
    for plan, model, _cfg, got in matrix_results:
        assert got["bf16"] == (plan.precision == "bf16")
        assert got["fp16"] == (plan.precision == "fp16")
        assert not (got["bf16"] and got["fp16"])
        if plan.precision == "fp16":
            assert got["dynamic_loss_scale"]
        want_opt = "cpu" if plan.offload != "none" else None
        assert got["offload_optimizer"] == want_opt
        assert got["offload_param"] == ("cpu" if plan.offload == "optimizer+params" else None)
        assert all(got["pin_memory"])
        if plan.zero_stage >= 1:
            assert got["reduce_bucket_size"] == fw.REDUCE_BUCKET_SIZE
        if plan.zero_stage == 3:
            assert got["prefetch_bucket_size"] == fw.STAGE3_PREFETCH_BUCKET_SIZE
            assert got["param_persistence_threshold"] == 10 * model.hidden
            assert got["max_live_parameters"] == fw.STAGE3_MAX_LIVE_PARAMETERS
        autotp = plan.tp if plan.framework == "deepspeed" and plan.tp > 1 else 0
        assert got["autotp_size"] == autotp
        if plan.pp > 1:
            assert got["pipeline"]["activation_checkpoint_interval"] == (1 if plan.recompute != "none" else 0)
            assert got["pipeline"]["pipe_partitioned"] == (plan.tp > 1)
        assert got["optimizer"] == {"adamw": "adamw", "adam": "adam", "sgd": "SGD"}[plan.optimizer]
        assert got["optimizer_known"]
        assert got["scheduler"] == "WarmupCosineLR"
        assert got["gradient_clipping"] == 1.0


def test_deepspeed_reads_the_zero_plus_plus_options_as_priced(matrix_results):
    """ZeRO++ (--zeropp): hpZ's partition is one node's DP ranks, the size zero3_fetch prices."""
    got = {tuple(plan.zero_pp): res["zeropp"] for plan, _, _, res in matrix_results if plan.zero_stage == 3}
    assert got[("qwz", "hpz", "qgz")] == [8, True, True]
    assert got[()] == [1, False, False]


def test_sections_appear_only_when_the_plan_needs_them():
    plan, model = make_plan("llama-3.1-8b", 1, zero_stage=1)
    cfg = build_ds_config(plan, model)
    assert "pipeline" not in cfg and "tensor_parallel" not in cfg and "activation_checkpointing" not in cfg
    assert "fp16" not in cfg and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["allgather_bucket_size"] == fw.ALLGATHER_BUCKET_SIZE
    assert "stage3_max_live_parameters" not in cfg["zero_optimization"]

    plan, model = make_plan("llama-3.1-8b", 2, zero_stage=1, pp=2, recompute="full")
    cfg = build_ds_config(plan, model)
    assert cfg["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False,
                               "activation_checkpoint_interval": 1}
    assert "tensor_parallel" not in cfg

    plan, model = make_plan("llama-3.1-8b", 2, zero_stage=1, tp=2, recompute="full")
    cfg = build_ds_config(plan, model)
    assert "pipeline" not in cfg
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert cfg["activation_checkpointing"]["partition_activations"] is True

    plan, model = make_plan("llama-3.1-8b", 1, zero_stage=1, tp=2, framework="megatron-deepspeed")
    assert "tensor_parallel" not in build_ds_config(plan, model)  # Megatron owns TP there


def test_fp16_uses_dynamic_loss_scaling_and_fp32_neither():
    plan, model = make_plan("gpt3-125m", 1, precision="fp16")
    cfg = build_ds_config(plan, model)
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and "bf16" not in cfg
    plan, model = make_plan("gpt3-125m", 1, precision="fp32")
    cfg = build_ds_config(plan, model)
    assert "fp16" not in cfg and "bf16" not in cfg


def test_schedule_follows_the_train_settings():
    plan, model = make_plan("gpt3-125m", 1)
    cfg = build_ds_config(plan, model, TrainSettings(steps=500, scheduler="linear", lr=1e-4))
    assert cfg["scheduler"]["type"] == "WarmupDecayLR"
    assert cfg["scheduler"]["params"]["total_num_steps"] == 500
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 5  # 1% of 500
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert cfg["optimizer"]["params"]["lr"] == 1e-4


def test_moe_json_describes_the_experts():
    plan, model = make_plan("deepseek-vl2-tiny", 2, zero_stage=1, pp=2, ep=4)
    moe = build_moe_config(plan, model)
    mlp = next(b.mlp for b in model.decoder_blocks if b.is_moe)
    assert moe["ep_size"] == 4 and moe["deepspeed_moe"]["ep_size"] == 4
    assert moe["num_experts"] == mlp.routed_experts == 64
    assert moe["top_k"] == moe["deepspeed_moe"]["k"] == mlp.top_k == 6
    assert moe["deepspeed_moe"]["use_residual"] is True  # two shared experts
    assert moe["moe_layers"] == list(range(1, model.num_layers))  # layer 0 is dense

    plan, model = make_plan("mixtral-8x7b", 4, zero_stage=2, ep=8)
    moe = build_moe_config(plan, model)
    assert moe["num_experts"] == 8 and moe["top_k"] == 2 and moe["deepspeed_moe"]["use_residual"] is False
    assert moe["moe_layers"] == list(range(model.num_layers))

    plan, model = make_plan("llama-3.1-8b", 1)
    assert build_moe_config(plan, model) is None


def test_runtime_rules_deepspeed_cannot_express_are_user_errors():
    with pytest.raises(UserError, match="PipelineModule .* rejects ZeRO-2"):
        plan, model = make_plan("llama-3.1-8b", 2, zero_stage=2, pp=2)
        build_ds_config(plan, model)
    with pytest.raises(UserError, match="AutoTP .* ZeRO <= 2"):
        plan, model = make_plan("llama-3.1-8b", 1, zero_stage=3, tp=2)
        build_ds_config(plan, model)
    with pytest.raises(UserError, match="optimizer offload steps Adam on the CPU, not sgd"):
        plan, model = make_plan("gpt3-125m", 1, zero_stage=2, offload="optimizer", optimizer="sgd")
        build_ds_config(plan, model)


def test_plan_file_rejects_inconsistent_plans(tmp_path: Path):
    plan, _ = make_plan("llama-3.1-8b", 1, zero_stage=1)
    data = plan.to_json()
    with pytest.raises(UserError, match="global_batch"):
        plan_from_dict({**data, "global_batch": data["global_batch"] + 1})
    with pytest.raises(UserError, match="nodes x gpus_per_node"):
        plan_from_dict({**data, "dp": data["dp"] * 2, "global_batch": data["global_batch"] * 2})
    with pytest.raises(UserError, match="zero_stage"):
        plan_from_dict({**data, "zero_stage": 5})
    with pytest.raises(UserError, match="parameter offload needs ZeRO-3"):
        plan_from_dict({**data, "offload": "optimizer+params"})
    # Predictions ride along untouched.
    assert plan_from_dict({**data, "mfu": 0.42, "time": {"compute_s": 1.0}}).to_json()["mfu"] == 0.42
