"""Rank output reaches ``dsplan run`` as it is printed, not when a buffer fills.

The rank wrapper used to prefix lines with awk, and Debian's mawk block-buffers a pipe: a job's
lines showed up minutes late, and an entry printing every few seconds was killed as hung. Each
script here prints, then waits for a file that the test creates only after it has seen the line,
so a buffered line fails the test (the script gives up and exits non-zero) instead of passing late.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from planner.cli import main
from planner.run.job import build_job
from tests.test_cli_run import generate

DEADLINE_S = 60

# Prints a line, then a partial line and raw bytes that are not UTF-8, each waiting for the test
# to answer through a file (go1, go2) first; exits 3 when no answer comes.
SLOW_SCRIPT = """import os, sys, time
def wait(name):
    deadline = time.monotonic() + {deadline}
    while not os.path.exists(name):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
print("first line", flush=True)
wait({go1!r})
sys.stdout.buffer.write(b"partial \\xff"); sys.stdout.flush()
wait({go2!r})
print(" rest", flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def _read_until(stream, needle: bytes, seen: bytearray) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while needle not in seen:
        assert time.monotonic() < deadline, f"{needle!r} not seen; got {bytes(seen)!r}"
        if select.select([stream], [], [], 0.1)[0]:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"output ended before {needle!r}; got {bytes(seen)!r}"
            seen += chunk


def test_the_rank_wrapper_streams_lines_and_partial_lines_with_the_rank_prefix(tmp_path: Path):
    run_dir = generate(tmp_path, "wrapped", gpus_per_node=1)
    job = build_job(run_dir)
    job.write_files()
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SCRIPT.format(deadline=DEADLINE_S, go1=str(tmp_path / "go1"), go2=str(tmp_path / "go2")))
    env = {**os.environ, "DSPLAN_RANK_PYTHON": sys.executable, "RANK": "3"}
    proc = subprocess.Popen([str(job.runtime_dir / "rank_python"), str(script)], stdout=subprocess.PIPE, env=env)
    seen = bytearray()
    try:
        _read_until(proc.stdout, b"[rank 3] first line\n", seen)
        (tmp_path / "go1").touch()
        _read_until(proc.stdout, b"[rank 3] partial \xff", seen)  # shown before its line ends
        (tmp_path / "go2").touch()
        assert proc.wait(timeout=DEADLINE_S) == 0
        seen += proc.stdout.read()
    finally:
        proc.kill()
        proc.stdout.close()
    assert bytes(seen) == b"[rank 3] first line\n[rank 3] partial \xff rest\n[rank 3] to stderr\n"


ENTRY = """import os, sys, time
print("tick 0")
deadline = time.monotonic() + {deadline}
while not os.path.exists({go!r}):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
for i in range(1, 4):
    time.sleep(1)
    print(f"tick {{i}}")
"""


def test_dsplan_run_shows_a_custom_entrys_lines_as_it_prints_them(tmp_path: Path, fake_bin: Path):
    """The issue's case: an entry printing every second under a hang timeout of 3 s completes,
    and its first line is in output.log while it still runs."""
    entry = tmp_path / "ticks.py"
    entry.write_text(ENTRY.format(deadline=DEADLINE_S, go=str(tmp_path / "go")))
    run_dir = generate(tmp_path, "ticks", gpus_per_node=1, extra=("--entry", str(entry)))
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "fake.log"),
           "RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "planner", "run", str(run_dir), "--hang-timeout", "3",
                             "--startup-timeout", "3", "--grace", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    log = run_dir / ".dsplan-run" / "output.log"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not (log.exists() and "[rank 0] tick 0" in log.read_text()):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "tick 0 never reached output.log"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        out = proc.communicate(timeout=DEADLINE_S)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert [line for line in out.splitlines() if line.startswith("[rank")] == [f"[rank 0] tick {i}" for i in range(4)]
    assert "hang" not in out


def test_dry_run_lists_the_line_filter_beside_the_wrapper(tmp_path: Path):
    run_dir = generate(tmp_path, "listed", gpus_per_node=1)
    result = CliRunner().invoke(main, ["run", str(run_dir), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert ".dsplan-run/line_prefix.py" in result.output and ".dsplan-run/rank_python" in result.output
