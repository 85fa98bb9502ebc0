"""``dsplan plot``: the trade-off plots of notebooks/tradeoffs.ipynb, rendered to a PNG.

Thin: flags -> planner.explore sweep -> planner.plots figure -> atomic PNG write. Renders
headless (matplotlib's Agg canvas, no display); matplotlib is the optional ``plot`` extra.
Heavy modules are imported inside the command so ``dsplan --help`` stays fast.
"""

from __future__ import annotations

from typing import Any

import click

from planner.cli.hardware import hardware_option
from planner.cli.options import (
    axes_from_options,
    balancer_option,
    constraint_options,
    layer_profile_option,
    parse_int_list,
    workload_from_options,
    workload_options,
)
from planner.cli.output import console, json_option, print_json
from planner.cli.outputs import OutputPath
from planner.errors import UserError, marked

KINDS = ("pareto", "heatmap", "scaling")


@click.command("plot")
@click.argument("kind", type=click.Choice(KINDS))
@click.option("--model", "model_name", required=True, metavar="NAME|PATH",
              help="Model preset (see `dsplan models`) or a config.json.")
@hardware_option
@click.option("--nodes", default="1", show_default=True, metavar="N|LIST",
              help="Nodes. scaling: the largest count (sweeps 1, 2, 4, ... up to N) or a comma list of counts.")
@click.option("--out", "out", required=True, type=OutputPath("file", ".png"),
              help="PNG file to write (replaced atomically).")
@workload_options("Samples per step [default: ~4M tokens, divisible by many DP sizes].")
@constraint_options
@layer_profile_option
@balancer_option
@json_option
def plot_command(kind: str, model_name: str, hardware: str, nodes: str, out: str, as_json: bool, **opts: Any) -> None:
    """Render a trade-off plot to PNG: pareto (memory vs tokens/s of every plan that fits),
    heatmap (best tokens/s per TP x PP; --tp/--pp pick its axes), scaling (best tokens/s and
    MFU against nodes).

    \b
    Examples:
      dsplan plot pareto --model vl2 --nodes 8 --out pareto.png
      dsplan plot heatmap --model llama-2-70b --nodes 8 --framework megatron --out heat.png
      dsplan plot scaling --model vl2 --nodes 64 --framework deepspeed --out scaling.png
    """
    _require_matplotlib()
    from planner import api, explore, plots

    balancer = opts.pop("balancer")
    workload_opts = workload_from_options(opts)
    axes = _axes(opts)
    model = api.load_model(model_name)
    counts = _node_counts(nodes, kind)
    profile = api.load_hardware(hardware)
    if kind == "scaling":
        rows = explore.scaling(model, profile, counts, workload_options=workload_opts, **axes)
        if not any(r["fits"] for r in rows):
            raise UserError(f"no plan of {model.name} fits at any of {', '.join(map(str, counts))} node(s): "
                            f"{marked(rows[-1]['reason'])}")
        fig = plots.plot_scaling(rows)
        data: dict[str, Any] = {"rows": rows}
    else:
        cluster = api.load_cluster(profile, counts[0])
        wl = api.make_workload(model, gpus=cluster.num_gpus, **workload_opts)
        cands = explore.candidates(model, cluster, workload=wl, balancer=balancer, **axes)
        feasible = [r for r in cands if r["fits"]]
        if kind == "pareto":
            if not feasible:
                raise UserError(f"no plan of {model.name} fits on {counts[0]} node(s) of {profile.name} "
                                f"({len(cands)} candidates); try more --nodes or relax the constraints")
            front = explore.pareto_front(feasible)
            fig = plots.plot_pareto(feasible, front)
            data = {"candidates": len(cands), "feasible": len(feasible), "rows": front}
        else:
            rows = explore.tp_pp_grid(cands)
            fig = plots.plot_heatmap(rows)
            data = {"candidates": len(cands), "feasible": len(feasible), "rows": rows}
    path = plots.save_png(fig, out)
    if as_json:
        print_json({"kind": kind, "model": model.name, "hardware": profile.name, "out": str(path), **data})
    else:
        console.print(f"wrote {path} ({kind}, {len(data['rows'])} points)")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("dsplan plot needs matplotlib: pip install 'dsplan[plot]'") from None


def _node_counts(text: str, kind: str) -> list[int]:
    values = parse_int_list("--nodes", text)
    assert values is not None
    if kind != "scaling":
        if len(values) != 1:
            raise UserError(f"--nodes: {kind} plots one cluster; give one node count, not a list ({text})")
        return list(values)
    if len(values) > 1:
        return sorted(values)
    top, counts, n = values[0], [], 1
    while n < top:
        counts.append(n)
        n *= 2
    return counts + [top]


def _axes(opts: dict[str, Any]) -> dict[str, Any]:
    """Constraint flags (comma lists) to ``api.suggest`` keywords (the API checks the values)."""
    return {k: v for k, v in axes_from_options(opts).items() if v is not None}


commands = [plot_command]
