"""The ``dsplan`` command line: parse, call the planner API, print (rich table or --json).

Each command lives in its own module here; this module owns the group and the one place
where user errors become a clear message and exit status 2. A command's module is imported
only when that command runs (or ``--help`` lists them all): ``dsplan suggest`` should not
pay for the imports of ``models``, ``hardware`` or ``topo``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable

import click

from planner import __version__
from planner.errors import UserError


# planner.cli.<name> holds the command ``name`` (its ``commands`` list); absent modules are skipped.
COMMAND_MODULES = ("models", "hardware", "topo", "estimate", "suggest", "generate", "run", "plot")


class _Group(click.Group):
    """Loads command modules on demand; turns UserError into a message and exit status 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name in COMMAND_MODULES if importlib.util.find_spec(f"planner.cli.{name}") is not None]
        return sorted(set(self.commands) | set(lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            _load(cmd_name)
        return self.commands.get(cmd_name)

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except UserError as err:
            click.secho(f"error: {err}", fg="red", err=True)
            sys.exit(UserError.exit_code)


# Settings libraries read once, when they load, that only cost the planner time. Set for the
# length of one command when the user has not set them, and never for ``run``, whose child
# processes (the training job) inherit the environment.
LEAN_ENVIRONMENT = {
    # The planner's numpy work is integer and element-wise, never BLAS; OpenBLAS would start
    # a thread per core at import that spins for a while: ~0.07 s of CPU per command for nothing.
    "OPENBLAS_NUM_THREADS": "1",
    # pydantic's first model build otherwise reads the entry points of every installed
    # distribution to look for plugins (~16 ms with torch and deepspeed installed).
    "PYDANTIC_DISABLE_PLUGINS": "__all__",
}


def _lean_environment() -> Callable[[], None]:
    """Set the LEAN_ENVIRONMENT variables the user has not set; returns the undo."""
    added = [name for name in LEAN_ENVIRONMENT if name not in os.environ]
    for name in added:
        os.environ[name] = LEAN_ENVIRONMENT[name]

    def restore() -> None:
        for name in added:
            os.environ.pop(name, None)

    return restore


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dsplan")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Plan, configure and run distributed training with DeepSpeed.

    \b
    Start here:
      dsplan suggest --model vl2 --nodes 8      ranked parallel plans for DeepSeek-VL2 on 64 GPUs
      dsplan models                             the built-in model catalog
      dsplan hardware                           the built-in hardware profiles
    """
    if ctx.invoked_subcommand != "run":
        ctx.call_on_close(_lean_environment())


def _load(name: str) -> None:
    """Attach the commands of planner.cli.<name> (each module exposes ``commands``)."""
    try:
        module = importlib.import_module(f"planner.cli.{name}")
    except ModuleNotFoundError as err:
        if err.name == f"planner.cli.{name}":
            return  # command not built yet
        raise
    for command in module.commands:
        main.add_command(command)
