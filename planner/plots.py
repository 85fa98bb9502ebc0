"""Plots of the trade-off sweeps (planner/explore.py): records in, matplotlib Figure out.

Figures are built with ``matplotlib.figure.Figure`` directly, never pyplot, so nothing here
touches a display or global figure state: the CLI and the tests render to PNG headless, and
a notebook shows the returned figure inline. matplotlib is an optional dependency
(``pip install 'dsplan[plot]'``); it is imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from planner.atomic import replace_atomically
from planner.errors import UserError

GiB = 2**30
VALUE_NAMES = {
    "tokens_per_s": "tokens/s", "mfu": "MFU", "tflops_per_gpu": "TFLOP/s per GPU", "peak_gib": "peak GiB per GPU",
}
TIME_PARTS = (("compute_s", "compute"), ("recompute_s", "recompute"), ("tp_comm_s", "TP comm"),
              ("cp_comm_s", "CP comm"), ("pp_bubble_s", "PP bubble"), ("pp_comm_s", "PP comm"),
              ("dp_comm_s", "DP comm"), ("ep_comm_s", "EP comm"), ("optimizer_s", "optimizer"),
              ("act_offload_s", "activation offload"))
MEMORY_PARTS = (("weights_bytes", "weights"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer"),
                ("activations_bytes", "activations"), ("buffers_bytes", "buffers"), ("overhead_bytes", "overhead"))

Rows = Sequence[Mapping[str, Any]]


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'dsplan[plot]'") from None
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _series(rows_or_groups: "Rows | Mapping[str, Rows]") -> dict[str, list[Mapping[str, Any]]]:
    """Accept one list of rows or {name: rows}; group a flat list by model name."""
    if isinstance(rows_or_groups, Mapping):
        return {str(k): list(v) for k, v in rows_or_groups.items()}
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows_or_groups:
        out.setdefault(str(r.get("model", "")), []).append(r)
    return out


def _require(rows: Iterable[Any], what: str) -> list[Any]:
    rows = list(rows)
    if not rows:
        raise UserError(f"nothing to plot for {what}: the sweep returned no rows")
    return rows


# -- scaling ---------------------------------------------------------------------------------


def plot_scaling(rows: "Rows | Mapping[str, Rows]", title: str | None = None) -> Any:
    """Tokens/s (with the linear-scaling line from the smallest fitting point) and MFU
    against node count, one line per model."""
    groups = _series(rows)
    _require([r for v in groups.values() for r in v], "the scaling plot")
    fig, (ax_t, ax_m) = _figure(11, 4.2, 2)
    for name, series in groups.items():
        pts = sorted((r["nodes"], r) for r in series)
        ok = [(n, r) for n, r in pts if r.get("fits")]
        if not ok:
            continue
        xs = [n for n, _ in ok]
        line, = ax_t.plot(xs, [r["tokens_per_s"] for _, r in ok], "o-", label=name)
        n0, r0 = ok[0]
        ax_t.plot(xs, [r0["tokens_per_s"] * n / n0 for n in xs], ":", color=line.get_color(), alpha=0.6)
        ax_m.plot(xs, [100 * r["mfu"] for _, r in ok], "o-", color=line.get_color(), label=name)
        for n, r in pts:
            if not r.get("fits"):
                ax_t.axvline(n, color=line.get_color(), alpha=0.15, lw=6)
    counts = sorted({int(r["nodes"]) for v in groups.values() for r in v})
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.set_xlabel("nodes")
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("tokens/s (best plan)")
    ax_t.set_title("throughput (dotted: linear scaling)")
    ax_m.set_ylabel("MFU (%)")
    ax_m.set_ylim(bottom=0)
    ax_m.set_title("model FLOPs utilisation")
    ax_m.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


# -- Pareto front ----------------------------------------------------------------------------


def plot_pareto(rows: Rows, front: Rows | None = None, title: str | None = None, annotate: int = 6) -> Any:
    """Every feasible plan as peak memory per GPU vs tokens/s; the Pareto front joined and
    its first ``annotate`` points labelled with their layout."""
    from planner.explore import pareto_front

    rows = _require(rows, "the Pareto plot")
    front = list(front) if front is not None else pareto_front(rows)
    fig, (ax,) = _figure(8, 5)
    ax.scatter([r["peak_bytes"] / GiB for r in rows], [r["tokens_per_s"] for r in rows], s=12, alpha=0.35,
               color="tab:gray", label=f"feasible plans ({len(rows)})")
    ax.plot([r["peak_bytes"] / GiB for r in front], [r["tokens_per_s"] for r in front], "o-", color="tab:red",
            label=f"Pareto front ({len(front)})")
    step = max(1, -(-len(front) // max(annotate, 1)))
    for k, r in enumerate(front[::step]):
        ax.annotate(r.get("label", ""), (r["peak_bytes"] / GiB, r["tokens_per_s"]), fontsize=7,
                    xytext=(6, -12 if k % 2 else 6), textcoords="offset points", color="tab:red")
    cap = rows[0].get("capacity_bytes")
    if cap:
        ax.axvline(cap / GiB, color="black", ls="--", lw=1, label="GPU memory")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or _context(rows[0]))
    return fig


def _context(r: Mapping[str, Any]) -> str:
    return f"{r.get('model', '')} on {r.get('nodes', '?')} x {r.get('hardware', '')}"


# -- TP x PP heatmap -------------------------------------------------------------------------


def plot_heatmap(rows: Rows, value: str = "tokens_per_s", title: str | None = None) -> Any:
    """Best ``value`` (tokens/s by default) for each TP x PP pair; pairs where nothing fits
    are left blank and marked "none fits", pairs absent from ``rows`` (no valid layout) "n/a"."""
    import numpy as np

    rows = _require(rows, "the TP x PP heatmap")
    tps = sorted({int(r["tp"]) for r in rows})
    pps = sorted({int(r["pp"]) for r in rows})
    grid = np.full((len(pps), len(tps)), np.nan)
    present = {(int(r["pp"]), int(r["tp"])) for r in rows}
    for r in rows:
        if r.get("fits"):
            grid[pps.index(int(r["pp"])), tps.index(int(r["tp"]))] = float(r[value])
    fig, (ax,) = _figure(1.4 * len(tps) + 3, 0.8 * len(pps) + 2)
    masked = np.ma.masked_invalid(grid)
    im = ax.imshow(masked, cmap="viridis", origin="lower", aspect="auto")
    best = np.nanmax(grid) if np.isfinite(grid).any() else None
    for i in range(len(pps)):
        for j in range(len(tps)):
            v = grid[i, j]
            text = f"{v:,.0f}" if not np.isnan(v) else ("none fits" if (pps[i], tps[j]) in present else "n/a")
            color = "black" if np.isnan(v) or (best and v > 0.6 * best) else "white"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color,
                    fontweight="bold" if best is not None and v == best else "normal")
    ax.set_xticks(range(len(tps)), [str(t) for t in tps])
    ax.set_yticks(range(len(pps)), [str(p) for p in pps])
    ax.set_xlabel("tensor parallel (TP)")
    ax.set_ylabel("pipeline parallel (PP)")
    name = VALUE_NAMES.get(value, value.replace("_", " "))
    fig.colorbar(im, ax=ax, label=name)
    ax.set_title(title or f"best {name} for each TP x PP: {_context(rows[0])}")
    return fig


# -- ZeRO stages -----------------------------------------------------------------------------


def plot_zero(rows: Rows, title: str | None = None) -> Any:
    """Memory per GPU by part (left, with the GPU's capacity) and step time by part (right)
    for each ZeRO stage of one layout."""
    rows = _require(rows, "the ZeRO plot")
    names = [f"ZeRO-{r['zero_stage']}" for r in rows]
    fig, (ax_m, ax_t) = _figure(11, 4.2, 2)
    _stacked(ax_m, names, rows, MEMORY_PARTS, scale=1 / GiB)
    cap = rows[0].get("capacity_bytes")
    if cap:
        ax_m.axhline(cap / GiB, color="black", ls="--", lw=1, label="GPU memory")
    for i, r in enumerate(rows):
        verdict = "fits" if r.get("fits") else "does not fit"
        ax_m.text(i, r["peak_bytes"] / GiB, verdict, ha="center", va="bottom", fontsize=8)
    ax_m.margins(y=0.12)
    ax_m.set_ylabel("GiB per GPU (worst pipeline rank)")
    ax_m.legend(fontsize=7, loc="upper right")
    _stacked(ax_t, names, rows, TIME_PARTS, scale=1.0)
    ax_t.set_ylabel("seconds per step")
    ax_t.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    layout = " ".join(p for p in str(rows[0].get("label", "")).split() if not p.startswith("z"))
    fig.suptitle(title or f"ZeRO stages side by side: {layout} ({_context(rows[0])})")
    return fig


def _stacked(ax: Any, names: list[str], rows: Rows, parts: Sequence[tuple[str, str]], scale: float) -> None:
    bottom = [0.0] * len(rows)
    for key, label in parts:
        vals = [float(r.get(key, 0.0)) * scale for r in rows]
        if not any(vals):
            continue
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.grid(True, axis="y", alpha=0.3)


# -- greedy vs optimal partition ------------------------------------------------------------


def plot_partition(rows: Rows, title: str | None = None) -> Any:
    """Per-stage micro-batch time under the greedy and the optimal balancer; dashed lines
    mark each balancer's bottleneck (the slowest stage sets the pipeline's pace)."""
    rows = _require(rows, "the partition plot")
    stages = sorted({int(r["stage"]) for r in rows})
    fig, (ax,) = _figure(max(6, 1.2 * len(stages) + 3), 4.2)
    width = 0.4
    for k, (name, color) in enumerate((("greedy", "tab:orange"), ("optimal", "tab:blue"))):
        sel = sorted((r for r in rows if r["balancer"] == name), key=lambda r: r["stage"])
        if not sel:
            continue
        xs = [s + (k - 0.5) * width for s in (r["stage"] for r in sel)]
        ax.bar(xs, [1e3 * r["stage_time_s"] for r in sel], width, color=color,
               label=f"{name} ({sel[0]['tokens_per_s']:,.0f} tokens/s)")
        ax.axhline(1e3 * sel[0]["bottleneck_s"], color=color, ls="--", lw=1)
        for x, r in zip(xs, sel):
            ax.text(x, 1e3 * r["stage_time_s"], r["blocks"], ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylabel("ms per micro-batch (fwd + bwd + comm)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.12), ncols=2)
    ax.margins(y=0.15)
    ax.set_title(title or f"greedy vs optimal layer partition: {rows[0].get('label', '')}")
    return fig


# -- fabric what-if ---------------------------------------------------------------------------


def plot_fabric(rows: Rows, title: str | None = None) -> Any:
    """Step time by part for the best plan on each fabric variant, tokens/s written on top."""
    rows = _require(rows, "the fabric plot")
    names = [str(r.get("variant", r.get("hardware", ""))).replace(", ", "\n") for r in rows]
    fig, (ax,) = _figure(max(7, 2.0 * len(rows)), 4.5)
    _stacked(ax, names, rows, TIME_PARTS, scale=1.0)
    for i, r in enumerate(rows):
        if r.get("fits"):
            total = sum(float(r.get(k, 0.0)) for k, _ in TIME_PARTS)
            ax.text(i, total, f"{r['tokens_per_s']:,.0f} tok/s\n{r.get('label', '')}", ha="center", va="bottom",
                    fontsize=7)
    ax.set_ylabel("seconds per step (best plan)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.margins(y=0.2)
    ax.set_title(title or f"fabric what-if: {rows[0].get('model', '')} on {rows[0].get('nodes', '?')} nodes")
    return fig


# -- images and tiles ------------------------------------------------------------------------


def plot_vision(rows: Rows, title: str | None = None) -> Any:
    """Best tokens/s (left) and the vision tower's share of the FLOPs (right) against tiles
    per image, one line per images-per-sample."""
    rows = _require(rows, "the images/tiles plot")
    fig, (ax_t, ax_s) = _figure(11, 4.2, 2)
    for n_img in sorted({r["images_per_sample"] for r in rows}):
        sel = sorted((r for r in rows if r["images_per_sample"] == n_img), key=lambda r: r["tiles_per_image"])
        xs = [r["tiles_per_image"] for r in sel]
        line, = ax_t.plot(xs, [r["tokens_per_s"] for r in sel], "o-", label=f"{n_img} image(s) per sample")
        for r in sel:
            ax_t.annotate(r.get("label", ""), (r["tiles_per_image"], r["tokens_per_s"]), fontsize=6,
                          xytext=(3, 3), textcoords="offset points", color=line.get_color())
        ax_s.plot(xs, [100 * r["vision_share"] for r in sel], "o-", color=line.get_color(), label=f"{n_img} image(s)")
    ax_t.set_xlabel("tiles per image")
    ax_t.set_ylabel("tokens/s (best plan)")
    ax_t.set_ylim(bottom=0)
    ax_t.legend(fontsize=8)
    ax_s.set_xlabel("tiles per image")
    ax_s.set_ylabel("vision tower share of FLOPs (%)")
    ax_s.set_ylim(0, min(100.0, 130 * max(r["vision_share"] for r in rows) + 1))
    for ax in (ax_t, ax_s):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or f"images and tiles per sample: {_context(rows[0])}")
    return fig


# -- output ----------------------------------------------------------------------------------


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"--out {path}: directory {parent} does not exist; create it or pick another path")
    replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    return path


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    """The figure as PNG bytes (for embedding or tests)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
