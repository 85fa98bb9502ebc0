"""``dsplan run``: bad input (exit 2, no traceback), --dry-run, and the report's arithmetic.

These tests start no training job. The real DeepSpeed runs (local, two-node, faults, Ctrl-C)
are in test_run_supervisor.py.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.run.report import final_records, measure, relative_error

MODEL = "gpt3-125m"


def generate(tmp_path: Path, name: str, *, nodes: int = 1, gpus_per_node: int = 2, zero: int = 2, steps: int = 8,
             checkpoint_every: int = 2, seq_len: int = 128, extra: tuple[str, ...] = ()) -> Path:
    """A real run directory: `dsplan estimate --json` for a small cluster, then `dsplan generate --plan`."""
    runner = CliRunner()
    dp = nodes * gpus_per_node
    est = runner.invoke(main, ["estimate", "--model", MODEL, "--nodes", str(nodes),
                               "--gpus-per-node", str(gpus_per_node),
                               "--zero", str(zero), "--micro-batch", "1", "--global-batch", str(dp),
                               "--seq-len", str(seq_len), "--json"])
    assert est.exit_code == 0, est.output
    plan_path = tmp_path / f"{name}.plan.json"
    plan_path.write_text(est.stdout)
    out = tmp_path / name
    gen = runner.invoke(main, ["generate", "--plan", str(plan_path), "--out", str(out), "--steps", str(steps),
                               "--checkpoint-every", str(checkpoint_every), *extra])
    assert gen.exit_code == 0, gen.output
    return out


def run_cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["run", *args], env=env)


def assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("rundirs")
    return {
        "one": generate(base, "one"),
        "two": generate(base, "two", nodes=2, gpus_per_node=1),
        "big": generate(base, "big", nodes=64, gpus_per_node=8),
    }


# -- bad input ------------------------------------------------------------------------------

def test_not_a_run_directory(tmp_path):
    assert_user_error(run_cli(str(tmp_path)), "not a run directory", "plan.json", "dsplan generate")
    assert_user_error(run_cli(str(tmp_path / "missing")), "no such directory")
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "ds_config.json").write_text("{}")
    (tmp_path / "entry.sh").write_text("#!/bin/sh\n")
    result = run_cli(str(tmp_path))  # no launch script
    assert_user_error(result, "missing launch_deepspeed.sh")
    assert "plan.json" not in result.output.split("missing")[1].split(")")[0]


def test_malformed_plan_json(run_dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("ds_config.json", "entry.sh", "launch_deepspeed.sh"):
        (broken / name).write_text((run_dirs["one"] / name).read_text())
    (broken / "plan.json").write_text("{not json")
    assert_user_error(run_cli(str(broken), "--dry-run"), "plan.json: not valid JSON")
    (broken / "plan.json").write_text(json.dumps({"model": MODEL, "nodes": 1, "gpus_per_node": 2, "dp": 3,
                                                  "micro_batch": 1, "global_batch": 3, "seq_len": 128}))
    assert_user_error(run_cli(str(broken), "--dry-run"), "plan.json", "dp x tp x pp")


def test_local_refuses_more_processes_than_it_can_start(run_dirs):
    limit = max(2, (os.cpu_count() or 1) * 2)
    assert limit < 512  # the 64-node plan below needs more processes than any test machine starts
    result = run_cli(str(run_dirs["big"]), "--local", "--dry-run")
    assert_user_error(result, "needs 512 processes", "64 node(s) x 8 GPUs", f"at most {limit}", "--gpus-per-node")
    result = run_cli(str(run_dirs["big"]), "--dry-run", "--json")  # without --local it is a cluster job
    assert result.exit_code == 0 and json.loads(result.stdout)["commands"][0]["argv"][1] == "ssh"


def test_missing_deepspeed_says_how_to_install(run_dirs, tmp_path):
    bare = tmp_path / "bare-venv"  # a real interpreter without DeepSpeed
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    python = bare / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import deepspeed"], capture_output=True, timeout=60)
    assert probe.returncode != 0
    result = run_cli(str(run_dirs["one"]), "--local", "--steps", "2", env={"DSPLAN_PYTHON": str(python)})
    assert_user_error(result, "DeepSpeed is not installed", str(python), "pip install 'dsplan[run]'")
    assert not (run_dirs["one"] / ".dsplan-run").exists()  # nothing started, nothing written
    result = run_cli(str(run_dirs["one"]), env={"DSPLAN_PYTHON": str(tmp_path / "nope" / "python")})
    assert_user_error(result, "no such interpreter")


def test_options_the_entry_cannot_take(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    own = generate(tmp_path, "own", extra=("--entry", str(script)))
    assert_user_error(run_cli(str(own), "--steps", "3", "--dry-run"), "--steps", "your own script")
    assert_user_error(run_cli(str(own), "--local", "--dry-run"), "--local", "your own script")


def test_plans_the_reference_trainer_cannot_run_are_refused_before_any_rank_starts(tmp_path):
    """Interleaved pipelines and Megatron's tensor parallelism are beyond the reference trainer
    (the default entry). The search of generate never picks them for it (test_generate_trainer_plans.py);
    a --plan file may hold one: generate notes it, and `dsplan run` refuses with what to run instead
    (exit 2) before it writes or starts anything, where every rank used to fail after start-up.
    With the user's own entry the same plan is theirs to run."""
    runner = CliRunner()
    flags = ["--model", MODEL, "--nodes", "1", "--framework", "megatron", "--global-batch", "64"]

    def from_plan(name: str, *degrees: str, entry: tuple[str, ...] = ()):
        est = runner.invoke(main, ["estimate", *flags, *degrees, "--json"])
        assert est.exit_code == 0, est.output
        (tmp_path / f"{name}.json").write_text(est.stdout)
        return runner.invoke(main, ["generate", "--plan", str(tmp_path / f"{name}.json"), *entry,
                                    "--out", str(tmp_path / name)])

    gen = from_plan("vpp", "--tp", "1", "--pp", "4", "--virtual-stages", "2")
    assert gen.exit_code == 0, gen.output
    vpp = tmp_path / "vpp"
    assert "note: the default entry cannot run this plan" in gen.output
    # ... and the next step it suggests is Megatron-LM's script, not the launcher that would fail
    assert "next: dsplan generate ... --out" in gen.output and "--entry pretrain_gpt.py" in gen.output
    assert "launch_deepspeed.sh" not in gen.output
    for extra in (("--dry-run",), ()):
        assert_user_error(run_cli(str(vpp), *extra), "virtual_stages=2", "Megatron-LM's own training script", "--entry")
    assert not (vpp / ".dsplan-run").exists() and not (vpp / "report.json").exists()
    assert from_plan("tp", "--tp", "2", "--pp", "1").exit_code == 0
    assert_user_error(run_cli(str(tmp_path / "tp"), "--dry-run"), "a megatron plan with tp=2", "AutoTP",
                      "megatron_args.sh")
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("print('hello')\n")
    own = runner.invoke(main, ["generate", *flags, "--tp", "2", "--pp", "1", "--entry", str(script),
                               "--out", str(tmp_path / "own"), "--json"])
    assert own.exit_code == 0 and json.loads(own.stdout)["warnings"] == []
    assert json.loads(own.stdout)["plan"]["tp"] == 2
    assert run_cli(str(tmp_path / "own"), "--dry-run").exit_code == 0


def test_launcher_rules(run_dirs):
    assert_user_error(run_cli(str(run_dirs["two"]), "--launcher", "torchrun"), "torchrun", "2 nodes")
    assert_user_error(run_cli(str(run_dirs["one"]), "--launcher", "slurm", "--local"), "--local", "slurm")
    assert_user_error(run_cli(str(run_dirs["one"]), "--local", "--scale", "huge", "--dry-run"), "--scale")
    result = run_cli(str(run_dirs["one"]), "--launcher", "slurm", env={"PATH": "/usr/bin:/bin"})
    assert_user_error(result, "sbatch is not on PATH")


# -- dry run --------------------------------------------------------------------------------

def test_dry_run_local_one_node_prints_the_command_and_runs_nothing(run_dirs):
    run_dir = run_dirs["one"]
    before = sorted(p.name for p in run_dir.iterdir())
    result = run_cli(str(run_dir), "--local", "--steps", "3", "--dry-run")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no metrics, no runtime files
    lines = [line for line in result.output.splitlines() if not line.startswith("#")]
    assert len(lines) == 1
    words = shlex.split(lines[0])
    assert words[:3] == ["cd", str(run_dir.resolve()), "&&"]
    env = dict(w.split("=", 1) for w in words[4:] if "=" in w and not w.startswith("-"))
    assert env["DS_ACCELERATOR"] == "cpu" and env["GPUS_PER_NODE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert 1024 <= int(env["MASTER_PORT"]) <= 65535
    assert env["DSPLAN_PYTHON"].endswith(".dsplan-run/rank_python") and env["DSPLAN_RANK_PYTHON"]
    assert "-u" in words and "CUDA_VISIBLE_DEVICES" in words
    tail = words[words.index("./launch_deepspeed.sh"):]
    assert tail == ["./launch_deepspeed.sh", "local", "--steps", "3", "--scale", "tiny", "--seq-len", "128"]
    assert "DSPLAN_RESUME=1" in result.output  # says what a restart adds


def test_dry_run_two_nodes_json(run_dirs):
    result = run_cli(str(run_dirs["two"]), "--local", "--checkpoint-every", "3", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["local_adaptation"]["nodes_simulated"] == 2 and data["local_adaptation"]["processes_per_node"] == 1
    nodes = data["commands"]
    assert [c["name"] for c in nodes] == ["node0", "node1"]
    assert [c["env"]["NODE_RANK"] for c in nodes] == ["0", "1"]
    assert nodes[0]["env"]["MASTER_PORT"] == nodes[1]["env"]["MASTER_PORT"]
    assert all(c["argv"][:2] == ["./launch_deepspeed.sh", "node"] for c in nodes)
    assert all("--checkpoint-every" in c["argv"] for c in nodes)
    hostfile = nodes[0]["env"]["DSPLAN_HOSTFILE"]
    assert hostfile in data["files"] and not Path(hostfile).exists()
    assert len({c["env"]["DSPLAN_JOB_ID"] for c in nodes}) == 1


def test_local_runs_build_deepspeed_ops_in_the_cache_the_tests_use(run_dirs):
    """The tests compile DeepSpeed's CPU ops once (minutes); `dsplan run --local` must load them
    from the same cache, not compile them again into another. TORCH_EXTENSIONS_DIR, when set
    (CI sets it), is left to the job, and the tests take it too."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    probe = "import os, tests.conftest; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    tests_cache = subprocess.run([sys.executable, "-c", probe], env=env, cwd=repo, capture_output=True, text=True,
                                 timeout=120, check=True).stdout.strip()
    dry = [sys.executable, "-m", "planner", "run", str(run_dirs["two"]), "--local", "--dry-run", "--json"]
    commands = json.loads(subprocess.run(dry, env=env, capture_output=True, text=True, timeout=120,
                                         check=True).stdout)["commands"]
    assert [c["env"]["TORCH_EXTENSIONS_DIR"] for c in commands] == [tests_cache, tests_cache]
    assert tests_cache.startswith(str(Path.home() / ".cache" / "torch_extensions" / "dsplan-"))
    given = {**env, "TORCH_EXTENSIONS_DIR": "/somewhere/else"}
    commands = json.loads(subprocess.run(dry, env=given, capture_output=True, text=True, timeout=120,
                                         check=True).stdout)["commands"]
    assert all("TORCH_EXTENSIONS_DIR" not in c["env"] for c in commands)  # the environment's, inherited
    assert subprocess.run([sys.executable, "-c", probe], env=given, cwd=repo, capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip() == "/somewhere/else"


def test_dry_run_cluster_launchers(run_dirs):
    one = run_cli(str(run_dirs["one"]), "--dry-run", "--json")
    assert json.loads(one.stdout)["commands"][0]["argv"] == ["./launch_deepspeed.sh", "local"]
    two = json.loads(run_cli(str(run_dirs["two"]), "--dry-run", "--json").stdout)["commands"]
    assert len(two) == 1 and two[0]["argv"] == ["./launch_deepspeed.sh", "ssh"]  # DeepSpeed starts every host
    assert "DS_ACCELERATOR" not in two[0]["env"]
    from planner.run.job import build_job

    restart = build_job(run_dirs["two"], steps=5).commands(attempt=1)[0]  # what a restart runs
    assert restart.env["DSPLAN_RESUME"] == "1" and restart.argv[-1] == "--resume"  # also for ssh-started hosts
    slurm = run_cli(str(run_dirs["two"]), "--launcher", "slurm", "--steps", "5", "--dry-run")
    assert slurm.exit_code == 0, slurm.output
    assert "sbatch --wait slurm.sbatch --steps 5" in slurm.output
    torchrun = json.loads(run_cli(str(run_dirs["two"]), "--launcher", "torchrun", "--local", "--dry-run",
                                  "--json").stdout)["commands"]
    assert [c["argv"][0] for c in torchrun] == ["./launch_torchrun.sh"] * 2
    assert [c["env"]["NODE_RANK"] for c in torchrun] == ["0", "1"]


# -- the report's arithmetic ----------------------------------------------------------------

def _records(attempt: int, steps: range, times: dict[int, float], rank_extra: float = 0.0):
    out = []
    for rank in (0, 1):
        for step in steps:
            out.append({"step": step, "rank": rank, "loss": 6.0 - 0.1 * step + attempt * 0.01,
                        "step_time_s": times[step] + rank * rank_extra, "tokens": 256,
                        "peak_memory_bytes": 100_000_000 + 1000 * step + 7 * rank, "attempt": attempt})
    return out


def test_measure_takes_the_later_attempt_and_skips_warmup():
    first = {s: 0.5 + 0.01 * s for s in range(1, 6)}
    second = {s: 0.3 + 0.02 * s for s in range(3, 9)}
    records = _records(0, range(1, 6), first) + _records(1, range(3, 9), second, rank_extra=0.05)
    final = final_records(records)
    assert final[(0, 4)]["attempt"] == 1 and final[(1, 2)]["attempt"] == 0  # re-run steps come from the restart
    m = measure(records, warmup=1)
    # warm-up: step 1 (attempt 0's first) and step 3 (attempt 1's first) are left out; a step's
    # time is its slowest rank's (rank 1 in attempt 1)
    slowest = {2: first[2], **{s: second[s] + 0.05 for s in range(4, 9)}}
    assert m["warmup_steps_excluded"] == 2 and m["steps_measured"] == len(slowest)
    assert m["step_time_s"] == pytest.approx(statistics.median(slowest.values()))
    assert m["tokens_per_s"] == pytest.approx(256 / m["step_time_s"])
    assert m["peak_memory_bytes_per_rank"] == {"0": 100_008_000, "1": 100_008_007}
    assert relative_error(2.0, 1.6) == pytest.approx(0.25) and relative_error(1.0, None) is None
    assert relative_error(1.0, 0) is None


def test_remove_shm_buffers_takes_only_that_jobs_buffers():
    """DeepSpeed's CPU all-reduce leaves /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    behind; the supervisor removes its own job's, and nothing else (another job, another port)."""
    from planner.run.processes import SHM_DIR, remove_shm_buffers, shm_buffer_name

    port = 40000 + os.getpid() % 20000
    mine = [Path(SHM_DIR) / shm_buffer_name("127.0.0.1", port, r) for r in (0, 1, 12)]
    others = [Path(SHM_DIR) / shm_buffer_name("127.0.0.1", port + 1, 0),  # another job
              Path(SHM_DIR) / shm_buffer_name("127.0.0.1", f"{port}0", 0),  # a port that starts the same
              Path(SHM_DIR) / (shm_buffer_name("127.0.0.1", port, 0) + "x")]
    try:
        for path in mine + others:
            path.write_bytes(b"\0" * 16)
        assert remove_shm_buffers("127.0.0.1", port) == 3
        assert not any(p.exists() for p in mine)
        assert all(p.exists() for p in others)
    finally:
        for path in mine + others:
            path.unlink(missing_ok=True)


def test_a_plan_for_a_cpu_profile_runs_locally_as_planned(tmp_path):
    """--hardware cpu-local: the real model at the planned sequence, not a tiny-scale smoke run."""
    runner = CliRunner()
    est = runner.invoke(main, ["estimate", "--model", "gpt3-125m", "--hardware", "cpu-local", "--zero", "2",
                               "--micro-batch", "1", "--global-batch", "2", "--seq-len", "512", "--precision", "fp32",
                               "--json"])
    assert est.exit_code == 0, est.output
    (tmp_path / "p.json").write_text(est.stdout)
    gen = runner.invoke(main, ["generate", "--plan", str(tmp_path / "p.json"), "--out", str(tmp_path / "r")])
    assert gen.exit_code == 0, gen.output
    cpu = json.loads(run_cli(str(tmp_path / "r"), "--local", "--dry-run", "--json").stdout)["local_adaptation"]
    assert (cpu["scale"], cpu["seq_len"], cpu["planned_seq_len"], cpu["processes_per_node"]) == ("1", 512, 512, 2)
    gpu = json.loads(run_cli(str(generate(tmp_path, "gpu", seq_len=512)), "--local", "--dry-run", "--json").stdout)
    assert (gpu["local_adaptation"]["scale"], gpu["local_adaptation"]["seq_len"]) == ("tiny", 256)
