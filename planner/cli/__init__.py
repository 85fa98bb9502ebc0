"""The ``dsplan`` command line: parse, call the planner API, print (rich table or --json).

Each command lives in its own module here; this module owns the group and the one place
where user errors become a clear message and exit status 2.
"""

from __future__ import annotations

import sys

import click

from planner import __version__
from planner.errors import UserError


class _Group(click.Group):
    """Turns UserError (and pydantic/YAML problems surfaced as UserError) into exit status 2."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except UserError as err:
            click.secho(f"error: {err}", fg="red", err=True)
            sys.exit(UserError.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsplan")
def main() -> None:
    """Plan, configure and run distributed training with DeepSpeed.

    \b
    Start here:
      dsplan suggest --model vl2 --nodes 8      ranked parallel plans for DeepSeek-VL2 on 64 GPUs
      dsplan models                             the built-in model catalog
      dsplan hardware                           the built-in hardware profiles
    """


def _register() -> None:
    """Attach every command module; each exposes ``commands`` (a list of click commands)."""
    import importlib

    for name in ("models", "hardware", "topo", "estimate", "suggest", "generate", "run", "plot"):
        try:
            module = importlib.import_module(f"planner.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"planner.cli.{name}":
                continue  # command not built yet
            raise
        for command in module.commands:
            main.add_command(command)


_register()
