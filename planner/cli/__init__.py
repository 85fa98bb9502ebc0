"""The ``dsplan`` command line: parse, call the planner API, print (rich table or --json).

Each command lives in its own module here; this module owns the group and the one place
where user errors become a clear message and exit status 2: a UserError (its inputs named by
their flags, planner/cli/flags.py), an OSError on a path
given to an output option (``--out``, ``--draw``, ``--dot``: see planner/cli/outputs.py), and a
full standard output. dsplan's own warnings print as one ``warning: ...`` line. A command's
module is imported only when that command runs (or ``--help`` lists them all): ``dsplan
suggest`` should not pay for the imports of ``models``, ``hardware`` or ``topo``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable

import click

from planner import __version__
from planner.cli.flags import cli_text
from planner.errors import UserError

# planner.cli.<name> holds the command ``name`` (its ``commands`` list); absent modules are skipped.
COMMAND_MODULES = ("models", "hardware", "topo", "estimate", "suggest", "generate", "run", "calibrate", "plot",
                   "profile")


class _Group(click.Group):
    """Loads command modules on demand; turns UserError, and an OSError writing an output
    option's path or stdout, into one message and exit status 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name in COMMAND_MODULES if importlib.util.find_spec(f"planner.cli.{name}") is not None]
        return sorted(set(self.commands) | set(lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            _load(cmd_name)
        return self.commands.get(cmd_name)

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # a full or closed stdout fails here, not in the flush at exit
            return result
        except UserError as err:
            _fail(cli_text(err))
        except OSError as err:
            from planner.cli.outputs import write_error_message

            message = write_error_message(err, ctx)
            if message is None:
                _stdout_failure(err)
                raise  # not an output path or stdout: a bug, with its traceback
            _fail(message)

    def make_context(self, *args, **kwargs):  # type: ignore[override]
        # ``dsplan --help`` prints while the group parses, before click's own closed-pipe
        # handler (status 1) would see it.
        try:
            return super().make_context(*args, **kwargs)
        except OSError as err:
            _stdout_failure(err)
            raise

    def main(self, *args, **kwargs):  # type: ignore[override]
        # click's own output (--help, --version, usage errors) can hit a full stdout too.
        try:
            return super().main(*args, **kwargs)
        except OSError as err:
            _stdout_failure(err)
            raise


def _fail(message: str) -> None:
    """The one line for a user error on stderr, and exit status 2."""
    try:
        click.secho(f"error: {message}", fg="red", err=True)
    except OSError:
        pass  # stderr is gone too: the status still says it
    sys.exit(UserError.exit_code)


def _stdout_failure(err: OSError) -> None:
    """Exit when ``err`` is a failed write to stdout; returns for any other error. A full disk
    (``> /dev/full``) is one line and status 2. A closed pipe (``dsplan suggest | head -1``)
    exits quietly with status 0: the reader took what it wanted, and a pipeline under ``set -o
    pipefail`` must not fail for it (rich's consoles hand their closed pipes here:
    planner/cli/output.py)."""
    from planner.cli.outputs import is_stdout_error, silence_stdout, stdout_error_message

    if not is_stdout_error(err):
        return
    silence_stdout()
    message = stdout_error_message(err)
    if message is None:
        sys.exit(0)
    _fail(message)


# Settings libraries read once, when they load, that only cost the planner time. Set for the
# length of one command when the user has not set them, and never for ``run``, whose child
# processes (the training job) inherit the environment.
LEAN_ENVIRONMENT = {
    # The planner's numpy work is integer and element-wise, never BLAS: no OpenBLAS threads.
    "OPENBLAS_NUM_THREADS": "1",
    # dsplan uses no pydantic plugins: do not look for them at start-up.
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


def _plain_warnings() -> Callable[[], None]:
    """Show dsplan's own warnings (HFImportWarning, ...) as one ``warning: ...`` line on stderr,
    not Python's ``file.py:129: HFImportWarning: ...`` plus a source line; returns the undo.
    Other packages' warnings keep the normal format."""
    import warnings

    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if getattr(category, "__module__", "").partition(".")[0] != "planner":
            return previous(message, category, filename, lineno, file, line)
        stream = file if file is not None else sys.stderr
        if stream is None:
            return None
        try:
            stream.write(f"warning: {' '.join(str(message).split())}\n")
        except OSError:
            pass
        return None

    warnings.showwarning = show

    def restore() -> None:
        if warnings.showwarning is show:
            warnings.showwarning = previous

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
    ctx.call_on_close(_plain_warnings())
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
