"""Plans that do not fit in memory: the one rule for every command that carries one.

``estimate`` prices any plan, but one that needs more memory than the GPU (or, with offload,
the host) has must not slip into a run directory or a job unnoticed. Every command that
carries such a plan prints ``warning: plan does not fit: REASON`` on standard error; then
``estimate`` exits with status 3 (``DOES_NOT_FIT_EXIT``: not bad input, so not 2), and
``generate`` and ``run`` refuse the plan with status 2, unless ``--allow-oom``. Whether a plan
fits is its own prediction (``fits`` and ``reason`` of plan.json: planner.emit.plan_file
``fit_problem``).
"""

from __future__ import annotations

from typing import Any, Callable

import click

from planner.errors import UserError

DOES_NOT_FIT_EXIT = 3


def allow_oom_option(help_text: str) -> Callable[[Any], Any]:
    """``--allow-oom``: take a plan that does not fit (a warning instead of a refusal)."""
    return click.option("--allow-oom", "allow_oom", is_flag=True, help=help_text)


def warn_does_not_fit(reason: str) -> None:
    click.echo(f"warning: plan does not fit: {reason}", err=True)


def check_fits(reason: str | None, source: str, allow_oom: bool, action: str, fix: str) -> None:
    """Nothing when the plan fits (``reason`` None); a warning with ``--allow-oom``; else a
    UserError naming ``source``, ``fix`` and ``--allow-oom`` (to ``action`` it anyway)."""
    if reason is None:
        return
    if not allow_oom:
        raise UserError(f"{source}: the plan does not fit: {reason}; {fix}, or pass --allow-oom to {action} it anyway")
    warn_does_not_fit(reason)
