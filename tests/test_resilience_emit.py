"""What a generated run directory does about failures (planner/emit/resilience.py): the plan's
checkpoint interval in every runtime's arguments, the asynchronous save where it was priced,
the collective timeout, the launchers' restart policies, the second checkpoint copy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.emit.plan_file import plan_from_dict
from planner.emit.resilience import DEFAULT_TIMEOUT_S, RESTARTS, collective_timeout_s, planned_interval


def _generate(tmp_path: Path, *flags: str, name: str = "run") -> Path:
    out = tmp_path / name
    r = CliRunner().invoke(main, ["generate", "--hardware", "dgx-h100", *flags, "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _plan(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def _megatron_args(run_dir: Path) -> list[str]:
    out = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\0" "${MEGATRON_ARGS[@]}"', "_",
                          str(run_dir / "megatron_args.sh")], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_megatron_saves_at_the_plans_interval_asynchronously(tmp_path):
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--nodes", "4", "--framework", "megatron", "--zero", "1",
                        "--steps", "100000")
    plan = _plan(run_dir)
    every = plan["checkpoint"]["interval_steps"]
    assert every > 1
    argv = _megatron_args(run_dir)
    assert argv[argv.index("--save-interval") + 1] == str(every)
    assert argv[argv.index("--save") + 1] == str(run_dir.resolve() / "checkpoints")
    assert argv[argv.index("--load") + 1] == str(run_dir.resolve() / "checkpoints")
    assert {"--async-save", "--use-persistent-ckpt-worker"} <= set(argv)
    assert argv[argv.index("--ckpt-format") + 1] == "torch_dist"
    minutes = int(argv[argv.index("--distributed-timeout-minutes") + 1])
    assert minutes * 60 == collective_timeout_s(plan_from_dict(plan))
    # the cost model priced it so: the save stalls for the host copy only
    assert plan["checkpoint"]["save_stall_s"] < plan["checkpoint"]["save_persist_s"]


def test_megatron_fsdp_saves_synchronously_as_priced(tmp_path):
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--nodes", "1", "--framework", "megatron", "--zero", "3")
    argv = _megatron_args(run_dir)
    assert "--async-save" not in argv and argv[argv.index("--ckpt-format") + 1] == "fsdp_dtensor"
    ck = _plan(run_dir)["checkpoint"]
    assert ck["save_stall_s"] == ck["save_persist_s"]


def test_interval_is_capped_at_the_run_and_can_be_given(tmp_path):
    short = _generate(tmp_path, "--model", "llama-3-8b", "--framework", "megatron", "--steps", "5", name="short")
    argv = _megatron_args(short)
    assert argv[argv.index("--save-interval") + 1] == "5"  # the plan's interval is longer: save at the end
    given = _generate(tmp_path, "--model", "llama-3-8b", "--framework", "megatron", "--checkpoint-every", "7",
                      name="given")
    argv = _megatron_args(given)
    assert argv[argv.index("--save-interval") + 1] == "7"
    never = _generate(tmp_path, "--model", "llama-3-8b", "--framework", "megatron", "--checkpoint-every", "0",
                      name="never")
    assert "--save-interval" not in _megatron_args(never)


def test_a_plan_without_predictions_gets_no_interval():
    plan = plan_from_dict({"model": "llama-3-8b", "hardware": "dgx-h100", "nodes": 1, "gpus_per_node": 8, "dp": 8,
                           "global_batch": 64, "seq_len": 2048, "micro_batch": 1, "grad_accum": 8})
    assert planned_interval(plan, 1000) == 0
    assert collective_timeout_s(plan) == DEFAULT_TIMEOUT_S


def test_timeout_is_a_margin_over_the_longest_wait():
    base = {"model": "llama-3-8b", "hardware": "dgx-h100", "nodes": 1, "gpus_per_node": 8, "dp": 8,
            "global_batch": 64, "seq_len": 2048, "micro_batch": 1, "grad_accum": 8}
    slow = plan_from_dict({**base, "step_time_s": 400.0, "checkpoint": {"save_stall_s": 30.0, "restore_s": 20.0}})
    assert collective_timeout_s(slow) == 1620  # 4 x 400 s, in whole minutes
    save = plan_from_dict({**base, "step_time_s": 2.0, "checkpoint": {"save_stall_s": 500.0, "restore_s": 20.0}})
    assert collective_timeout_s(save) == 2040  # a synchronous save's barrier waits for the slowest writer


def test_torchtitan_checkpoints_in_the_background(tmp_path):
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--framework", "torchtitan", "--zero", "3",
                        "--steps", "100000")
    job = tomllib.loads((run_dir / "torchtitan.toml").read_text())
    ck = job["checkpoint"]
    assert ck["enable"] and ck["async_mode"] == "async" and ck["keep_latest_k"] == 2
    assert ck["interval"] == _plan(run_dir)["checkpoint"]["interval_steps"]
    assert job["comm"]["train_timeout_seconds"] >= DEFAULT_TIMEOUT_S


def test_launchers_restart_and_resume(tmp_path):
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--nodes", "2", "--framework", "deepspeed", "--zero", "1")
    sbatch = (run_dir / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in sbatch
    job = yaml.safe_load((run_dir / "k8s-job.yaml").read_text())
    assert job["spec"]["runPolicy"]["backoffLimit"] == RESTARTS
    for role in job["spec"]["pytorchReplicaSpecs"].values():
        assert role["restartPolicy"] == "OnFailure"
        env = {e["name"]: e["value"] for e in role["template"]["spec"]["containers"][0]["env"]}
        assert env["DSPLAN_RESUME"] == "1"
    env_text = (run_dir / "nccl.env").read_text()
    assert 'TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"' in env_text
    assert "DSPLAN_COLLECTIVE_TIMEOUT_S" in env_text


@pytest.mark.parametrize(("restart_env", "resumes"), [({}, False), ({"TORCHELASTIC_RESTART_COUNT": "1"}, True),
                                                      ({"SLURM_RESTART_COUNT": "2"}, True),
                                                      ({"DSPLAN_RESUME": "1"}, True)])
def test_the_builtin_trainer_resumes_after_a_launchers_restart(tmp_path, restart_env, resumes):
    copy = tmp_path / "copy"
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--framework", "deepspeed", "--zero", "1",
                        "--steps", "100000", "--checkpoint-copy", str(copy))
    fake = tmp_path / "python"
    log = tmp_path / "argv.txt"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {log}\nprintf "%s\\n" '
                    f'"$DSPLAN_COLLECTIVE_TIMEOUT_S" >> {log}\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
                                                             "DSPLAN_RESUME")}
    subprocess.run(["bash", str(run_dir / "entry.sh")], env={**env, "DSPLAN_PYTHON": str(fake), **restart_env},
                   check=True, timeout=60)
    argv = log.read_text().splitlines()
    assert ("--resume" in argv) is resumes
    assert argv[argv.index("--checkpoint-every") + 1] == str(_plan(run_dir)["checkpoint"]["interval_steps"])
    assert argv[argv.index("--checkpoint-copy") + 1] == str(copy)
    assert int(argv[-1]) == collective_timeout_s(plan_from_dict(_plan(run_dir)))


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--checkpoint-every", "often", "whole number of steps"),
    ("--checkpoint-copy", "relative/dir", "absolute path"),
    ("--checkpoint-copy", "/proc/self/dsplan-copy", "not a writable directory"),
])
def test_bad_checkpoint_flags_are_one_message_and_exit_2(tmp_path, flag, value, says):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", flag, value, "--out", str(out)])
    assert r.exit_code == 2
    assert flag in r.output and says in r.output and "Traceback" not in r.output
    assert not out.exists()  # nothing half-written


def test_deepspeed_elasticity_is_not_emitted_because_deepspeed_removed_it(tmp_path):
    """The issue asks for DeepSpeed elasticity where a smaller world is allowed; DeepSpeed 0.19
    refuses the block outright, so ds_config.json never carries it (torchrun's c10d rendezvous
    and the restart policies are the way back after a failure)."""
    import sys

    code = ("from deepspeed.runtime.config import DeepSpeedConfig\n"
            "try:\n    DeepSpeedConfig({'train_batch_size': 8, 'elasticity': {'enabled': True}})\n"
            "except Exception as err:\n    print('REFUSED', err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert "REFUSED Elastic training has been removed" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    run_dir = _generate(tmp_path, "--model", "llama-3-8b", "--nodes", "2", "--framework", "deepspeed", "--zero", "1")
    assert "elasticity" not in json.loads((run_dir / "ds_config.json").read_text())
