"""What ``dsplan run`` executes: a run directory (planner.run.rundir reads it) and the launcher
commands it starts.

Everything here is plain data and pure decisions (which script, which mode, which environment);
nothing is started. ``planner.run.supervisor`` starts and watches the commands, ``--dry-run``
prints them. The job's processes carry ``DSPLAN_JOB_ID`` in their environment so the supervisor
can find every one of them (and no other) when it has to stop the job.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.errors import UserError
from planner.run.local import EXTENSIONS_ENV, LocalPlan, adapt_for_local, extensions_dir, local_env, local_hostfile
from planner.run.processes import JOB_ID_ENV
from planner.run.rundir import RUNTIME_DIR, SCRIPTS, RunDirInfo, inspect_run_dir

LAUNCHERS = ("deepspeed", "torchrun", "slurm")
LAUNCH_TOOLS = {"deepspeed": "deepspeed", "torchrun": "torchrun", "slurm": "sbatch"}  # what each script runs
RUN_ID_ENV = "DSPLAN_RUN_ID"  # optional: the job id to use (tests set it to find the job's processes)
INSTALL_HINT = "pip install 'dsplan[run]'"

# Runs one rank's Python with each output line prefixed by the rank as it comes (the launchers
# give all ranks of a node one shared stdout), through planner/run/line_prefix.py's copy beside
# it. ``exec`` keeps the rank's PID: the launcher sees Python's own exit.
LINE_PREFIX = "line_prefix.py"
RANK_WRAPPER = f"""#!/usr/bin/env bash
# Written by `dsplan run`: one rank's Python, every output line prefixed with its rank as it comes.
exec "${{DSPLAN_RANK_PYTHON:?}}" "$@" \\
  > >(exec "$DSPLAN_RANK_PYTHON" -I -S "${{BASH_SOURCE[0]%/*}}/{LINE_PREFIX}" "[rank ${{RANK:-?}}] ") 2>&1
"""


@dataclass(frozen=True)
class Command:
    """One process to start: argv in cwd, with these environment overrides (and removals)."""

    name: str  # "launcher", "node0", "sbatch": the prefix of its output lines
    argv: tuple[str, ...]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    path_append: str | None = None  # a directory added at the end of PATH (the interpreter's bin/)

    def environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for key in self.unset:
            env.pop(key, None)
        env.update(self.env)
        if self.path_append:
            env["PATH"] = os.pathsep.join(p for p in (env.get("PATH", ""), self.path_append) if p)
        return env

    def shell(self) -> str:
        """The command as one shell line (what --dry-run prints)."""
        parts = [f"cd {shlex.quote(str(self.cwd))} &&", "env"]
        parts += [f"-u {shlex.quote(k)}" for k in self.unset]
        if self.path_append:
            parts.append(f'PATH="$PATH"{os.pathsep}{shlex.quote(self.path_append)}')
        parts += [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        parts += [shlex.quote(a) for a in self.argv]
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "argv": list(self.argv), "cwd": str(self.cwd), "env": dict(self.env),
                "unset": list(self.unset), "path_append": self.path_append}


@dataclass(frozen=True)
class Job:
    """A run directory plus how to launch it; ``commands(attempt)`` gives each attempt's processes."""

    info: RunDirInfo
    launcher: str
    python: str  # the interpreter every rank runs
    job_id: str
    entry_args: tuple[str, ...]  # passed to every rank after the launcher's mode
    target_steps: int | None
    local: LocalPlan | None = None
    resume_first: bool = False
    files: dict[str, str] = field(default_factory=dict)  # run-dir relative path -> content, written at start
    preflight: bool = False  # slurm.sbatch runs preflight.sh on every node first (DSPLAN_PREFLIGHT=1)

    @property
    def runtime_dir(self) -> Path:
        return self.info.path / RUNTIME_DIR

    @property
    def extensions_dir(self) -> str:
        """Where the job's ranks build DeepSpeed's ops (for messages about a stale build lock)."""
        if EXTENSIONS_ENV in os.environ:
            return os.environ[EXTENSIONS_ENV]
        return str(extensions_dir(self.python)) if self.local is not None else "~/.cache/torch_extensions"

    @property
    def bindir(self) -> str | None:
        """The interpreter's directory, added at the end of PATH when the launcher command is not on
        PATH already (an un-activated virtualenv). Appended, not prepended: its other tools (ninja,
        which builds DeepSpeed's ops into a shared cache) must not replace the ones already in use."""
        if os.sep not in self.python or shutil.which(LAUNCH_TOOLS[self.launcher]) is not None:
            return None
        return str(Path(self.python).parent)

    def base_env(self, resume: bool) -> dict[str, str]:
        env = {
            JOB_ID_ENV: self.job_id,
            "DSPLAN_RANK_PYTHON": self.python,
            "DSPLAN_PYTHON": str(self.runtime_dir / "rank_python"),
            # the supervisor restarts failed attempts itself (--max-restarts), torchrun does not
            "DSPLAN_MAX_RESTARTS": "0",
        }
        if resume:
            env["DSPLAN_RESUME"] = "1"
        if self.preflight and self.launcher == "slurm":
            env["DSPLAN_PREFLIGHT"] = "1"
        return env

    def commands(self, attempt: int = 0, master_port: int | None = None) -> list[Command]:
        """The processes of attempt ``attempt`` (0 = first start; later ones resume)."""
        resume = attempt > 0 or self.resume_first
        env = self.base_env(resume)
        # DeepSpeed's ssh launcher forwards only some variables to the other hosts (not DSPLAN_*),
        # but every host gets the entry's arguments: the builtin trainer also hears --resume there.
        entry_args = (*self.entry_args, "--resume") if resume and self.info.builtin else self.entry_args
        script = f"./{SCRIPTS[self.launcher]}"
        cwd = self.info.path
        if self.launcher == "slurm":
            return [Command("sbatch", ("sbatch", "--wait", SCRIPTS["slurm"], *entry_args), cwd, env,
                            path_append=self.bindir)]
        if self.local is None:
            if self.launcher == "torchrun":
                return [Command("launcher", (script, *entry_args), cwd, env, path_append=self.bindir)]
            mode = "local" if self.info.nodes == 1 else "ssh"
            return [Command("launcher", (script, mode, *entry_args), cwd, env, path_append=self.bindir)]
        port = master_port if master_port is not None else 29500
        hostfile = self.runtime_dir / "hostfile"
        extensions = None if EXTENSIONS_ENV in os.environ else str(extensions_dir(self.python))
        commands = []
        for node in range(self.local.nodes):
            node_env = {**env, **local_env(self.local, node, port, hostfile, self.launcher, extensions)}
            if self.launcher == "deepspeed":
                mode = ("local",) if self.local.nodes == 1 else ("node",)
            else:
                mode = ()
            name = "launcher" if self.local.nodes == 1 else f"node{node}"
            commands.append(Command(name, (script, *mode, *entry_args), cwd, node_env, ("CUDA_VISIBLE_DEVICES",),
                                    path_append=self.bindir))
        return commands

    def write_files(self) -> None:
        """Write the runtime files (rank wrapper, local hostfile and config) before a start."""
        for rel, content in self.files.items():
            path = self.info.path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(content)
            if rel.endswith("rank_python"):
                tmp.chmod(0o755)
            os.replace(tmp, path)


def build_job(
    run_dir: str | Path,
    *,
    launcher: str = "deepspeed",
    local: bool = False,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    scale: str | None = None,
    python: str | None = None,
    job_id: str | None = None,
    max_local_procs: int | None = None,
    preflight: bool = False,
) -> Job:
    """Decide everything about a run before anything starts (the same answer for --dry-run)."""
    if launcher not in LAUNCHERS:
        raise UserError(f"--launcher {launcher}: use one of {', '.join(LAUNCHERS)}")
    info = inspect_run_dir(run_dir, launcher)
    if not info.builtin:
        given = [flag for flag, value in (("--steps", steps), ("--checkpoint-every", checkpoint_every),
                                          ("--scale", scale)) if value is not None]
        if given:
            raise UserError(f"{', '.join(given)}: only for dsplan's reference trainer, but {info.path}/entry.sh runs "
                            "your own script; pass such settings to your script through `dsplan generate ... -- ARGS`")
    if scale is not None:
        from planner.run.model_scale import parse_scale

        parse_scale(scale)  # a bad --scale is the user's to fix now, not a crash on every rank later
    if local and launcher == "slurm":
        raise UserError("--local with --launcher slurm: --local runs on this machine; "
                        "use --launcher deepspeed or torchrun")
    if launcher == "torchrun" and info.nodes > 1 and not local:
        raise UserError(f"--launcher torchrun: the plan has {info.nodes} nodes and torchrun starts one node; run "
                        "launch_torchrun.sh on every node, or use --launcher deepspeed (ssh) or slurm, or --local")
    interpreter = python or os.environ.get("DSPLAN_PYTHON") or _default_python()
    entry_args: list[str] = []
    if steps is not None:
        entry_args += ["--steps", str(steps)]
    if checkpoint_every is not None:
        entry_args += ["--checkpoint-every", str(checkpoint_every)]
    files = {f"{RUNTIME_DIR}/rank_python": RANK_WRAPPER,
             f"{RUNTIME_DIR}/{LINE_PREFIX}": (Path(__file__).parent / LINE_PREFIX).read_text(encoding="utf-8")}
    local_plan = None
    if local:
        local_plan = adapt_for_local(info, scale=scale, max_procs=max_local_procs)
        entry_args += local_plan.trainer_args(info.path / RUNTIME_DIR)
        if local_plan.nodes > 1:
            files[f"{RUNTIME_DIR}/hostfile"] = local_hostfile(local_plan)
        if local_plan.ds_config is not None:
            files[f"{RUNTIME_DIR}/ds_config.json"] = json.dumps(local_plan.ds_config, indent=2) + "\n"
    elif scale is not None:
        entry_args += ["--scale", scale]
    return Job(
        info=info, launcher=launcher, python=interpreter,
        job_id=job_id or os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:12],
        entry_args=tuple(entry_args), target_steps=steps if steps is not None else info.steps, local=local_plan,
        resume_first=resume, files=files, preflight=preflight,
    )


def _default_python() -> str:
    """The interpreter dsplan itself runs in (a venv with the ``run`` extra is the usual case)."""
    import sys

    return sys.executable or "python3"


def check_runnable(job: Job) -> None:
    """The job's interpreter has DeepSpeed and the launcher command exists; else a UserError.

    DeepSpeed is looked up with ``importlib.util.find_spec`` *in that interpreter*, so the planner
    process never imports it.
    """
    if job.launcher == "slurm":
        # The job's Python lives on the compute nodes; only sbatch must exist here.
        if shutil.which("sbatch") is None:
            raise UserError("--launcher slurm: sbatch is not on PATH; run dsplan on a SLURM login node, or use "
                            "--launcher deepspeed / torchrun (--dry-run shows the sbatch command)")
        return
    python = shutil.which(job.python) or (job.python if Path(job.python).is_file() else None)
    if python is None:
        raise UserError(f"DSPLAN_PYTHON={job.python}: no such interpreter; point it at the Python that has DeepSpeed")
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('deepspeed') else 3)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UserError(f"{python}: cannot run it to look for DeepSpeed ({err}); "
                        "set DSPLAN_PYTHON to a working Python") from None
    if not found:
        raise UserError(f"DeepSpeed is not installed for {python}; install the run extra there: {INSTALL_HINT} "
                        "(GPU users: install your CUDA build of torch first), "
                        "or set DSPLAN_PYTHON to a Python that has it")
    tool = LAUNCH_TOOLS[job.launcher]
    path = os.pathsep.join(p for p in (os.environ.get("PATH", ""), job.bindir) if p)
    if shutil.which(tool, path=path) is None:
        raise UserError(f"--launcher {job.launcher}: the `{tool}` command is not on PATH next to {python}; "
                        f"install the run extra: {INSTALL_HINT}")
