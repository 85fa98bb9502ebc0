"""``dsplan suggest``: search the parallel space and print the best plans.

Thin by design: parse the flags, call ``planner.api.suggest``, print a rich table (or
``--json``). Heavy modules are
imported inside the command so ``dsplan --help`` stays fast.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

import click

from planner.cli.flags import cli_text
from planner.cli.options import (
    axes_from_options,
    balancer_option,
    calibration_option,
    constraint_options,
    layer_profile_option,
    objective_option,
    workload_from_options,
    workload_options,
)
from planner.cli.output import json_option
from planner.cli.suggest_rows import COLUMNS, legend, plan_lines, table_row


@click.command("suggest")
@click.option("--model", "model", required=True, metavar="NAME|PATH",
              help="Model preset (see `dsplan models`) or a config.json.")
@click.option("--hardware", "hardware", default="dgx-a100-80g", show_default=True, metavar="NAME|PATH",
              help="Hardware profile: a built-in name (see `dsplan hardware`) or a YAML file.")
@calibration_option
@click.option("--nodes", type=int, default=1, show_default=True, help="Number of nodes.")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node, 1-576 [default: from the hardware profile].")
@workload_options("Samples per optimizer step [default: about 4M tokens, rounded to what divides].",
                  precision_list=True)
@constraint_options
@balancer_option
@layer_profile_option
@objective_option
@click.option("--top", type=int, default=5, show_default=True, help="How many plans to show.")
@json_option
def suggest_command(as_json: bool, **opts: Any) -> None:
    """Rank parallel plans (DP/TP/PP/EP, ZeRO, offload, micro-batch, recompute) for a model on a cluster.

    \b
    Prunes by memory, ranks by the objective, shows the best plan's stage partition and
    breakdowns, then one line per plan on why it ranks below #1, and last the `dsplan
    generate` command that writes plan #1's run directory. Plans whose predicted step time is
    within the model's mean error on published runs (8.8%, docs/accuracy.md) of #1's are
    marked "~": treat them as ties. Exit status 2 when the input is wrong or no plan fits
    (with the closest plan and what would make it fit).

    \b
    The table (a legend under it names the abbreviations that appear):
      8+sp           tensor parallelism 8 with sequence parallelism
      2x4 (pp)       2 pipeline stages x 4 interleaved virtual stages per rank
      8V (pp)        8 pipeline ranks holding 2 model chunks each in DualPipeV's V
      opt            optimizer states offloaded to the CPU (opt+params: and the parameters)
      act 38         the activations of 38 decoder layers offloaded to host memory
      meg-ds         megatron-deepspeed; deepspeed/meg-ds: the same prediction under both
      mb x acc       micro-batch x gradient-accumulation steps
      stage, greedy  a pipelined plan's slowest stage per micro-batch (optimal balancer) and
                     how much slower the greedy balancer's would be; * its split is balanced
                     within memory

    \b
    Examples:
      dsplan suggest --model vl2 --nodes 8
      dsplan suggest --model llama-3.1-70b --nodes 4 --tp 8 --pp 2,4 --zero 1
      dsplan suggest --model llama-3.1-405b --nodes 2048 --objective cost --json
      dsplan suggest --model llama-3-8b --nodes 2 --calibration calibration.yaml
    """
    from planner.search.suggest import NoPlanFits

    bar = _progress_bar() if (not as_json and sys.stderr.isatty()) else None
    try:
        result = run_suggest(opts, progress=bar.update if bar else None)
    except NoPlanFits as err:
        if as_json:
            from planner.cli.output import print_json

            data = err.result.to_json()
            data["error"] = cli_text(err)
            data["closest"] = err.result.closest.to_json() if err.result.closest else None
            data["advice"] = list(err.result.advice)
            print_json(data)
        raise
    finally:
        if bar is not None:
            bar.close()
    from planner.cli.next_step import default_out, generate_argv

    argv = generate_argv(click.get_current_context(), default_out(result.inputs["model"], result.inputs["nodes"]))
    if as_json:
        from planner.api_records import uncertainty
        from planner.cli.output import print_json

        print_json({**result.to_json(), "uncertainty": uncertainty(result), "next_command": shlex.join(argv)})
    else:
        render(result, argv)


def run_suggest(opts: dict[str, Any], progress=None):
    """Click options -> ``planner.api.suggest`` (the model, the cluster, the workload flags given
    and the parsed search axes; the API fills the defaults and checks the values)."""
    from planner import api

    axes = axes_from_options(opts)
    model = api.load_model(opts["model"])
    cluster = api.load_cluster(opts["hardware"], opts["nodes"], gpus_per_node=opts.get("gpus_per_node"),
                               calibration=opts.get("calibration"))
    return api.suggest(model, cluster, top=opts["top"], objective=opts["objective"], balancer=opts["balancer"],
                       progress=progress, **workload_from_options(opts), **axes)


# -- human output ------------------------------------------------------------------------------


class _progress_bar:
    """A rich progress bar on standard error (only used when it is a terminal)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from planner.cli.output import err_console

        self._p = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                           TimeElapsedColumn(), console=err_console, transient=True)
        self._task = self._p.add_task("search", total=1.0)
        self._p.start()

    def update(self, fraction: float) -> None:
        self._p.update(self._task, completed=fraction)

    def close(self) -> None:
        self._p.stop()




def render(result, next_argv: list[str] | None = None) -> None:
    """The human output, as wide as planner/cli/output.py's one width rule allows: the inputs,
    the table and its legend, how far the model's error reaches, #1 in detail, why the others
    rank below it, the search's counts, and (``next_argv``) the command that writes #1's run
    directory."""
    from planner.api_records import uncertainty
    from planner.cli.output import console, human_bytes, human_time

    console.print(_inputs_line(result.inputs))
    ties = uncertainty(result)["ties_with_best"]
    tied = set(ties or ())
    many = "," in str(result.inputs.get("precision", ""))  # several precisions searched: name each plan's
    rows = [table_row(rp, tied, many) for rp in result.plans]
    _render_table(console, rows)
    if any("memory_constrained" in rp.balancer_bottleneck_s for rp in result.plans):
        console.print("*: the time-balanced split runs out of memory; the plan uses the fastest split that fits "
                      "(its slowest stage: balancer_bottleneck_s.memory_constrained in --json)")
    console.print(legend(rows, result.inputs.get("recompute_modules")), markup=False)
    if ties is not None and len(result.plans) > 1:
        console.print(_ties_line(ties), markup=False)
    _render_best(result, console, human_bytes, human_time)
    if len(result.plans) > 1:
        console.print("[bold]why the others rank below #1[/]:")
        # one call: --top 1000 prints fast
        console.print("\n".join(f"  #{rp.id} {cli_text(rp.why)}" for rp in result.plans[1:]))
    r, top = result.rejected, result.inputs["top"]
    console.print(
        f"{result.evaluated:,} candidates evaluated ({result.fully_evaluated:,} in full, {result.pruned:,} ruled out "
        f"by a bound that proves they cannot reach the top {top:,}) in {result.elapsed_s:.2f} s; rejected before "
        f"ranking: {r['out_of_memory']:,} out of memory, {r['indivisible']:,} indivisible degree combinations, "
        f"{r['framework']:,} the framework cannot run.")
    if next_argv is not None:
        from planner.cli.next_step import shell_lines

        console.print("[bold]next[/]: write plan #1's run directory (configs and launch scripts) with")
        console.print("\n".join(f"  {line}" for line in shell_lines(next_argv, console.width - 2)), markup=False,
                      highlight=False, soft_wrap=True)


def _inputs_line(i: dict) -> str:
    """What was searched, defaults filled in: one line (wrapped to the width)."""
    from planner.cli.output import attention_words, human_count
    from planner.cost.eager_kernels import eager_words

    return (f"[bold]{i['model']}[/] on {i['nodes']} x {i['gpus_per_node']} {i['hardware']} ({i['gpus']} GPUs) | "
            f"global batch {i['global_batch']} x {i['seq_len']} tokens = {human_count(i['tokens_per_step'])} "
            f"tokens/step | {i['precision']}, {i['optimizer']}"
            + attention_words(i.get("flash_attention", True), i.get("flash_version", 2))
            + (f", {eager}" if (eager := eager_words(str(i.get("compile", "model,loss")).split(","),
                                                    i.get("rms_norm_kernel", "fused"),
                                                    "dualpipev" in str(i.get("pp_schedule")))) else "")
            + (" under DualPipeV" if "," in str(i.get("pp_schedule")) and eager == "eager blocks" else "")
            + (", dropout" if i.get("dropout") else "")
            + (f" | {i['images_per_sample']} image(s) x {i['tiles_per_image']} tiles" if i["images_per_sample"] else "")
            + f" | balancer {i['balancer']}, objective {i['objective']}")


def _render_table(console, rows: list[tuple[str, ...]]) -> None:
    """The plans as a table, or, on a console too narrow for it, two lines per plan (so no
    number is cut short)."""
    from rich import box
    from rich.cells import cell_len
    from rich.measure import Measurement
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    # Cells are plain one-line strings: each column is as wide as its widest cell. Saying so
    # spares rich measuring every cell twice (the fit test below, then printing), which took
    # seconds for --top 1000.
    widths = [max(cell_len(text) for text in column) for column in zip(COLUMNS, *rows)]
    for col, width in zip(COLUMNS, widths):
        left = col in ("#", "framework", "offload", "recompute")
        table.add_column(col, justify="left" if left else "right", no_wrap=True, width=width)
    for row in rows:
        table.add_row(*row)
    if Measurement.get(console, console.options.update_width(10**6), table).maximum <= console.width:
        console.print(table)
    else:
        for row in rows:
            for line in plan_lines(dict(zip(COLUMNS, row))):
                console.print(line)


def _ties_line(ties: list[int]) -> str:
    """Whether the plans shown are further apart than the model's error (planner/accuracy.py)."""
    from planner.accuracy import MODEL_ERROR, MODEL_ERROR_SOURCE

    if len(ties) == 1:
        return (f"#1 is faster than the other plans shown by more than {MODEL_ERROR:.1%} of its step time, "
                f"{MODEL_ERROR_SOURCE}")
    return (f"~ plans {_id_ranges(ties)} predict step times within {MODEL_ERROR:.1%} of #1's, "
            f"{MODEL_ERROR_SOURCE}: treat them as ties (measure before choosing among them)")


def _id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 5] -> '#1-#3, #5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}-#{r[-1]}" for r in runs)


def _render_best(result, console, human_bytes, human_time) -> None:
    from planner.cli.output import time_parts

    best = result.plans[0]
    p = best.plan.to_json()
    console.print(f"[bold]best plan #1[/]: {cli_text(result.why)}")
    for line in result.notes:
        console.print(f"[bold]note[/]: {cli_text(line)}")
    if p["pp"] > 1:
        from planner.cost.memory import group_to_set

        b = best.balancer_bottleneck_s
        m = p["grad_accum"]
        g = group_to_set(p["pp"], p.get("virtual_stages", 1), m) if p.get("pp_schedule") != "dualpipev" else None
        if g:
            console.print(f"interleaved schedule: {m} micro-batches per step over pp {p['pp']} run {g} at a time on "
                          f"each virtual stage (--microbatch-group-size-per-virtual-pipeline-stage {g}: Megatron's "
                          f"default of pp needs a multiple of {p['pp']}), which keeps more of them in flight")
        console.print(f"stage partition ({result.inputs['balancer']} balancer; slowest stage per micro-batch: optimal "
                      f"{human_time(b['optimal'])}, greedy {human_time(b['greedy'])}"
                      + (f"; the time-balanced split runs out of memory, so this one balances within memory: "
                         f"{human_time(b['memory_constrained'])}" if "memory_constrained" in b else "") + "):")
        for s in p["stages"]:
            kinds = ", ".join(f"{n} {k}" for k, n in s["block_kinds"].items())
            console.print(f"  rank {s['rank']}: blocks {s['blocks']} ({kinds}); "
                          f"{human_time(s['microbatch_time']['total_s'])} per micro-batch, "
                          f"peak {human_bytes(s['memory']['peak_bytes'])}")
    t = p["time"]
    parts = ", ".join(f"{k.replace('act_', 'activation ').replace('_', ' ')} {human_time(t[f'{k}_s'])}"
                      for k in time_parts(best.plan.cfg))
    console.print(f"time per step {human_time(p['step_time_s'])}: {parts}")
    m = p["memory"]
    mparts = ", ".join(f"{k.removesuffix('_bytes')} {human_bytes(m[k])}" for k in
                       ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
                        "overhead_bytes"))
    cpu = f", CPU {human_bytes(m['cpu_bytes_per_node'])} per node" if "cpu_bytes_per_node" in m else ""
    console.print(f"memory on the fullest GPU {human_bytes(m['peak_bytes'])} of {human_bytes(m['capacity_bytes'])}: "
                  f"{mparts}{cpu}")


commands = [suggest_command]
