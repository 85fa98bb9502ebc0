"""The megatron_args.sh that `dsplan generate --framework megatron` writes, checked by Megatron-LM's own
argument handling (megatron-core 0.19.2's megatron/training/arguments.py, via tests/megatron_parser.py):
every emitted flag parses with unknown flags refused, validate_args accepts the combination for the
plan's world size, and core_transformer_config_from_args builds the TransformerConfig.

The run directories are generated through the CLI, the flags read back by sourcing the real
megatron_args.sh, and the environment each rank gets from the real nccl.env (validate_args reads
CUDA_DEVICE_MAX_CONNECTIONS). Megatron is imported once, in a subprocess, for all cases; the
first run downloads the wheel (2.4 MB) into ~/.cache/dsplan-tests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cli.fit import DOES_NOT_FIT_EXIT
from tests.megatron_parser import MEGATRON_CORE_VERSION, ArgsCheck, MegatronUnavailable, check_many, ensure_megatron

H100 = (9, 0)  # compute capability of dgx-h100's GPU (sm_90), what validate_args asks torch for
# What megatron_args.sh's header tells the user to append (data and tokenizer): Megatron's mock
# dataset and its NullTokenizer, which takes the emitted --vocab-size.
USER_ARGS = ["--mock-data", "--tokenizer-type", "NullTokenizer"]

CASES = {
    "llama-3-70b-tp4-pp4-v2-sp-fp8": ["--model", "llama-3-70b", "--nodes", "8", "--tp", "4", "--pp", "4",
                                      "--virtual-stages", "2", "--sequence-parallel", "--zero", "1",
                                      "--precision", "fp8-tensorwise"],
    "deepseek-v3-ep64-pp8-v4": ["--model", "deepseek-v3", "--nodes", "128", "--tp", "2", "--pp", "8",
                                "--virtual-stages", "4", "--ep", "64", "--cp", "1", "--zero", "1",
                                "--recompute", "selective", "--global-batch", "8192", "--seq-len", "4096",
                                "--micro-batch", "1", "--sequence-parallel"],
    "mixtral-8x7b-ep8": ["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", "--pp", "1"],
    "qwen3-30b-a3b-ep8-pp2-v2": ["--model", "qwen3-30b-a3b", "--nodes", "2", "--ep", "8", "--pp", "2",
                                 "--virtual-stages", "2"],
    "gpt-oss-120b-ep8-pp2-v2": ["--model", "gpt-oss-120b", "--nodes", "8", "--ep", "8", "--pp", "2",
                                "--virtual-stages", "2"],
    "llama-3-8b-megatron-fsdp": ["--model", "llama-3-8b", "--nodes", "1", "--zero", "3"],
    "llama-3-8b-megatron-hsdp": ["--model", "llama-3-8b", "--nodes", "2", "--zero", "3", "--dp-replicate", "2"],
    "llama-3-8b-cp2-a2a": ["--model", "llama-3-8b", "--nodes", "1", "--cp", "2", "--cp-comm", "a2a"],
    # a multi-token-prediction depth in a custom pipeline layout: the "m" before the loss
    "deepseek-v2-lite-mtp-pp2-layout": ["--model", "deepseek-v2-lite", "--nodes", "2", "--pp", "2", "--ep", "8",
                                        "--mtp-layers", "1", "--stage-blocks", "0-12,12-31", "--global-batch", "64",
                                        "--seq-len", "4096", "--micro-batch", "1", "--zero", "1"],
    # Transformer Engine's activation CPU offload of the first 24 of 32 layers
    "llama-3-8b-activation-offload": ["--model", "llama-3-8b", "--nodes", "1", "--zero", "1", "--global-batch", "64",
                                      "--seq-len", "8192", "--micro-batch", "1", "--activation-offload", "24"],
    # DeepEP behind Megatron-Core's flex token dispatcher (H100: the deepep backend)
    "mixtral-8x7b-ep8-flex": ["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", "--pp", "1",
                              "--moe-dispatcher", "flex"],
    # the allgather dispatcher over the experts' TP x EP group (Megatron refuses the overlap with it)
    "deepseek-v2-lite-ep2-allgather": ["--model", "deepseek-v2-lite", "--nodes", "1", "--ep", "2", "--pp", "1",
                                       "--moe-dispatcher", "allgather"],
    # capacity-factor token dropping, padded to capacity
    "mixtral-8x7b-ep8-capacity": ["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", "--pp", "1",
                                  "--moe-capacity-factor", "1.25"],
    # every recompute module Megatron-Core's selective recompute takes that dsplan prices
    "deepseek-v2-lite-recompute-modules": ["--model", "deepseek-v2-lite", "--nodes", "1", "--ep", "8", "--pp", "1",
                                           "--recompute", "selective", "--recompute-modules",
                                           "core_attn,layernorm,mla_up_proj,moe_act,mlp,shared_experts"],
    # the whole MoE layer recomputed (no all-to-all overlap beside it) with the norms
    "mixtral-8x7b-ep8-recompute-moe": ["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8", "--pp", "1",
                                       "--recompute", "selective", "--recompute-modules", "moe,layernorm"],
    # Qwen2-MoE's gated shared expert, from its Hugging Face config
    "qwen2-moe-ep4": ["--model", str(Path(__file__).parent / "data" / "hf_configs" / "qwen2_moe.json"), "--nodes", "1",
                      "--ep", "4", "--pp", "1"],
    # MoE parallel folding: EP 16 over TP 2 x DP 8, the experts off TP
    "qwen3-30b-a3b-tp2-etp1-ep16": ["--model", "qwen3-30b-a3b", "--nodes", "2", "--tp", "2", "--etp", "1",
                                    "--ep", "16", "--pp", "1", "--sequence-parallel"],
}
# Cases written from `dsplan estimate --json`'s plan with `generate --plan ... --allow-oom` rather
# than by generate's search: what Megatron makes of the flags does not depend on the plan fitting
# in memory, and this fully pinned layout is at the edge of 80 GiB (at commit ebe23ef: 96.2 GiB on
# pipeline rank 0 with micro-batch 1 and selective recomputation, so generate refuses it).
FROM_ESTIMATE = {"deepseek-v3-ep64-pp8-v4", "deepseek-v2-lite-mtp-pp2-layout", "llama-3-8b-activation-offload"}
# Flags a case is there to cover: the case fails if the plan no longer emits them.
CONTROL_UNKNOWN, CONTROL_WORLD = "control: unknown flag", "control: world size + 1"
MUST_EMIT = {
    # the plan's checkpoint interval, saved asynchronously (torch_dist), and the collective timeout
    "llama-3-70b-tp4-pp4-v2-sp-fp8": ["--save-interval", "--async-save", "--use-persistent-ckpt-worker",
                                      "--distributed-timeout-minutes", "--save", "--load"],
    "deepseek-v3-ep64-pp8-v4": ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--mtp-num-layers"],
    "llama-3-8b-megatron-fsdp": ["--use-megatron-fsdp"],
    "llama-3-8b-megatron-hsdp": ["--use-megatron-fsdp", "--num-distributed-optimizer-instances"],
    "llama-3-8b-cp2-a2a": ["--context-parallel-size", "--cp-comm-type"],
    "qwen3-30b-a3b-tp2-etp1-ep16": ["--expert-tensor-parallel-size", "--expert-model-parallel-size",
                                    "--moe-grouped-gemm"],
    "deepseek-v2-lite-mtp-pp2-layout": ["--mtp-num-layers", "--pipeline-model-parallel-layout"],
    "llama-3-8b-activation-offload": ["--cpu-offloading-num-layers"],
    "qwen2-moe-ep4": ["--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate"],
    "mixtral-8x7b-ep8-flex": ["--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
                              "--moe-flex-dispatcher-num-sms"],
    "deepseek-v2-lite-ep2-allgather": ["--moe-token-dispatcher-type"],
    "mixtral-8x7b-ep8-capacity": ["--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity"],
    "deepseek-v2-lite-recompute-modules": ["--recompute-granularity", "--recompute-modules"],
    "mixtral-8x7b-ep8-recompute-moe": ["--recompute-modules"],
    # gpt-oss's YaRN on standard attention and its gated quick-GELU experts
    "gpt-oss-120b-ep8-pp2-v2": ["--quick-geglu", "--glu-linear-offset", "--activation-func-clamp-value",
                                "--rotary-scaling-factor", "--yarn-original-max-position-embeddings",
                                "--no-yarn-correction-range-round-to-int", "--softmax-type", "--window-size"],
}


def _bash_env(script: Path | None) -> dict[str, str]:
    src = f'source "{script}"; ' if script is not None else ""
    out = subprocess.run(["env", "-i", "bash", "-c", f"{src}env -0"], capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in out.stdout.split("\0") if "=" in item)


def _generated(tmp: Path, name: str, flags: list[str]) -> dict:
    """Generate the case's run directory; its emitted flags, nccl.env's environment, world size."""
    entry = tmp / "pretrain_gpt.py"  # stands in for Megatron-LM's script; generate copies it
    entry.write_text("")
    out = tmp / name
    pinned = ["--framework", "megatron", "--hardware", "dgx-h100", *flags]
    if name in FROM_ESTIMATE:
        est = CliRunner().invoke(main, ["estimate", *pinned, "--json"])
        if est.exit_code not in (0, DOES_NOT_FIT_EXIT):
            return {"error": f"dsplan estimate {' '.join(pinned)} failed (exit {est.exit_code}):\n{est.output}"}
        (tmp / f"{name}.plan.json").write_text(est.stdout)
        gen = ["generate", "--plan", str(tmp / f"{name}.plan.json"), "--allow-oom"]
    else:
        gen = ["generate", *pinned]
    r = CliRunner().invoke(main, [*gen, "--entry", str(entry), "--out", str(out)])
    if r.exit_code != 0:
        return {"error": f"dsplan {' '.join(gen)} failed (exit {r.exit_code}):\n{r.output}\n{r.exception!r}"}
    argv = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\0" "${MEGATRON_ARGS[@]}"', "_",
                           str(out / "megatron_args.sh")], capture_output=True, text=True, check=True).stdout
    bare = _bash_env(None)
    env = {k: v for k, v in _bash_env(out / "nccl.env").items() if bare.get(k) != v}
    plan = json.loads((out / "plan.json").read_text())
    return {"argv": argv.split("\0")[:-1], "env": env, "world_size": plan["nodes"] * plan["gpus_per_node"],
            "summary": next((ln.strip() for ln in r.output.splitlines() if ln.strip().startswith("plan:")),
                            r.output.strip())}


@pytest.fixture(scope="module")
def megatron_results(tmp_path_factory) -> dict[str, dict]:
    """Every case generated, then checked by Megatron in one subprocess (an import, then a fork per
    case), with two controls that must fail: an unknown flag, and a world the parallel sizes do not divide."""
    try:
        root = ensure_megatron()
    except MegatronUnavailable as e:
        pytest.fail(str(e), pytrace=False)  # a check we cannot run is a failure, not a skip
    tmp = tmp_path_factory.mktemp("megatron-parser")
    runs = {name: _generated(tmp, name, flags) for name, flags in CASES.items()}
    checks = {n: ArgsCheck(run["argv"] + USER_ARGS, run["world_size"], run["env"], H100)
              for n, run in runs.items() if "error" not in run}
    if checks:
        base = next(iter(checks.values()))
        checks[CONTROL_UNKNOWN] = ArgsCheck(base.argv + ["--no-such-flag"], base.world_size, base.env, H100)
        checks[CONTROL_WORLD] = ArgsCheck(base.argv, base.world_size + 1, base.env, H100)
    for name, (ok, message) in zip(checks, check_many(list(checks.values()), megatron_root=root)):
        runs.setdefault(name, {}).update(ok=ok, message=message)
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_accepts_the_emitted_flags(megatron_results, name):
    run = megatron_results[name]
    assert "error" not in run, run.get("error")
    missing = [flag for flag in MUST_EMIT.get(name, []) if flag not in run["argv"]]
    assert not missing, f"{name}: the plan ({run['summary']}) no longer emits {missing}"
    assert run["ok"], (f"Megatron-LM (megatron-core {MEGATRON_CORE_VERSION}) refuses {name}'s megatron_args.sh "
                       f"({run['summary']}; WORLD_SIZE={run['world_size']}, env {run['env']}):\n"
                       f"{run['message']}\nflags: {' '.join(run['argv'])}")


def test_the_check_refuses_an_unknown_flag_and_a_world_that_does_not_divide(megatron_results):
    assert CONTROL_UNKNOWN in megatron_results, "no case generated, so no control ran"
    unknown, world = megatron_results[CONTROL_UNKNOWN], megatron_results[CONTROL_WORLD]
    assert not unknown["ok"] and "unrecognized arguments: --no-such-flag" in unknown["message"], unknown["message"]
    assert not world["ok"] and "is not divisible by total_model_size" in world["message"], world["message"]


def test_the_allgather_dispatcher_is_emitted_without_the_overlap_megatron_refuses_with_it(megatron_results):
    argv = megatron_results["deepseek-v2-lite-ep2-allgather"]["argv"]
    at = argv.index("--moe-token-dispatcher-type")
    assert argv[at + 1] == "allgather"
    assert "--overlap-moe-expert-parallel-comm" not in argv  # transformer_config.py: alltoall/flex only


def test_the_recompute_modules_reach_megatron_one_argument_each(megatron_results):
    argv = megatron_results["deepseek-v2-lite-recompute-modules"]["argv"]
    at = argv.index("--recompute-modules")
    assert argv[at - 2:at] == ["--recompute-granularity", "selective"]
    assert argv[at + 1:at + 7] == ["core_attn", "layernorm", "mla_up_proj", "moe_act", "mlp", "shared_experts"]
    assert argv[at + 7].startswith("--")


def test_the_moe_module_is_written_without_the_overlap_megatron_refuses_beside_it(megatron_results):
    argv = megatron_results["mixtral-8x7b-ep8-recompute-moe"]["argv"]
    at = argv.index("--recompute-modules")
    assert argv[at + 1:at + 3] == ["layernorm", "moe"]
    assert "--overlap-moe-expert-parallel-comm" not in argv
