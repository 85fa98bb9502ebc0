"""Shared test set-up.

DeepSpeed runs on CPU here: every test process (and the launchers it starts) gets
DS_ACCELERATOR=cpu unless the caller set something else.

DeepSpeed JIT-compiles its ops into TORCH_EXTENSIONS_DIR. Unless the caller set one (CI does),
the tests use the cache ``dsplan run --local`` uses for this interpreter
(planner.run.local.extensions_dir: one per environment, since the builds name its torch and
DeepSpeed headers), so the first local run after the tests finds its ops built. The ops are
built once per session, before any launch, so a launch's timeout measures training, not a
compiler on a busy machine.

The ``fake_bin`` fixture puts recording launchers on PATH for the tests of the generated launch
scripts (tests/test_emit_scripts.py, tests/test_launch_files.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from planner.run.local import EXTENSIONS_ENV, extensions_dir

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault(EXTENSIONS_ENV, str(extensions_dir(sys.executable)))

# DeepSpeed ops the CPU jobs load: the shared-memory comm op (every launch), fused Adam (ZeRO
# 0-2 without offload), CPU Adam (optimizer offload).
DEEPSPEED_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")
STALE_LOCK_S = 1200  # no op takes this long to build: a lock this old is a killed build's

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO_ROOT / "reference"  # published facts the tests check against (reference/README.md)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The repository's reference/ folder (part of every checkout: a test never skips for it)."""
    return REFERENCE_DIR


@pytest.fixture(autouse=True)
def _deepspeed_ops_first(request: pytest.FixtureRequest) -> None:
    """Tests marked ``deepspeed`` launch real jobs: have their ops built first."""
    if request.node.get_closest_marker("deepspeed") is not None:
        request.getfixturevalue("deepspeed_ops")


@pytest.fixture(scope="session")
def deepspeed_ops() -> None:
    """Build (or load from the cache) the DeepSpeed ops the launched jobs use."""
    from deepspeed.accelerator import get_accelerator

    cache = Path(os.environ[EXTENSIONS_ENV])
    for lock in cache.glob("**/lock"):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
    for name in DEEPSPEED_OPS:
        get_accelerator().create_op_builder(name).load(verbose=False)


# Records its argv, then behaves like the launcher: runs the script after --no_python/--no-python
# with the remaining arguments (deepspeed puts --local_rank first, as deepspeed.launcher.launch does).
# The script's long f.write line is split over two adjacent string literals (one line of the script).
FAKE_LAUNCHER = (
    """#!{python}
import json, os, subprocess, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"cmd": name, "argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in """
    """("MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID", "DSPLAN_HOSTFILE", "RDZV_ID", "OMP_NUM_THREADS")}}}}) + "\\n")
if name == "scontrol":
    print("gpu-a01\\ngpu-a02")
    sys.exit(0)
if name == "srun":
    rest = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(subprocess.call(rest, env={{**os.environ, "SLURM_NODEID": "1"}}))
flag = "--no_python" if name == "deepspeed" else "--no-python"
i = sys.argv.index(flag)
extra = ["--local_rank=0"] if name == "deepspeed" else []
sys.exit(subprocess.call(sys.argv[i + 1:i + 2] + extra + sys.argv[i + 2:], env={{**os.environ, "LOCAL_RANK": "0"}}))
"""
)


@pytest.fixture()
def fake_bin(tmp_path: Path) -> Path:
    """A bin/ folder of recording deepspeed, torchrun, srun and scontrol (FAKE_LAUNCHER) to put
    first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("deepspeed", "torchrun", "srun", "scontrol"):
        path = bin_dir / name
        path.write_text(FAKE_LAUNCHER.format(python=sys.executable))
        path.chmod(0o755)
    return bin_dir
