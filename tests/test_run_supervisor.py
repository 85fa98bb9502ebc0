"""``dsplan run --local`` with real DeepSpeed on CPU: report, two nodes, a killed rank, a hung rank, Ctrl-C.

Each test starts ``python -m planner run DIR --local ...`` as a user would, in its own process,
and acts on the job from outside the way a real fault would: SIGKILL to a rank's PID, SIGSTOP
to freeze one, SIGINT to dsplan itself. Rank processes are found by a /proc scan for the job's
DSPLAN_JOB_ID (chosen here through DSPLAN_RUN_ID) and the rank's RANK. Every wait has a deadline.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_cli_run import generate

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900  # a fresh machine JIT-builds DeepSpeed's ops on the first start (minutes)


def job_pids(job_id: str, rank: int | None = None) -> list[int]:
    """Live processes carrying DSPLAN_JOB_ID=job_id (and RANK=rank, running the trainer, if given)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            if stat.rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                continue
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            if f"DSPLAN_JOB_ID={job_id}".encode() not in env:
                continue
            if rank is not None:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
                if f"RANK={rank}".encode() not in env or b"planner.run.trainer" not in cmd:
                    continue
            found.append(int(name))
        except (OSError, IndexError):
            continue
    return found


def metrics(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / f"metrics.rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def wait_for(what: str, condition, proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"dsplan run exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


class DsplanRun:
    """``python -m planner run DIR --local ...`` in the background, output to files."""

    def __init__(self, run_dir: Path, *args: str):
        self.job_id = uuid.uuid4().hex[:12]
        self.out = run_dir.parent / f"{run_dir.name}.stdout"
        self.err = run_dir.parent / f"{run_dir.name}.stderr"
        env = dict(os.environ, DSPLAN_RUN_ID=self.job_id)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "planner", "run", str(run_dir), "--local", *args],
                                         cwd=REPO_ROOT, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=120)
            raise AssertionError(f"dsplan run did not finish in {timeout} s; log tail:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in job_pids(self.job_id):
            os.kill(pid, signal.SIGKILL)


def check_prediction_columns(report: dict, plan: dict) -> None:
    """Measured beside predicted, with the relative error computed from the two."""
    measured, predicted = report["measured"], report["predicted"]
    assert predicted["step_time_s"] == plan["step_time_s"] and predicted["tokens_per_s"] == plan["tokens_per_s"]
    assert predicted["peak_memory_bytes_per_rank"] == {"0": plan["stages"][0]["memory"]["peak_bytes"],
                                                      "1": plan["stages"][-1]["memory"]["peak_bytes"]}
    assert measured["step_time_s"] > 0
    assert measured["tokens_per_s"] == pytest.approx(measured["tokens_per_step"] / measured["step_time_s"])
    assert set(measured["peak_memory_bytes_per_rank"]) == {"0", "1"}
    assert all(v > 50 * 2**20 for v in measured["peak_memory_bytes_per_rank"].values())  # a process with torch
    rows = {row["metric"]: row for row in report["comparison"]}
    for metric in ("step_time_s", "tokens_per_s", "peak_memory_bytes_rank0", "peak_memory_bytes_rank1"):
        row = rows[metric]
        assert row["relative_error"] == pytest.approx((row["measured"] - row["predicted"]) / row["predicted"])
    assert rows["step_time_s"]["measured"] == measured["step_time_s"]
    # goodput: the steps that count, each once, over the run's wall time (start-up, saves, lost
    # steps and restarts are the rest), beside the plan's prediction
    assert predicted["goodput"] == plan["goodput"] and 0 < plan["goodput"] <= 1
    assert 0 < measured["goodput"] < 1 and rows["goodput"]["measured"] == measured["goodput"]
    assert report["local"] and "CPU" in report["note"] and "not a statement" in report["note"]
    assert report["adapted_prediction"] is None and "not be meaningful" in report["adapted_prediction_note"]
    # the local run trains tokens of its own sequence length; the plan's tokens per step are recorded beside
    assert measured["tokens_per_step"] == plan["global_batch"] * report["local_adaptation"]["seq_len"]


@pytest.mark.deepspeed
def test_killed_and_hung_ranks_restart_from_the_last_checkpoint(tmp_path):
    """ZeRO-2, dp=2: SIGKILL rank 1 mid-run, then SIGSTOP rank 0 after the restart; the job finishes."""
    steps = 40
    run_dir = generate(tmp_path, "fault", steps=steps, checkpoint_every=2)
    plan = json.loads((run_dir / "plan.json").read_text())
    run = DsplanRun(run_dir, "--max-restarts", "2", "--hang-timeout", "20", "--grace", "5", "--json")
    try:
        # attempt 0: kill rank 1 once it has logged step 3 (a checkpoint exists at step 2)
        victim = wait_for("rank 1 at step 3", lambda: any(r["step"] >= 3 for r in metrics(run_dir, 1))
                          and job_pids(run.job_id, rank=1), run.proc)[0]
        before = job_pids(run.job_id, rank=0)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        killed_after = max(r["step"] for r in metrics(run_dir, 1))

        # attempt 1: freeze rank 0 two steps after the restart; the other rank then waits forever
        def restarted_and_running():
            pids = [p for p in job_pids(run.job_id, rank=0) if p not in before]
            return len([r for r in metrics(run_dir, 0) if r["time"] > killed_at]) >= 2 and pids
        frozen = wait_for("two steps after the restart", restarted_and_running, run.proc)[0]
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = max(r["step"] for r in metrics(run_dir, 0))
        assert victim not in job_pids(run.job_id)
        code = run.wait()
    finally:
        run.cleanup()
    log = run.log()
    assert code == 0, log[-4000:]
    assert job_pids(run.job_id) == []  # nothing of the job is left
    # nor DeepSpeed's shared-memory buffers, of the killed and the frozen ranks' attempts too
    from planner.run.processes import SHM_BUFFER_PREFIX, SHM_DIR

    ports = set(re.findall(r"MASTER_PORT=(\d+)", log))
    assert len(ports) == 3  # one per attempt
    assert not [p for port in ports for p in Path(SHM_DIR).glob(f"{SHM_BUFFER_PREFIX}_*_127.0.0.1_{port}_*")]
    report = json.loads(run.out.read_text())
    assert report == json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"]["last"] == steps

    first, second = report["restarts"]
    assert first["reason"].startswith("dead rank") and "SIGKILL" in first["reason"], first
    assert second["reason"].startswith("hang: no progress for") and f"after step {frozen_at}" in second["reason"]
    for restart, event_step in ((first, killed_after), (second, frozen_at)):
        resumed = restart["resumed_from_step"]
        assert resumed is not None and resumed % 2 == 0 and 2 <= resumed <= event_step
        assert restart["first_step_after_restart"] == resumed + 1  # continues from the checkpoint, not step 0
    assert first["time"] < second["time"]

    # the step count continues: each attempt starts one past the checkpoint it loaded
    records = metrics(run_dir, 0)
    attempts = report["attempts"]
    assert [a["outcome"] for a in attempts] == ["failed", "hang", "completed"]
    assert attempts[0]["first_step"] == 1
    assert attempts[1]["first_step"] == first["resumed_from_step"] + 1
    assert attempts[2]["first_step"] == second["resumed_from_step"] + 1 and attempts[2]["last_step"] == steps
    for attempt in attempts:  # rank 0's steps in each attempt: consecutive from one past its checkpoint
        mine = [r["step"] for r in records if attempt["started"] <= r["time"] <= attempt["ended"]]
        assert mine == list(range(attempt["first_step"], attempt["first_step"] + len(mine))), (attempt, mine)
        assert len(mine) >= 2
    assert records[-1]["step"] == steps
    # and the loss continues: a step run again after the restart has the loss it had before
    by_step: dict[int, list[float]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r["loss"])
    repeated = {s: losses for s, losses in by_step.items() if len(losses) > 1}
    assert repeated, "a killed attempt always re-runs the steps after its last checkpoint"
    for s, losses in repeated.items():
        assert losses[-1] == pytest.approx(losses[0], rel=1e-3), (s, losses)
    curve = report["loss_curve"]
    assert [p["step"] for p in curve] == list(range(1, steps + 1))
    assert all(math.isfinite(p["loss"]) for p in curve) and curve[-1]["loss"] < curve[0]["loss"]
    assert curve[-1]["attempt"] == 2 and curve[0]["attempt"] == 0

    # measured goodput: each step once (its last run, the slowest rank) over the wall time; the
    # killed and the frozen attempts' lost steps, the restarts and the start-ups are what it leaves out
    last: dict[int, dict[int, float]] = {}
    for rank in (0, 1):
        for r in metrics(run_dir, rank):  # a file appends each attempt after the one before
            last.setdefault(r["step"], {})[rank] = r["step_time_s"]
    useful = sum(max(per_rank.values()) for per_rank in last.values())
    assert report["measured"]["goodput"] == pytest.approx(useful / report["wall_time_s"], rel=1e-9)
    assert report["measured"]["goodput"] < 0.9  # two restarts and three start-ups in a 40-step run

    # the checkpoints: every kept tag complete, the newest published; the last attempt loaded one
    from planner.run import checkpoint

    ckpt = run_dir / "checkpoints"
    assert checkpoint.latest_good(ckpt) == checkpoint.tag_for(steps)
    tags = sorted(p.name for p in ckpt.glob("step_*"))
    assert tags and all(checkpoint.is_complete(ckpt, t) for t in tags)
    info = json.loads((run_dir / "run_info.rank0.json").read_text())
    assert info["resumed_from"] == checkpoint.tag_for(second["resumed_from_step"])
    check_prediction_columns(report, plan)
    assert "[rank 0] step" in log and "[rank 1]" in log and "[dsplan] restart 2/2" in log


@pytest.mark.deepspeed
def test_two_nodes_on_localhost(tmp_path):
    """A 2-node x 1-GPU plan: two DeepSpeed launchers in node mode (--no_ssh --node_rank) on this machine."""
    run_dir = generate(tmp_path, "two", nodes=2, gpus_per_node=1, steps=4, checkpoint_every=0)
    plan = json.loads((run_dir / "plan.json").read_text())
    run = DsplanRun(run_dir)
    try:
        code = run.wait()
    finally:
        run.cleanup()
    out = run.out.read_text()
    assert code == 0, out[-4000:] + run.err.read_text()[-2000:]
    assert "--node_rank=0" in out and "--node_rank=1" in out  # the DeepSpeed launcher of each node
    assert "[node0] [rank 0] step 4/4" in out  # rank 0 lives on node 0
    assert "[node1] [rank 1]" in out
    infos = [json.loads((run_dir / f"run_info.rank{r}.json").read_text()) for r in (0, 1)]
    assert [i["world_size"] for i in infos] == [2, 2] and infos[0]["zero_stage"] == 2
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["restarts"] == []
    assert report["local_adaptation"]["nodes_simulated"] == 2
    assert [p["step"] for p in report["loss_curve"]] == [1, 2, 3, 4]
    assert report["measured"]["warmup_steps_excluded"] == 1 and report["measured"]["steps_measured"] == 3
    check_prediction_columns(report, plan)
    assert "measured" in out and "predicted" in out and "report.json" in out  # the human summary


@pytest.mark.deepspeed
def test_ctrl_c_stops_every_rank(tmp_path):
    """SIGINT to dsplan run (through torchrun this time; the other tests stop DeepSpeed's launcher)."""
    run_dir = generate(tmp_path, "ctrlc", steps=100000, checkpoint_every=0)
    run = DsplanRun(run_dir, "--launcher", "torchrun")
    try:
        ranks = wait_for("both ranks at step 2", lambda: all(any(r["step"] >= 2 for r in metrics(run_dir, k))
                                                               for k in (0, 1))
                         and [job_pids(run.job_id, rank=k) for k in (0, 1)], run.proc)
        launcher = job_pids(run.job_id)
        assert len(launcher) >= 4  # torchrun, two ranks and their output prefixers
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(timeout=120)
    finally:
        run.cleanup()
    assert code == 130, run.log()[-3000:]
    assert job_pids(run.job_id) == []
    for pids in ranks:
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["attempts"][-1]["outcome"] == "interrupted"
    assert report["steps"]["last"] >= 2
    assert not any(line.startswith("Traceback") for line in run.log().splitlines())  # dsplan's own output


def test_a_signal_is_acted_on_at_the_next_check_not_where_it_lands(tmp_path):
    """The handler only records SIGINT; the supervisor's loop raises JobInterrupted at its next
    check. Raised from the handler, the exception could land inside MetricsTail.poll after it
    had consumed lines, losing the steps they record (a Ctrl-C once left report.json with no
    last step although both ranks had logged two)."""
    from planner.run.metrics import MetricsTail
    from planner.run.supervisor import JobInterrupted, Supervisor

    sup = Supervisor(job=None)  # type: ignore[arg-type]
    previous = sup._install_signals()
    try:
        metrics = tmp_path / "metrics.rank0.jsonl"
        metrics.write_text("")
        tail = MetricsTail(tmp_path / "metrics.jsonl")
        metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode boundary, here
        assert [r["step"] for r in tail.poll()] == [1, 2]
        assert sup.interrupted == "SIGINT"
        with pytest.raises(JobInterrupted, match="SIGINT"):
            sup._check_interrupted()
    finally:
        sup._restore_signals(previous)


def test_a_short_startup_timeout_is_kept_as_given():
    """--startup-timeout below --hang-timeout used to be raised to it silently (a 3 s limit ran
    20 s without being flagged)."""
    from planner.run.supervisor import Supervisor

    sup = Supervisor(job=None, hang_timeout_s=600, startup_timeout_s=3)  # type: ignore[arg-type]
    assert (sup.startup_timeout_s, sup.hang_timeout_s) == (3, 600)
