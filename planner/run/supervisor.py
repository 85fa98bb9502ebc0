"""Start a job's launchers, watch them, stop them cleanly, restart from the last good checkpoint.

Each launcher starts in a new session (its own process group), so the whole job, including
the ranks the launcher spawns, can be signalled at once; every process of the job also carries
``DSPLAN_JOB_ID`` in its environment, so a process that left its group is still found by a scan
of ``/proc``. Stopping is SIGTERM (plus SIGCONT, so a stopped rank can act on it), a grace
period, then SIGKILL for whatever is left; ``run`` returns only when no process of the job is
alive.

Failure detection:
- a dead rank: any launcher exits non-zero (DeepSpeed's and torchrun's launchers exit when one
  of their ranks does), or a launcher exits cleanly before the last step was logged;
- a hang: no new step in the metrics and no output line for ``hang_timeout_s`` seconds (before
  the first step of an attempt the limit is ``startup_timeout_s``: DeepSpeed may JIT-compile).

A failed attempt is restarted with ``DSPLAN_RESUME=1`` up to ``max_restarts`` times; the trainer
then loads the newest checkpoint that every rank finished (checkpoints/latest_good).
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from planner.errors import UserError
from planner.run import checkpoint
from planner.run.job import Job
from planner.run.local import LOCAL_MASTER_ADDR
from planner.run.metrics import MetricsTail
from planner.run.processes import free_port, job_processes, kill, killpg, remove_shm_buffers, signal_name

GRACE_S = 15.0
POLL_S = 0.2
# DeepSpeed's launch.py logs the rank that failed: "[... '--local_rank=1', ...] exits with return code = -9"
_RANK_EXIT = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")


class JobInterrupted(Exception):
    """SIGINT/SIGTERM reached ``dsplan run`` itself: stop the job and report."""


@dataclass
class Restart:
    attempt: int  # the attempt that started after this restart (1 = the first restart)
    time: float
    reason: str
    resumed_from_step: int | None  # the checkpoint step the restart resumes from (None: from scratch)
    first_step: int | None = None  # the first step the restarted attempt logged


@dataclass
class Attempt:
    index: int
    started: float
    ended: float | None = None
    outcome: str = "running"  # completed | failed | hang | interrupted
    reason: str = ""
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    first_step: int | None = None
    last_step: int | None = None


@dataclass
class RunResult:
    status: str  # completed | failed | interrupted
    started: float
    ended: float
    attempts: list[Attempt]
    restarts: list[Restart]
    records: list[dict[str, Any]]  # every metrics record of this run, tagged with its "attempt"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "started": self.started, "ended": self.ended,
                "attempts": [asdict(a) for a in self.attempts], "restarts": [asdict(r) for r in self.restarts]}


def checkpoint_step(ckpt_dir: Path) -> int | None:
    """The step of the newest readable checkpoint (planner.run.checkpoint's ``readable_tags``:
    the one the trainer resumes from)."""
    found = checkpoint.readable_tags(Path(ckpt_dir))
    return checkpoint.step_of(found[0][1]) if found else None


class Supervisor:
    """Runs ``job`` to completion, restarting failed attempts; ``run()`` returns a RunResult."""

    def __init__(
        self,
        job: Job,
        *,
        max_restarts: int = 0,
        hang_timeout_s: float = 600.0,
        startup_timeout_s: float = 1800.0,
        grace_s: float = GRACE_S,
        echo: Callable[[str], None] = print,
        on_step: Callable[[int, int | None], None] | None = None,
    ):
        self.job = job
        self.max_restarts = max_restarts
        self.hang_timeout_s = hang_timeout_s
        self.startup_timeout_s = startup_timeout_s  # as given, even below hang_timeout_s
        self.grace_s = grace_s
        self.echo = echo
        self.on_step = on_step
        self.records: list[dict[str, Any]] = []
        self.attempts: list[Attempt] = []
        self.restarts: list[Restart] = []
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.rank_exits: list[str] = []
        self.log_fh = None
        self.stopping = False  # a signal while stopping shortens the grace period instead of raising
        self.ports: list[int] = []  # master port of each local attempt
        self.hurry = False
        self.interrupted: str | None = None  # the signal received, acted on at the loop's next safe point

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.time()
        self.job.write_files()
        self.log_fh = open(self.job.runtime_dir / "output.log", "a", buffering=1)
        tail = MetricsTail(self.job.info.metrics_log())
        previous = self._install_signals()
        status = "failed"
        try:
            for index in range(self.max_restarts + 1):
                self._check_interrupted()
                attempt = Attempt(index=index, started=time.time())
                self.attempts.append(attempt)
                outcome = self._run_attempt(attempt, tail)
                if outcome == "completed":
                    status = "completed"
                    break
                if index == self.max_restarts:
                    break
                resumed = checkpoint_step(self.job.info.checkpoint_dir())
                self.restarts.append(Restart(attempt=index + 1, time=time.time(), reason=attempt.reason,
                                             resumed_from_step=resumed))
                where = f"checkpoint step {resumed}" if resumed is not None else "the start (no checkpoint yet)"
                self._say(f"restart {index + 1}/{self.max_restarts}: {attempt.reason}; resuming from {where}")
            if status != "completed":
                self._check_interrupted()  # a signal during the last attempt's stop: say so
        except JobInterrupted as err:
            self.stopping = True  # from here on a further Ctrl-C only hurries the stop
            status = "interrupted"
            self._say(f"{err}: stopping the job")
            self._stop(f"interrupted ({err})")
            current = self.attempts[-1] if self.attempts else None
            if current is not None and current.ended is None:
                self._take(current, tail.poll())  # the steps logged up to the stop
                self._finish(current, "interrupted", f"stopped by {err}",
                             {name: proc.poll() for name, proc in self.procs})
        finally:
            self.stopping = True
            self._stop("cleanup")
            for port in self.ports:  # the local job's ranks are gone: free DeepSpeed's shm buffers
                remove_shm_buffers(LOCAL_MASTER_ADDR, port)
            self._restore_signals(previous)
            self.log_fh.close()
        return RunResult(status, started, time.time(), self.attempts, self.restarts, self.records)

    def _run_attempt(self, attempt: Attempt, tail: MetricsTail) -> str:
        port = free_port() if self.job.local is not None else None
        if port is not None:
            self.ports.append(port)
        commands = self.job.commands(attempt.index, port)
        self.rank_exits = []
        self.procs = []
        for cmd in commands:
            self._say(f"start {cmd.name}: {cmd.shell()}")
            try:
                proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd, env=cmd.environ(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:
                self._stop("a launcher could not start")
                raise UserError(f"{cmd.cwd / cmd.argv[0]}: cannot start it ({err.strerror}); regenerate the run "
                                "directory with `dsplan generate` (launch scripts must be executable)") from None
            self.procs.append((cmd.name, proc))
            threading.Thread(target=self._read, args=(cmd.name, proc), daemon=True).start()
        last_progress = time.monotonic()
        while True:
            self._check_interrupted()
            if self._drain():
                last_progress = time.monotonic()
            new = tail.poll()
            if new:
                last_progress = time.monotonic()
                self._take(attempt, new)
            codes = {name: proc.poll() for name, proc in self.procs}
            failed = {name: code for name, code in codes.items() if code not in (None, 0)}
            if failed:
                time.sleep(POLL_S)  # let the launcher's last lines (which rank died) arrive
                self._drain()
                self._take(attempt, tail.poll())
                return self._fail(attempt, "failed", self._death_reason(failed), codes)
            if all(code == 0 for code in codes.values()):
                self._drain()
                self._take(attempt, tail.poll())
                target = self.job.target_steps if self.job.info.builtin else None
                if target is not None and (attempt.last_step or 0) < target:
                    return self._fail(attempt, "failed", f"the job exited cleanly at step {attempt.last_step or 0} "
                                      f"of {target}", codes)
                self._finish(attempt, "completed", "", codes)
                return "completed"
            limit = self.hang_timeout_s if attempt.last_step is not None else self.startup_timeout_s
            silent = time.monotonic() - last_progress
            if silent > limit:
                if attempt.last_step is None:
                    reason = (f"hang: no step within {limit:.0f} s of the start (a run killed while DeepSpeed "
                              f"builds an op can leave a stale lock in {self.job.extensions_dir})")
                else:
                    reason = f"hang: no progress for {silent:.0f} s after step {attempt.last_step}"
                return self._fail(attempt, "hang", reason, codes)
            time.sleep(POLL_S)

    def _fail(self, attempt: Attempt, outcome: str, reason: str, codes: dict[str, int | None]) -> str:
        self._say(f"{reason}; stopping the job")
        self._stop(reason)
        self._finish(attempt, outcome, reason, {name: proc.poll() for name, proc in self.procs} or codes)
        return outcome

    def _finish(self, attempt: Attempt, outcome: str, reason: str, codes: dict[str, int | None] | None = None) -> None:
        attempt.ended, attempt.outcome, attempt.reason = time.time(), outcome, reason
        if codes is not None:
            attempt.exit_codes = dict(codes)

    def _take(self, attempt: Attempt, records: list[dict[str, Any]]) -> None:
        for record in records:
            record["attempt"] = attempt.index
            self.records.append(record)
            step = record["step"]
            if attempt.first_step is None:
                attempt.first_step = step
                if self.restarts and self.restarts[-1].attempt == attempt.index:
                    self.restarts[-1].first_step = step
            attempt.first_step = min(attempt.first_step, step)
            attempt.last_step = max(attempt.last_step or step, step)
        if records and self.on_step is not None:
            self.on_step(attempt.last_step or 0, self.job.target_steps)

    def _death_reason(self, failed: dict[str, int]) -> str:
        launchers = ", ".join(f"{name} exited with status {code}{signal_name(code)}" for name, code in failed.items())
        if self.rank_exits:
            return f"dead rank: {'; '.join(self.rank_exits)}, so {launchers}"
        return f"dead rank: {launchers}"

    # -- output ------------------------------------------------------------------------------

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            self.lines.put((name, raw.decode("utf-8", errors="replace").rstrip("\n")))

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                name, line = self.lines.get_nowait()
            except queue.Empty:
                return got
            got = True
            match = _RANK_EXIT.search(line)
            if match:
                code = int(match.group(2))
                self.rank_exits.append(f"local rank {match.group(1)} of {name} exited with {code}{signal_name(code)}")
            multi = len(self.procs) > 1
            if line.startswith("[rank "):
                text = f"[{name}] {line}" if multi else line
            else:
                text = f"[{name}] {line}"
            self._emit(text)

    def _say(self, text: str) -> None:
        self._emit(f"[dsplan] {text}")

    def _emit(self, text: str) -> None:
        self.echo(text)
        if self.log_fh is not None and not self.log_fh.closed:
            self.log_fh.write(text + "\n")

    # -- stopping ----------------------------------------------------------------------------

    def _stop(self, why: str) -> None:
        """SIGTERM every process of the job, wait ``grace_s``, SIGKILL the rest; return when none is left."""
        live = [proc for _, proc in self.procs if proc.poll() is None]
        strays = job_processes(self.job.job_id)
        if not live and not strays:
            return
        was_stopping, self.stopping = self.stopping, True
        try:
            self._terminate(live, strays)
        finally:
            self.stopping = was_stopping

    def _terminate(self, live: list[subprocess.Popen], strays: list[int]) -> None:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for proc in live:
                killpg(proc.pid, sig)
            for pid in strays:
                kill(pid, sig)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.hurry:
            if all(proc.poll() is not None for _, proc in self.procs) and not job_processes(self.job.job_id):
                break
            time.sleep(0.1)
        for _, proc in self.procs:
            killpg(proc.pid, signal.SIGKILL)
        for pid in job_processes(self.job.job_id):
            kill(pid, signal.SIGKILL)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while job_processes(self.job.job_id) and time.monotonic() < deadline:
            for pid in job_processes(self.job.job_id):
                kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self._drain()

    # -- signals -----------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def interrupt(signum: int, _frame: Any) -> None:
            if self.stopping:
                self.hurry = True  # a second Ctrl-C: SIGKILL now
                return
            # Not raised here: an exception at an arbitrary point could land inside
            # MetricsTail.poll after it has consumed lines (losing the steps they record).
            self.interrupted = signal.Signals(signum).name

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, interrupt)
        return previous

    def _check_interrupted(self) -> None:
        """Raise JobInterrupted if a signal arrived: called where stopping loses nothing."""
        if self.interrupted is not None:
            raise JobInterrupted(self.interrupted)

    def _restore_signals(self, previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
