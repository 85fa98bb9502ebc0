"""The launch files' multi-node behaviour: which node gets which ranks under torchrun, where the
DeepSpeed launcher's ranks meet, what a Kubernetes pod asks of the cluster, and where a pod finds a
custom entry. Each runs the real scripts `dsplan generate` writes, with a recording torchrun /
deepspeed on PATH (tests/test_emit_scripts.py's FAKE_LAUNCHER) or the real torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import main
from planner.emit.hosts import Host
from tests.test_emit_scripts import PLANS, STUB_ENTRY, TRICKY_ARGS, fake_bin, run_with_stub  # noqa: F401 (fixture)
from tests.test_cli_generate import write_plan

MULTI = PLANS["multi"]  # llama-3.1-70b on 4 nodes x 8 GPUs


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def run_script(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    for key in ("NODE_RANK", "MASTER_ADDR", "RANK", "PET_NODE_RANK", "SLURM_NODEID", "DSPLAN_PYTORCHJOB"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run([str(script), *args], env=full, capture_output=True, text=True, timeout=120)


def argv_of(fake_log: Path) -> list[str]:
    (record,) = [json.loads(line) for line in fake_log.read_text().splitlines()]
    return record["argv"]


# --- the DeepSpeed launcher: ssh mode meets where node mode does -------------------------------


def test_deepspeed_ssh_mode_defaults_master_addr_to_the_hostfiles_first_host(tmp_path: Path, fake_bin: Path):
    hosts = [Host(name=n, slots=8) for n in ("gpu-b07", "gpu-a01", "gpu-a02", "gpu-a03")]
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
    run_with_stub(tmp_path, MULTI, [str(run_dir / "launch_deepspeed.sh"), "ssh"], env=env, hosts=hosts)
    ssh = argv_of(tmp_path / "fake.jsonl")
    assert ssh[ssh.index("--master_addr") + 1] == "gpu-b07"  # first in the hostfile, not the first sorted
    (tmp_path / "fake.jsonl").unlink()
    run_script(run_dir / "launch_deepspeed.sh", {**env, "FAKE_LOG": str(tmp_path / "fake.jsonl"), "NODE_RANK": "1",
                                                  "DSPLAN_PYTHON": sys.executable, "STUB_LOG": str(tmp_path / "s")}, "node")
    node = argv_of(tmp_path / "fake.jsonl")
    assert node[node.index("--master_addr") + 1] == ssh[ssh.index("--master_addr") + 1]


def test_deepspeed_ssh_mode_master_addr_follows_the_environment_and_dsplan_hostfile(tmp_path: Path, fake_bin: Path):
    run_with_stub(tmp_path, MULTI, ["true"])
    script = tmp_path / "run" / "launch_deepspeed.sh"
    fake_log = tmp_path / "fake.jsonl"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(fake_log), "DSPLAN_PYTHON": sys.executable,
           "STUB_LOG": str(tmp_path / "stub.jsonl")}
    assert run_script(script, {**env, "MASTER_ADDR": "10.1.0.9"}, "ssh").returncode == 0
    argv = argv_of(fake_log)
    assert argv[argv.index("--master_addr") + 1] == "10.1.0.9"
    fake_log.unlink()
    other = tmp_path / "other.hosts"
    other.write_text("# site hostfile\n\n  ib-node-3 slots=8\nib-node-4 slots=8\n")
    assert run_script(script, {**env, "DSPLAN_HOSTFILE": str(other)}, "ssh").returncode == 0
    argv = argv_of(fake_log)
    assert argv[argv.index("--master_addr") + 1] == "ib-node-3" and argv[argv.index("--hostfile") + 1] == str(other)
    fake_log.unlink()
    for hostfile in (tmp_path / "missing.hosts", tmp_path / "empty.hosts"):
        (tmp_path / "empty.hosts").write_text("# nothing\n")
        proc = run_script(script, {**env, "DSPLAN_HOSTFILE": str(hostfile)}, "ssh")
        assert proc.returncode == 2 and "no host in the hostfile" in proc.stderr, proc.stderr
    assert not fake_log.exists()
