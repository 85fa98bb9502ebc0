"""The searches one ``suggest`` runs side by side (planner/search/suggest.py): each one's share of
the progress, and each pipeline schedule's own keywords."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.errors import UserError, arg
from planner.model.spec import ModelSpec
from planner.search.context_splits import context_splits
from planner.search.expert_tp import expert_tp_choices
from planner.search.space import Constraints, divisors


def share_progress(options: dict, k: int, n: int) -> dict:
    """``options`` with its ``progress`` callback reporting search ``k`` of ``n`` as its share of
    the whole (k / n up to (k + 1) / n)."""
    report = options.get("progress")
    if report is None or n == 1:
        return options
    return {**options, "progress": lambda f: report(min(1.0, (k + f) / n))}


def schedule_options(options: dict, schedule: str, searched: int, gpus: int) -> dict:
    """The keywords of one pipeline schedule's search: beside another schedule's, DualPipeV's is
    for pipelines only (the other search has the plans without one)."""
    out: dict[str, Any] = {"pp_schedule": schedule}
    if schedule == "dualpipev" and searched > 1:
        cons = options.get("constraints") or Constraints()
        depths = tuple(d for d in (cons.pp or divisors(gpus)) if d > 1)
        if not depths:
            raise UserError(f"{arg('pp_schedule')} dualpipev schedules pipelines, and {arg('pp')} allows none")
        out["constraints"] = replace(cons, pp=depths)
    return out


def schedules_of(value: "str | tuple[str, ...] | list[str]") -> tuple[str, ...]:
    """The pipeline schedules asked for (Workload.pp_schedule: one, or several to search each)."""
    return (value,) if isinstance(value, str) else tuple(dict.fromkeys(value))


def searches(model: ModelSpec, cons: Constraints, seq: int, flash: bool, gpus: int, variants: list,
             schedules: tuple[str, ...]) -> list[tuple]:
    """Every search one ``suggest`` runs per precision: (context-parallel split, hybrid-sharding
    groups, ZeRO++ choice, expert-TP choice, pipeline schedule)."""
    return [(cp, rep, zpp, etp, sched) for cp in context_splits(cons, model, seq, flash, gpus)
            for rep in (cons.dp_replicate or (1,)) for zpp in variants for etp in expert_tp_choices(cons, model)
            for sched in schedules]


def left_out_notes(variants: list, schedules: tuple[str, ...], ran: set, refused: dict) -> list[str]:
    """A note for each ZeRO++ choice and each of several schedules that no search gave a plan."""
    return ([f"left out: ZeRO++ {','.join(z)}: {refused[z]}" for z in variants if z and z not in ran]
            + [f"left out: {arg('pp_schedule')} {s}: {refused[s]}" for s in schedules
               if len(schedules) > 1 and s not in ran])
