"""The launch files' multi-node behaviour: which node gets which ranks under torchrun, where the
DeepSpeed launcher's ranks meet, what a Kubernetes pod asks of the cluster, and where a pod finds a
custom entry. Each runs the real scripts `dsplan generate` writes, with a recording torchrun /
deepspeed on PATH (tests/conftest.py's FAKE_LAUNCHER) or the real torchrun."""

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
from tests.test_cli_generate import write_plan
from tests.test_emit_scripts import PLANS, STUB_ENTRY, TRICKY_ARGS, run_with_stub

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


# --- torchrun: the node rank decides the ranks -------------------------------------------------


def test_torchrun_static_rendezvous_is_the_default_and_carries_the_node_rank(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MASTER_ADDR": "gpu-a01", "NODE_RANK": "2"}
    run_with_stub(tmp_path, MULTI, [str(run_dir / "launch_torchrun.sh")], env=env)
    argv = argv_of(tmp_path / "fake.jsonl")
    assert argv[:8] == ["--nnodes", "4", "--node-rank", "2", "--rdzv-backend", "static",
                        "--rdzv-endpoint", "gpu-a01:29500"]
    assert "--rdzv-id" not in argv and argv[argv.index("--max-restarts") + 1] == "0"


def test_torchrun_c10d_is_an_opt_in_without_the_node_rank(tmp_path: Path, fake_bin: Path):
    """torchrun ignores --node-rank under c10d (torch/distributed/run.py warns so); the script
    does not pretend to pass it."""
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MASTER_ADDR": "gpu-a01", "NODE_RANK": "2",
           "DSPLAN_RDZV_BACKEND": "c10d", "DSPLAN_MAX_RESTARTS": "3"}
    run_with_stub(tmp_path, MULTI, [str(run_dir / "launch_torchrun.sh")], env=env)
    argv = argv_of(tmp_path / "fake.jsonl")
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and "--node-rank" not in argv
    assert argv[argv.index("--rdzv-id") + 1] == "run" and argv[argv.index("--max-restarts") + 1] == "3"


def test_torchrun_refuses_a_multi_node_launch_without_a_valid_node_rank(tmp_path: Path, fake_bin: Path):
    """Every node defaulting to rank 0 would make two stores on one port, or hang: refuse instead."""
    run_with_stub(tmp_path, MULTI, ["true"])
    script = tmp_path / "run" / "launch_torchrun.sh"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MASTER_ADDR": "gpu-a01"}
    for extra, needle in (({}, "set NODE_RANK"), ({"NODE_RANK": "4"}, "0..3"), ({"NODE_RANK": "08"}, "0..3"),
                          ({"NODE_RANK": "1", "DSPLAN_RDZV_BACKEND": "etcd"}, "static or c10d"),
                          ({"NODE_RANK": "1", "DSPLAN_MAX_RESTARTS": "x"}, "DSPLAN_MAX_RESTARTS"),
                          ({"RANK": "1"}, "set NODE_RANK")):  # RANK alone is a process rank, not the node's
        proc = run_script(script, {**env, **extra})
        assert proc.returncode == 2 and needle in proc.stderr, (extra, proc.stderr)
    assert not (tmp_path / "fake.jsonl").exists()


def test_torchrun_under_a_pytorchjob_takes_the_node_rank_from_the_pods_rank(tmp_path: Path, fake_bin: Path):
    """Kubeflow's PyTorchJob sets RANK to the pod's index (Master 0, Worker j -> j+1) and
    MASTER_ADDR/MASTER_PORT; k8s-job.yaml marks its pods with DSPLAN_PYTORCHJOB=1."""
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DSPLAN_PYTORCHJOB": "1", "RANK": "3",
           "MASTER_ADDR": "run-master-0", "MASTER_PORT": "23456", "PET_NNODES": "4"}
    run_with_stub(tmp_path, MULTI, [str(run_dir / "launch_torchrun.sh")], env=env)
    argv = argv_of(tmp_path / "fake.jsonl")
    assert argv[argv.index("--node-rank") + 1] == "3"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "run-master-0:23456"
    job = yaml.safe_load((run_dir / "k8s-job.yaml").read_text())
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = spec["template"]["spec"]["containers"]
        assert {"name": "DSPLAN_PYTORCHJOB", "value": "1"} in container["env"]


def _start_node(run_dir: Path, node_rank: int, env: dict[str, str]) -> subprocess.Popen:
    node_env = {**env, "NODE_RANK": str(node_rank), "STUB_NODE": str(node_rank)}
    return subprocess.Popen([str(run_dir / "launch_torchrun.sh")], env=node_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_real_torchrun_places_the_ranks_by_node_rank_and_c10d_by_arrival(tmp_path: Path, backend: str):
    """Two nodes on this machine (2 processes each), the node of NODE_RANK 1 started first.
    Static: it runs global ranks 2 and 3, as the plan says. c10d (opt-in): torchrun ignores the
    node rank and numbers the agents by sorted (host name, pid), so the agent started first,
    on the same host, gets ranks 0 and 1 - the trade-off the script header documents."""
    torchrun_dir = str(Path(sys.executable).parent)
    assert shutil.which("torchrun", path=torchrun_dir)
    stub = tmp_path / "stub_entry.py"
    stub.write_text(STUB_ENTRY)
    out = tmp_path / "run"
    plan = write_plan(tmp_path, "gpt3-125m", 2, zero_stage=1)
    assert invoke("generate", "--plan", str(plan), "--out", str(out), "--entry", str(stub)).exit_code == 0
    log = tmp_path / "stub.jsonl"
    env = {**os.environ, "PATH": f"{torchrun_dir}:{os.environ['PATH']}", "DSPLAN_PYTHON": sys.executable,
           "STUB_LOG": str(log), "GPUS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29300 + os.getpid() % 150 + (0 if backend == "static" else 150)),
           "DSPLAN_RDZV_BACKEND": backend}
    env.pop("RANK", None)
    first = _start_node(out, 1, env)
    try:
        try:
            first.wait(timeout=3)  # the static node 1 waits for node 0's store; c10d waits for a second agent
        except subprocess.TimeoutExpired:
            pass
        assert first.poll() is None, first.stdout.read() if first.stdout else ""
        second = _start_node(out, 0, env)
        try:
            outputs = [p.communicate(timeout=180)[0] for p in (first, second)]
        finally:
            for p in (first, second):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        assert first.returncode == 0 and second.returncode == 0, outputs
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ranks = {node: sorted(int(r["env"]["RANK"]) for r in records if r["env"]["STUB_NODE"] == node)
             for node in ("0", "1")}
    if backend == "static":
        assert ranks == {"0": [0, 1], "1": [2, 3]}
    else:
        assert ranks == {"0": [2, 3], "1": [0, 1]}


def test_the_trade_off_is_documented_in_the_script_and_the_run_readme(tmp_path: Path):
    out = tmp_path / "run"
    assert invoke("generate", "--plan", str(write_plan(tmp_path, "llama-3.1-8b", 2, zero_stage=1)), "--out", str(out),
                  "--hosts", "gpu-a01,gpu-a02").exit_code == 0
    script = (out / "launch_torchrun.sh").read_text()
    assert "DSPLAN_RDZV_BACKEND" in script and "static (default)" in script and "ignores NODE_RANK" in script
    readme = (out / "README.md").read_text()
    assert "MASTER_ADDR=gpu-a01 NODE_RANK=<i> ./launch_torchrun.sh" in readme
    assert "DSPLAN_RDZV_BACKEND=c10d" in readme


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
                                                  "DSPLAN_PYTHON": sys.executable, "STUB_LOG": str(tmp_path / "s")},
               "node")
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


# --- Kubernetes: gang scheduling, RDMA, shared memory ------------------------------------------


def k8s_job(tmp_path: Path, *flags: str, hardware: str = "dgx-h100", nodes: int = 4, name: str = "run") -> dict:
    out = tmp_path / name
    plan = write_plan(tmp_path, "llama-3.1-8b", nodes, name=f"{name}.json", hardware=hardware, zero_stage=1)
    result = invoke("generate", "--plan", str(plan), "--out", str(out), *flags)
    assert result.exit_code == 0, result.output
    return yaml.safe_load((out / "k8s-job.yaml").read_text())


def containers(job: dict) -> list[tuple[dict, dict]]:
    return [(spec["template"]["spec"], spec["template"]["spec"]["containers"][0])
            for spec in job["spec"]["pytorchReplicaSpecs"].values()]


def test_k8s_job_is_gang_scheduled_asks_for_rdma_and_sizes_shared_memory(tmp_path: Path):
    job = k8s_job(tmp_path)
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 4}  # every pod or none
    pods = containers(job)
    assert sum(spec["replicas"] for spec in job["spec"]["pytorchReplicaSpecs"].values()) == 4
    for pod, container in pods:
        assert "schedulerName" not in pod  # left to the cluster / the operator's gang scheduler
        for kind in ("limits", "requests"):
            assert container["resources"][kind] == {"nvidia.com/gpu": 8, "rdma/rdma_shared_device_a": 1}
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Gi"}  # a quarter of the DGX H100's 2 TB
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_k8s_scheduler_and_rdma_resource_are_overridable(tmp_path: Path):
    job = k8s_job(tmp_path, "--k8s-scheduler", "volcano", "--k8s-rdma", "nvidia.com/hostdev=8")
    for pod, container in containers(job):
        assert pod["schedulerName"] == "volcano"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "nvidia.com/hostdev": 8}
    job = k8s_job(tmp_path, "--k8s-rdma", "none", name="none")
    for pod, container in containers(job):
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]  # still an InfiniBand fabric


def test_k8s_job_on_an_ethernet_fabric_asks_for_no_rdma(tmp_path: Path):
    job = k8s_job(tmp_path, hardware="mi250x", nodes=2)
    for _, container in containers(job):
        assert container["resources"]["limits"] == {"amd.com/gpu": 8}
        assert "securityContext" not in container


@pytest.mark.parametrize("flag, value, needle", [
    ("--k8s-rdma", "rdma/x=0", "--k8s-rdma 'rdma/x=0'"),
    ("--k8s-rdma", "nodomain", "extended resource name"),
    ("--k8s-rdma", "rdma/x: 1\n  evil: 2", "extended resource name"),
    ("--k8s-scheduler", "Volcano Sched", "not a valid scheduler name"),
])
def test_bad_k8s_settings_exit_2_and_write_nothing(tmp_path: Path, flag: str, value: str, needle: str):
    out = tmp_path / "run"
    result = invoke("generate", "--plan", str(write_plan(tmp_path, "llama-3.1-8b", 2, zero_stage=1)), "--out", str(out),
                    flag, value)
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()


# --- a custom entry travels with the run directory ---------------------------------------------


def test_a_pod_finds_a_custom_entry_inside_the_run_directory(tmp_path: Path):
    """The pod sees only the run directory (on the PVC, under its own name): entry.sh runs the
    copy generate put there, not the host path, which does not exist in the pod."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "helper.py").write_text("VALUE = 'from the helper beside the script'\n")
    (source / "train.py").write_text(STUB_ENTRY + "import helper\nprint(helper.VALUE)\n")
    out = tmp_path / "host" / "myrun"
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    result = invoke("generate", "--plan", str(plan), "--out", str(out), "--entry", str(source / "train.py"), "--json",
                    "--", *TRICKY_ARGS)
    assert result.exit_code == 0, result.output
    assert "train.py" in json.loads(result.output)["files"]
    assert (out / "train.py").read_text() == (source / "train.py").read_text()
    entry_sh = (out / "entry.sh").read_text()
    assert f"-u {source / 'train.py'}" not in entry_sh and 'exec "$PYTHON" -u "$ENTRY"' in entry_sh
    assert "train.py" in (out / "README.md").read_text()

    log = tmp_path / "stub.jsonl"
    env = {**os.environ, "DSPLAN_PYTHON": sys.executable, "STUB_LOG": str(log)}
    # On the host: the copy runs, and the modules beside the original still import.
    proc = subprocess.run(["bash", str(out / "entry.sh"), "--x"], env=env, capture_output=True, text=True, check=True)
    assert "from the helper beside the script" in proc.stdout
    # In a pod: the run directory at the PVC's mount, the host's source directory gone.
    job = yaml.safe_load((out / "k8s-job.yaml").read_text())
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    mount = tmp_path / "pvc"
    pod_dir = mount / Path(container["workingDir"]).name
    shutil.copytree(out, pod_dir)
    (pod_dir / "train.py").write_text(STUB_ENTRY)  # the pod's image would provide helper; this test has none
    shutil.rmtree(source)
    log.unlink()
    subprocess.run(["bash", str(pod_dir / "entry.sh"), "--x"], env=env, capture_output=True, text=True, check=True)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["argv"] == ["--deepspeed", "--deepspeed_config", str(pod_dir / "ds_config.json"), *TRICKY_ARGS, "--x"]


def test_regenerating_after_changing_the_entry_updates_its_copy_and_protects_edits_to_it(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("print('v1')\n")
    out = tmp_path / "run"
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    args = ("generate", "--plan", str(plan), "--out", str(out), "--entry", str(script))
    assert invoke(*args).exit_code == 0
    script.write_text("print('v2')\n")
    assert invoke(*args).exit_code == 0 and (out / "train.py").read_text() == "print('v2')\n"
    (out / "train.py").write_text("print('edited in the run directory')\n")
    refused = invoke(*args)
    assert refused.exit_code == 2 and "train.py" in refused.output
    # back to the builtin trainer: the copy is generate's own stale file, removed
    (out / "train.py").write_text("print('v2')\n")
    assert invoke("generate", "--plan", str(plan), "--out", str(out)).exit_code == 0
    assert not (out / "train.py").exists()


def test_an_entry_named_like_a_run_file_is_refused(tmp_path: Path):
    script = tmp_path / "entry.sh"
    script.write_text("print('hi')\n")
    out = tmp_path / "run"
    result = invoke("generate", "--plan", str(write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)), "--out", str(out),
                    "--entry", str(script))
    assert result.exit_code == 2 and "rename your script" in result.output, result.output
    assert not out.exists()


def test_an_entry_inside_the_run_directory_runs_in_place_and_is_never_removed(tmp_path: Path):
    """A script the user keeps in the run directory (the pod sees it there too) is not copied over
    itself, not recorded as generated, and so not removed when the run goes back to builtin."""
    out = tmp_path / "run"
    (out / "src").mkdir(parents=True)
    script = out / "src" / "train.py"
    script.write_text(STUB_ENTRY)
    plan = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    result = invoke("generate", "--plan", str(plan), "--out", str(out), "--entry", str(script), "--json")
    assert result.exit_code == 0, result.output
    assert not any("train.py" in name for name in json.loads(result.output)["files"])
    pod_dir = tmp_path / "pvc" / "run"
    shutil.copytree(out, pod_dir)
    log = tmp_path / "stub.jsonl"
    subprocess.run(["bash", str(pod_dir / "entry.sh")], env={**os.environ, "DSPLAN_PYTHON": sys.executable,
                                                            "STUB_LOG": str(log)}, check=True)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["argv"][:3] == ["--deepspeed", "--deepspeed_config", str(pod_dir / "ds_config.json")]
    assert invoke("generate", "--plan", str(plan), "--out", str(out)).exit_code == 0
    assert script.read_text() == STUB_ENTRY
