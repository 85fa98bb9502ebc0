"""The command that turns ``suggest``'s plan #1 into a run directory, as ``suggest`` prints it.

It is ``dsplan generate`` with the search ``suggest`` ran: the model, hardware and node count
always, and every other flag the user gave (pins, workload, balancer, objective) spelled as
given, so generate's search ranks the same plan first; then ``--rank 1`` and a default
``--out``. ``--top`` and ``--json`` are suggest's own and stay out.
"""

from __future__ import annotations

import re
import shlex

import click
from click.core import ParameterSource

_SUGGEST_ONLY = frozenset({"top", "as_json"})
_ALWAYS = ("model", "hardware", "nodes")
_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.PROMPT)


def default_out(model_name: str, nodes: int) -> str:
    """``runs/<model>-<nodes>n``: one directory per model and cluster size, safe in a shell."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip("-.") or "plan"
    return f"runs/{safe}-{nodes}n"


def generate_argv(ctx: click.Context, out: str) -> list[str]:
    """The argv of ``dsplan generate`` for the search of ``ctx`` (a parsed ``suggest``)."""
    argv = ["dsplan", "generate"]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name is None or param.name in _SUGGEST_ONLY:
            continue
        if param.name not in _ALWAYS and ctx.get_parameter_source(param.name) not in _GIVEN:
            continue
        argv += _spelled(param, ctx.params[param.name])
    return [*argv, "--rank", "1", "--out", out]


def _spelled(param: click.Option, value: object) -> list[str]:
    """One option as the command line writes it: a flag by the name that sets ``value``."""
    if param.is_flag:
        if param.secondary_opts:
            return [param.opts[0] if value else param.secondary_opts[0]]
        return [param.opts[0]] if value else []
    return [param.opts[0], str(value)]


def shell_lines(argv: list[str], width: int, indent: str = "    ") -> list[str]:
    """``argv`` shell-quoted (shlex) and broken between options into lines of at most
    ``width`` columns, each but the last ending in `` \\``, so it pastes into a shell as
    printed. An option and its value stay on one line (one longer than ``width`` overflows)."""
    words = [shlex.quote(a) for a in argv]
    groups = [" ".join(words[:2])]
    for word in words[2:]:
        if word.startswith("--") or len(groups) == 1:
            groups.append(word)
        else:
            groups[-1] += f" {word}"
    lines = [groups[0]]
    for group in groups[1:]:
        if len(lines[-1]) + 1 + len(group) + 2 <= width:
            lines[-1] += f" {group}"
        else:
            lines.append(indent + group)
    return [line + " \\" for line in lines[:-1]] + lines[-1:]
