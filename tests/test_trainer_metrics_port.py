"""The reference trainer's --metrics-port, scraped over HTTP during a real two-rank CPU DeepSpeed run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from planner.run import exporter
from tests.conftest_deepspeed import (
    DEEPSPEED,
    LAUNCH_TIMEOUT_S,
    REPO_ROOT,
    free_port,
    launcher_env,
    llama_like,
    make_run_dir,
    read_metrics,
)

STEPS = 400  # long enough to scrape mid-run on a slow machine; the test stops the job once it has


def scrape(port: int) -> dict[str, float] | None:
    """{metric name: value} of one endpoint, or None while it is not up yet."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_trainer_bad_metrics_port_exits_2(tmp_path: Path):
    run_dir = make_run_dir(tmp_path / "run", llama_like(), dp=2)
    r = subprocess.run([sys.executable, "-m", "planner.run.trainer", "--run-dir", str(run_dir), "--metrics-port", "80"],
                       cwd=REPO_ROOT, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--metrics-port 80: give 0 (no metrics endpoint) or a port in 1024..65535" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.deepspeed
def test_every_rank_serves_step_time_tokens_and_measured_comm_share(tmp_path: Path):
    run_dir = make_run_dir(tmp_path / "run", llama_like(), dp=2, zero_stage=2)
    base = free_port()
    while base + 1 > 65535 or not _free(base + 1):
        base = free_port()
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "planner.run.trainer",
           "--run-dir", str(run_dir), "--deepspeed_config", str(run_dir / "ds_config.json"), "--steps", str(STEPS),
           "--metrics-port", str(base)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: dict[int, dict[str, float]] = {}
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(seen) < 2 and time.monotonic() < deadline and proc.poll() is None:
            for local in (0, 1):
                got = scrape(base + local)
                if got and got.get(exporter.LAST_STEP, 0) >= 3:
                    seen[local] = got
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    assert sorted(seen) == [0, 1], f"no metrics from both ranks; launcher tail:\n{out[-3000:]}"
    for local, m in seen.items():
        assert m[exporter.STEP_TIME] > 0
        assert m[exporter.TOKENS_PER_S] == pytest.approx(2 * 1 * 2 * 32 / m[exporter.STEP_TIME], rel=1e-6)
        # ZeRO-2 reduce-scatters gradients and all-gathers parameters every step: some communication
        assert m[exporter.COMM_TIME] > 0
        assert 0 < m[exporter.COMM_SHARE] < 1
        assert m[exporter.COMM_SHARE] == pytest.approx(m[exporter.COMM_TIME] / m[exporter.STEP_TIME], rel=1e-6)
        assert m[exporter.STEPS + "_total"] >= 3
    # the metrics file carries the same measured communication time
    records = read_metrics(run_dir, 0)
    assert records and all(0 < r["comm_time_s"] < r["step_time_s"] for r in records)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
