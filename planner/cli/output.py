"""Shared output helpers: JSON with stable keys, rich console, human units.

``console`` and ``err_console`` are created on first use (module ``__getattr__``), so a
``--json`` run never imports rich.
"""

from __future__ import annotations

import json
from typing import Any

import click

_CONSOLES = {"console": {}, "err_console": {"stderr": True}}
# The width of output that goes to a file or a pipe (logs, CI, ``| less``), where there is no
# terminal to measure: wide enough for suggest's table (about 140 columns), which rich would
# otherwise squeeze into 80. COLUMNS still wins when set.
PIPE_WIDTH = 160


def output_width(stream: Any) -> int | None:
    """The one width rule for every command's output: COLUMNS when it is set to a positive whole
    number, else the terminal's (None: rich measures it), else PIPE_WIDTH."""
    import os

    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    isatty = getattr(stream, "isatty", None)
    return None if isatty is not None and isatty() else PIPE_WIDTH


def __getattr__(name: str) -> Any:
    """``console`` / ``err_console``: rich consoles, built (and rich imported) when first asked for."""
    if name not in _CONSOLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    from rich.console import Console, ConsoleDimensions

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """A closed pipe is the group's to handle (planner/cli/__init__.py): one rule for
            rich's writes, click's and print's. rich's own handler exits with status 1."""
            self.quiet = True
            raise  # the BrokenPipeError being handled

        @property
        def size(self) -> ConsoleDimensions:
            """The width rule applied at each print, not once at import: the stream and COLUMNS
            of the command running now (a test runner swaps both between commands)."""
            measured = Console.size.fget(self)  # type: ignore[attr-defined]
            width = output_width(self.file)
            return measured if width is None else ConsoleDimensions(width, measured.height)

    options = dict(_CONSOLES[name])
    value = _Console(highlight=False, **options)
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


# The parts of a step's time (planner/cost/step_time.py StepTime; ``<name>_s`` in --json), in
# the order the breakdowns print them.
TIME_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "pp_bubble", "pp_comm", "dp_comm", "ep_comm", "optimizer",
              "act_offload")


def time_parts(cfg: Any) -> list[str]:
    """The TIME_PARTS that apply to a plan of layout ``cfg`` (a ParallelConfig): recompute
    with recomputation, TP communication with tp > 1, the bubble and the sends with pp > 1, DP
    communication with dp x cp > 1 (and on DeepSpeed's ZeRO 0-2 whatever dp: its engine flattens
    the gradients for a reduction over a group of one too), the expert all-to-all with ep > 1,
    context-parallel communication with cp > 1, the activation copies to host memory when
    offloading them. Decided by the layout, not by the value, so a part that applies but is hidden
    behind compute still shows as 0."""
    from planner.cost.frameworks import traits

    flattens = traits(cfg.framework).flat_copies and cfg.zero_stage <= 2
    applies = {"recompute": cfg.recompute != "none", "tp_comm": cfg.tp > 1, "pp_bubble": cfg.pp > 1,
               "pp_comm": cfg.pp > 1, "dp_comm": cfg.dp * cfg.cp > 1 or flattens, "ep_comm": cfg.ep > 1,
               "cp_comm": cfg.cp > 1, "act_offload": cfg.activation_offload > 0}
    return [part for part in TIME_PARTS if applies.get(part, True)]


def attention_words(flash_attention: bool, flash_version: int) -> str:
    """What a header says of the attention kernel where it is not FlashAttention-2: ", ..." or ""."""
    if not flash_attention:
        return ", unfused attention"
    return ", FlashAttention-1" if flash_version == 1 else ""


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
    """2.50 s, 12.30 ms, 4.2 us; exactly 0 (a part that applies but is hidden) as 0 s."""
    if s == 0:
        return "0 s"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def human_duration(s: float) -> str:
    """human_time up to two minutes, then minutes, then hours."""
    if s < 120:
        return human_time(s)
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def checkpoint_line(ckpt: Any, step_s: float, tokens_per_s: float) -> str:
    """The checkpoint and goodput facts of a plan (planner/cost/goodput.CheckpointPlan) in a line."""
    stall = (f"stalls {human_time(ckpt.stall_s)}, durable after {human_time(ckpt.persist_s)}"
             if ckpt.persist_s > ckpt.stall_s * (1 + 1e-9) else f"stalls {human_time(ckpt.stall_s)}")
    return (f"checkpoint {human_bytes(ckpt.full_bytes)} (model only {human_bytes(ckpt.model_bytes)}): save "
            f"{stall}, restore {human_duration(ckpt.restore_s)} + restart {human_duration(ckpt.restart_s)}; "
            f"every {ckpt.interval_steps} steps ({human_duration(ckpt.interval_steps * step_s)}) at MTBF "
            f"{ckpt.mtbf_s / 3600:,.1f} h: goodput {ckpt.goodput:.1%}, {tokens_per_s * ckpt.goodput:,.0f} "
            "useful tokens/s")
