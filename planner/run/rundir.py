"""The run-directory contract: what a run directory holds, and how planner.run reads it.

A run directory (written by ``dsplan generate``) holds ``plan.json`` (the planner's decision,
in the one schema planner.emit.plan_file defines: generate writes it, run/ reads it back with
the same checks), ``ds_config.json`` (a standard DeepSpeed config), ``entry.sh`` (what every
rank runs) and one launch script per launcher. ``dsplan run`` adds ``.dsplan-run/`` (its
runtime files) and ``report.json``; the reference trainer adds per-rank metrics (named by
planner.run.metrics), ``run_info.rank<R>.json`` and ``checkpoints/``.

Everything run/ needs from a run directory lives here, so the modules that launch a job
(job, local, supervisor) and the trainer that runs in it import it and never each other.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.atomic import write_bytes_atomically
from planner.cost.paid import runs_ep_overlap
from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.errors import UserError
from planner.model.spec import ModelSpec

PLAN_FILE = "plan.json"
DS_CONFIG_FILE = "ds_config.json"
ENTRY_FILE = "entry.sh"
REQUIRED = (PLAN_FILE, DS_CONFIG_FILE, ENTRY_FILE)
SCRIPTS = {"deepspeed": "launch_deepspeed.sh", "torchrun": "launch_torchrun.sh", "slurm": "slurm.sbatch"}
DEFAULT_LOG = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
RUNTIME_DIR = ".dsplan-run"  # files dsplan run writes while running (rank wrapper, local hostfile, config)
REPORT_FILE = "report.json"
BUILTIN_ENTRY_MARK = "-m planner.run.trainer"  # in entry.sh when it runs the reference trainer
REGENERATE = "regenerate the run directory with `dsplan generate`"


@dataclass(frozen=True)
class RunDirInfo:
    """A generated run directory: the plan (as written, predictions included) and the entry's settings."""

    path: Path
    plan: dict[str, Any]
    nodes: int
    gpus_per_node: int
    builtin: bool  # the entry is dsplan's reference trainer (it writes per-rank metrics)
    steps: int | None  # the trainer's --steps in entry.sh
    checkpoint_every: int
    fp16: bool  # ds_config.json trains in fp16

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def metrics_log(self) -> Path:
        return self.path / DEFAULT_LOG

    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR


def inspect_run_dir(path: str | Path, launcher: str = "deepspeed") -> RunDirInfo:
    """Read a run directory written by ``dsplan generate``; anything else, or a plan its
    reference-trainer entry cannot run, is a UserError."""
    run_dir = Path(path).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"{path}: no such directory; create a run directory with `dsplan generate --out {path}`")
    run_dir = run_dir.resolve()
    missing = [name for name in (*REQUIRED, SCRIPTS[launcher]) if not (run_dir / name).is_file()]
    if missing:
        raise UserError(f"{path}: not a run directory (missing {', '.join(missing)}); "
                        f"create one with `dsplan generate --out {path}` (or regenerate it)")
    data = _read_json(run_dir / PLAN_FILE)
    plan = plan_from_dict(data, str(run_dir / PLAN_FILE), REGENERATE)
    ds_config = _read_json(run_dir / DS_CONFIG_FILE)
    entry = (run_dir / ENTRY_FILE).read_text(encoding="utf-8", errors="replace")
    builtin = BUILTIN_ENTRY_MARK in entry
    if builtin:  # what every rank of the trainer would refuse, refused before any rank starts
        check_reference_trainer(plan, ds_config, resolve_model(plan.model, run_dir).is_moe)
    steps = _entry_int(entry, "--steps") if builtin else None
    return RunDirInfo(
        path=run_dir, plan=data, nodes=plan.nodes, gpus_per_node=plan.gpus_per_node, builtin=builtin,
        steps=steps, checkpoint_every=(_entry_int(entry, "--checkpoint-every") or 0) if builtin else 0,
        fp16=bool(isinstance(ds_config.get("fp16"), dict) and ds_config["fp16"].get("enabled")),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, str(path), "regenerate the run directory with `dsplan generate`")


def read_json_object(path: Path, where: str, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; unreadable, invalid or not an object: a UserError naming
    ``where``, then ``fix``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: cannot read it ({err.__class__.__name__}: {err}); {fix}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(data).__name__}; {fix}")
    return data


def _entry_int(entry: str, flag: str) -> int | None:
    match = re.search(rf"^\s*{re.escape(flag)} (\d+)\s*$", entry, re.MULTILINE)
    return int(match.group(1)) if match else None


def read_plan(run_dir: Path) -> PlanFile:
    """Load ``plan.json`` for the trainer; a missing or malformed file is the user's to fix (exit 2)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: not a run directory (no {PLAN_FILE}); create one with `dsplan generate`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno}); "
                        "regenerate it with `dsplan generate`")
    return plan_from_dict(data, str(path), REGENERATE)


def resolve_model(name: str, run_dir: Path) -> ModelSpec:
    """plan.json's ``model``: a ModelSpec JSON file, else a catalog name or Hugging Face config path
    (paths may be relative to the run directory)."""
    from planner.model.load import load_model

    for candidate in (Path(name), run_dir / name):
        if candidate.is_file() and candidate.suffix == ".json":
            data = json.loads(candidate.read_text())
            if isinstance(data, dict) and "blocks" in data:
                return ModelSpec.model_validate(data)
        if candidate.exists():
            return load_model(candidate)
    return load_model(name)


def _megatron_hint(framework: str) -> str:
    owner = "Megatron-DeepSpeed" if framework == "megatron-deepspeed" else "Megatron-LM"
    return (f"run it with {owner}'s own training script instead (`dsplan generate ... --entry pretrain_gpt.py "
            "-- ARGS`; megatron_args.sh holds the plan's flags)")


# What the reference trainer runs, stated once: it trains on DeepSpeed's engine, so tensor
# parallelism is DeepSpeed's AutoTP (a framework-deepspeed plan, without pipeline stages or MoE
# layers) and a pipeline is PipelineModule, one contiguous chunk per stage. ``dsplan generate``
# restricts its search to these plans when the entry is the trainer (planner/cli/trainer_plans.py).
TRAINER_VIRTUAL_STAGES = 1
TRAINER_TP_FRAMEWORK = "deepspeed"


def trainer_refusal(framework: str, tp: int, pp: int, virtual_stages: int, is_moe: bool, cp: int = 1,
                    dp_replicate: int = 1, activation_offload: int = 0) -> str | None:
    """Why the reference trainer cannot run a plan of this layout (a sentence naming plan.json's
    fields), or None when it can."""
    if activation_offload:
        return (f"plan.json: activation_offload={activation_offload}; the reference trainer keeps its activations "
                f"on the GPU (the offload is Transformer Engine's, under Megatron-Core); {_megatron_hint(framework)}")
    if dp_replicate != 1:
        return (f"plan.json: dp_replicate={dp_replicate}; the reference trainer shards over every DP rank "
                f"(DeepSpeed's ZeRO), not in replicated groups; {_megatron_hint(framework)}")
    if cp != 1:
        return (f"plan.json: cp={cp}; the reference trainer has no context-parallel attention (Megatron-Core's or "
                f"DeepSpeed Ulysses'); {_megatron_hint(framework)}")
    if tp > 1 and framework != TRAINER_TP_FRAMEWORK:
        return (f"plan.json: a {framework} plan with tp={tp}, which the reference trainer shards only with "
                f"DeepSpeed's AutoTP (framework {TRAINER_TP_FRAMEWORK}); {_megatron_hint(framework)}")
    if tp > 1 and (pp > 1 or is_moe):
        return ("plan.json: the reference trainer runs AutoTP (tp > 1) only without pipeline stages "
                "and MoE layers; use tp=1 for this plan")
    if virtual_stages != TRAINER_VIRTUAL_STAGES:
        return (f"plan.json: virtual_stages={virtual_stages}; DeepSpeed's PipelineModule runs one "
                "contiguous chunk per stage, so the reference trainer needs virtual_stages=1; "
                f"{_megatron_hint('megatron')}")
    return None


def check_reference_trainer(plan: PlanFile, ds_config: dict[str, Any], is_moe: bool) -> None:
    """A UserError naming what of ``plan`` the reference trainer cannot run, else nothing.

    The layout rules are ``trainer_refusal``'s; every rank checks this before it trains, and
    ``dsplan run`` before it starts any rank.
    """
    refusal = trainer_refusal(plan.framework, plan.tp, plan.pp, plan.virtual_stages, is_moe, plan.cp,
                              plan.dp_replicate, plan.activation_offload)
    if refusal is not None:
        raise UserError(refusal)
    if runs_ep_overlap(plan.framework, plan.ep, plan.pp, plan.virtual_stages, plan.recompute, plan.ep_comm_overlap):
        raise UserError("plan.json: ep_comm_overlap is true, so the plan was priced with Megatron-Core's expert "
                        "all-to-all overlap, which the reference trainer (DeepSpeed MoE) does not run; plan it again "
                        f"with --no-ep-comm-overlap; {_megatron_hint(plan.framework)}")
    if plan.pp > 1 and not plan.stage_blocks:
        raise UserError("plan.json: stage_blocks is required when pp > 1 (the planner's partition)")
    tp_cfg = int(ds_config.get("tensor_parallel", {}).get("autotp_size", 1) or 1)
    if tp_cfg != plan.tp:
        raise UserError(f"ds_config.json: tensor_parallel.autotp_size is {tp_cfg} but plan.json has tp={plan.tp}; "
                        "regenerate the run directory")


def read_ds_config(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: DeepSpeed config not found; pass --deepspeed_config or regenerate the run directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})")
    if not isinstance(data, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a JSON object")
    return data


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(path, (json.dumps(data, indent=2) + "\n").encode(), fsync=True)
