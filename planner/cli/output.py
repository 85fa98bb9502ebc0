"""Shared output helpers: JSON with stable keys, rich console, human units.

``console`` and ``err_console`` are created on first use (module ``__getattr__``), so a
``--json`` run never imports rich.
"""

from __future__ import annotations

import json
from typing import Any

import click

_CONSOLES = {"console": {}, "err_console": {"stderr": True}}
# Piped output (logs, CI) has no terminal width; rich would assume 80 columns and squeeze the
# breakdown tables. COLUMNS still wins when set.
PIPE_WIDTH = 120


def __getattr__(name: str) -> Any:
    """``console`` / ``err_console``: rich consoles, built (and rich imported) when first asked for."""
    if name not in _CONSOLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import os
    import sys

    from rich.console import Console

    options = dict(_CONSOLES[name])
    stream = sys.stderr if options.get("stderr") else sys.stdout
    if "COLUMNS" not in os.environ and not stream.isatty():
        options["width"] = PIPE_WIDTH
    value = Console(highlight=False, **options)
    globals()[name] = value
    return value

json_option = click.option(
    "--json", "as_json", is_flag=True,
    help="Print machine-readable JSON (stable snake_case keys; units as suffixes, e.g. _GiB, _GBps).",
)


def print_json(data: Any) -> None:
    """``data`` as JSON on stdout, every message in it naming inputs by their flags."""
    from planner.cli.flags import cli_data

    click.echo(json.dumps(cli_data(data), indent=2, sort_keys=False, default=_default))


def _default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def human_count(n: float) -> str:
    """12.9B, 413M, 7.5K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}" if abs(n) < 10 * scale else f"{n / scale:.1f}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    """Binary units, as nvidia-smi and DeepSpeed print them."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
