"""``dsplan run --preflight``: the run directory's ``preflight.sh`` before training.

On this node for a single-node plan or ``--local``; under ``--launcher slurm`` slurm.sbatch
runs it on every node itself (DSPLAN_PREFLIGHT=1, set on the sbatch command). A multi-node
plan started from here checks this node only, and says how to check the others. A failure
stops the run before any rank starts: a sick node found now costs seconds, found by the job's
report it costs the run.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable

from planner.errors import UserError
from planner.run.job import Job

PREFLIGHT_SCRIPT = "preflight.sh"
PREFLIGHT_TIMEOUT_S = 1800  # nccl-tests to 1 GiB plus the burn-in take a minute; a hung GPU must not hang dsplan


def run_preflight(job: Job, echo: Callable[[str], None]) -> None:
    """Run preflight.sh here, echo its lines, and raise a UserError carrying its failures."""
    script = job.info.path / PREFLIGHT_SCRIPT
    if not script.is_file():
        raise UserError(f"--preflight: {script} does not exist; regenerate the run directory with `dsplan generate` "
                        "(run directories written before dsplan had preflight.sh lack it)")
    if job.launcher == "slurm":
        echo("# preflight: slurm.sbatch runs preflight.sh on every node before training (DSPLAN_PREFLIGHT=1)")
        return
    env = {**os.environ, "DSPLAN_PYTHON": job.python}
    if job.local is not None:
        env["DSPLAN_PREFLIGHT_LOCAL"] = "1"
    try:
        proc = subprocess.run([str(script)], cwd=job.info.path, env=env, capture_output=True, text=True,
                              timeout=PREFLIGHT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"--preflight: {script} ran for over {PREFLIGHT_TIMEOUT_S} s; run it by hand to see "
                        "which check hangs (a GPU or NCCL test that never returns)") from None
    except OSError as err:
        raise UserError(f"--preflight: cannot run {script} ({err.strerror}); `chmod +x` it or regenerate") from None
    for line in (proc.stdout + proc.stderr).splitlines():
        echo(line)
    if proc.returncode != 0:
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
        reason = "; ".join(failed) or (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"preflight failed on this node, training not started: {reason} "
                        f"(the lines above say what to fix; rerun {script} after fixing)")
    if job.info.nodes > 1 and job.local is None:
        echo(f"# preflight checked this node only: run {script} on each of the {job.info.nodes} nodes "
             "(or use --launcher slurm --preflight, which runs it on every node)")
