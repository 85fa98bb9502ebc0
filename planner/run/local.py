"""``dsplan run --local``: the plan, adapted so it runs on this machine's CPUs.

What changes and why:
- every GPU becomes a CPU process (``DS_ACCELERATOR=cpu``; the trainer then uses gloo), so the
  plan's world size, node count and ranks per node stay exactly as planned;
- the model runs at a small ``--scale`` (default ``tiny``) and a short sequence, so it fits in
  memory and a step takes a fraction of a second;
- fp16 becomes bf16 (DeepSpeed's CPU accelerator trains in bf16 or fp32; fp16 kernels are not
  guaranteed there);
- a multi-node plan becomes one DeepSpeed launcher per node on localhost in ``node`` mode
  (``--no_ssh --node_rank i``, master 127.0.0.1), so the multi-node code path runs for real;
- DeepSpeed's CPU ops are built into (and loaded from) ``extensions_dir``, the cache the test
  suite builds them in too, unless ``TORCH_EXTENSIONS_DIR`` is set.

The measured numbers are CPU numbers for a scaled model; the report says so next to them.
A plan made for a CPU hardware profile (``--hardware cpu-local``, or one ``dsplan profile
--hardware-out`` wrote: ``gpu.vendor: cpu``) runs as planned instead: the real model at the
planned sequence and precision, so the report compares a prediction with the same job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import UserError

if TYPE_CHECKING:
    from planner.run.rundir import RunDirInfo

DEFAULT_SCALE = "tiny"
MAX_LOCAL_SEQ_LEN = 256  # tokens per sample on CPU: keeps a tiny-scale step well under a second
PROCS_PER_CORE = 2  # more processes than this per core only measure the scheduler
LOCAL_MASTER_ADDR = "127.0.0.1"  # every simulated node of a --local job runs on this machine
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"  # where torch's JIT (DeepSpeed's op builder) builds ops


@dataclass(frozen=True)
class LocalPlan:
    """How the plan runs here: processes per simulated node, threads, scale, sequence length."""

    nodes: int
    procs_per_node: int
    threads_per_proc: int
    scale: str
    seq_len: int
    planned_seq_len: int
    ds_config: dict[str, Any] | None  # an adapted DeepSpeed config, when the plan's cannot run on CPU

    @property
    def processes(self) -> int:
        return self.nodes * self.procs_per_node

    def trainer_args(self, runtime_dir: Path) -> list[str]:
        """Arguments appended after entry.sh's own (the trainer's argparse keeps the last value)."""
        args = ["--scale", self.scale, "--seq-len", str(self.seq_len)]
        if self.ds_config is not None:
            args += ["--deepspeed_config", str(runtime_dir / "ds_config.json")]
        return args

    def to_json(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu", "backend": "gloo", "nodes_simulated": self.nodes,
            "processes_per_node": self.procs_per_node, "threads_per_process": self.threads_per_proc,
            "scale": self.scale, "seq_len": self.seq_len, "planned_seq_len": self.planned_seq_len,
            "precision_changed": self.ds_config is not None,
        }



def max_local_processes(cpu_count: int | None = None) -> int:
    return max(2, (cpu_count or os.cpu_count() or 1) * PROCS_PER_CORE)


def adapt_for_local(info: "RunDirInfo", scale: str | None = None, max_procs: int | None = None) -> LocalPlan:
    """The local version of ``info``'s plan; a UserError when this machine cannot start it."""
    limit = max_procs if max_procs is not None else max_local_processes()
    needed = info.world_size
    if needed > limit:
        raise UserError(
            f"{info.path}/plan.json: the plan needs {needed} processes "
            f"({info.nodes} node(s) x {info.gpus_per_node} GPUs) "
            f"but --local can start at most {limit} on this machine ({os.cpu_count()} CPU cores); "
            f"generate a smaller plan to try locally, e.g. `dsplan estimate ... --gpus-per-node 2 --json > p.json` "
            "then `dsplan generate --plan p.json`"
        )
    if not info.builtin:
        raise UserError(f"--local: {info.path}/entry.sh runs your own script, and --local adapts dsplan's reference "
                        "trainer (scale, sequence, precision); run your script with its own CPU settings instead")
    planned_seq = int(info.plan.get("seq_len") or MAX_LOCAL_SEQ_LEN)
    if planned_for_cpu(info.plan):
        return LocalPlan(nodes=info.nodes, procs_per_node=info.gpus_per_node,
                         threads_per_proc=max(1, (os.cpu_count() or 1) // needed), scale=scale or "1",
                         seq_len=planned_seq, planned_seq_len=planned_seq,
                         ds_config=_cpu_ds_config(info.path / "ds_config.json") if info.fp16 else None)
    return LocalPlan(
        nodes=info.nodes,
        procs_per_node=info.gpus_per_node,
        threads_per_proc=max(1, (os.cpu_count() or 1) // needed),
        scale=scale or DEFAULT_SCALE,
        seq_len=min(planned_seq, MAX_LOCAL_SEQ_LEN),
        planned_seq_len=planned_seq,
        ds_config=_cpu_ds_config(info.path / "ds_config.json") if info.fp16 else None,
    )


def planned_for_cpu(plan: dict[str, Any]) -> bool:
    """Whether plan.json's hardware profile is a CPU one (gpu.vendor cpu)."""
    from planner.hardware.load import load_profile

    try:
        return load_profile(str(plan.get("hardware") or "")).gpu.vendor == "cpu"
    except UserError:
        return False


def _cpu_ds_config(path: Path) -> dict[str, Any]:
    cfg = json.loads(path.read_text())
    cfg.pop("fp16", None)
    cfg["bf16"] = {"enabled": True}
    return cfg


def local_hostfile(local: LocalPlan) -> str:
    """One line per simulated node; the names only label nodes (every launcher runs here)."""
    return "".join(f"node{i} slots={local.procs_per_node}\n" for i in range(local.nodes))


def extensions_dir(python: str) -> Path:
    """Where a --local job's ranks build DeepSpeed's ops when ``TORCH_EXTENSIONS_DIR`` is not set:
    ``~/.cache/torch_extensions/dsplan-KEY``, one per Python environment (KEY: a hash of the
    interpreter's directory). tests/conftest.py builds the tests' ops there too, so the first
    ``dsplan run --local`` after the tests loads them instead of compiling for minutes. One per
    environment, because a build names its environment's torch and DeepSpeed headers: two
    environments sharing one cache rebuild every op each time they alternate."""
    where = shutil.which(python) or python
    key = hashlib.sha1(os.path.dirname(os.path.abspath(where)).encode()).hexdigest()[:10]
    return Path.home() / ".cache" / "torch_extensions" / f"dsplan-{key}"


def local_env(local: LocalPlan, node_rank: int, master_port: int, hostfile: Path, launcher: str,
              extensions: str | None = None) -> dict[str, str]:
    """Environment overrides for the launcher of simulated node ``node_rank`` (``extensions``: the
    TORCH_EXTENSIONS_DIR to set, None to leave the environment's)."""
    env = {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": str(local.threads_per_proc),
        "GPUS_PER_NODE": str(local.procs_per_node),
        "MASTER_ADDR": LOCAL_MASTER_ADDR,
        "MASTER_PORT": str(master_port),
    }
    if extensions is not None:
        env[EXTENSIONS_ENV] = extensions
    if local.nodes > 1:
        env["NODE_RANK"] = str(node_rank)
        if launcher == "deepspeed":
            env["DSPLAN_HOSTFILE"] = str(hostfile)
    return env
