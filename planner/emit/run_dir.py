"""One call from a plan dict to a written run directory (for ``dsplan run`` tests and notebooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from planner.emit.ds_config import TrainSettings
from planner.emit.hosts import Host, check_host
from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.emit.render import BUILTIN_ENTRY, LaunchOptions, render_run_dir
from planner.emit.write import WriteReport, write_run_dir


def generate_run_dir(
    plan: PlanFile | dict[str, Any],
    out_dir: str | Path,
    *,
    entry: str = BUILTIN_ENTRY,
    entry_args: Sequence[str] = (),
    hosts: Sequence[str] | None = None,
    settings: TrainSettings | None = None,
    force: bool = False,
) -> WriteReport:
    """Render and write the run directory for ``plan`` (a PlanFile or a plan dict)."""
    from planner.hardware.load import load_profile
    from planner.model.load import load_model

    plan_file = plan if isinstance(plan, PlanFile) else plan_from_dict(plan)
    options = LaunchOptions(
        entry=entry,
        entry_args=list(entry_args),
        hosts=(None if hosts is None
               else [Host(name=check_host(h, "hosts"), slots=plan_file.gpus_per_node) for h in hosts]),
        settings=settings or TrainSettings(),
    )
    files = render_run_dir(plan_file, load_model(plan_file.model), load_profile(plan_file.hardware), options, out_dir)
    return write_run_dir(out_dir, files, force=force)
