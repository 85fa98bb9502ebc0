"""``dsplan models``: the built-in catalog, and one model's block-by-block breakdown."""

from __future__ import annotations

from typing import Any

import click
from rich import box
from rich.table import Table

from planner.cli.output import console, human_count, json_option, print_json
from planner.model.catalog import (
    list_presets,
    load_model_with_warnings,
    load_preset,
    preset_info,
    resolve_preset_name,
)
from planner.model.summary import describe_positions, model_summary


def _experts(row: dict[str, Any]) -> str:
    if not row["routed_experts"]:
        return "-"
    shared = f"+{row['shared_experts']}" if row["shared_experts"] else ""
    return f"{row['routed_experts']}{shared}/{row['top_k']}"


@click.group("models", invoke_without_command=True)
@json_option
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List the built-in model presets (name, family, parameters, shape, experts, vision).

    Activated parameters are those one token passes through (top-k experts, vision tower and
    LM head; the embedding table excluded). Any --model option takes a preset name or alias,
    or a path to a Hugging Face config.json (or a directory holding one).

    \b
    Examples:
      dsplan models
      dsplan models --json
      dsplan models show vl2
    """
    if ctx.invoked_subcommand is not None:
        return
    rows = []
    for name in list_presets():
        row = model_summary(load_preset(name))
        row["aliases"] = preset_info(name).get("aliases", [])
        rows.append(row)
    if as_json:
        print_json(rows)
        return
    table = Table(title="dsplan model presets", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False, padding=(0, 1, 0, 0))
    for col, justify in (("name", "left"), ("family", "left"), ("total", "right"), ("active", "right"),
                         ("layers", "right"), ("hidden", "right"), ("experts", "right"), ("vlm", "left")):
        table.add_column(col, justify=justify, no_wrap=col in ("name", "family", "experts"))  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r["name"], r["family"], human_count(r["total_params"]), human_count(r["activated_params"]),
                      str(r["layers"]), str(r["hidden"]), _experts(r), "yes" if r["vision"] else "-")
    console.print(table)
    aliases = ", ".join(f"{a} = {r['name']}" for r in rows for a in r["aliases"])
    console.print(f"experts: routed(+shared)/top-k; activated excludes the embedding table. Aliases: {aliases}")
    console.print("Details: dsplan models show NAME (or a path to a config.json)")


@models.command("show")
@click.argument("model")
@json_option
def show(model: str, as_json: bool) -> None:
    """Show one model block by block: MODEL is a preset name, an alias, or a config.json path.

    Consecutive identical blocks share one row (DeepSeek-VL2: 29 "decoder (MoE, MLA)"), with
    its per-block and total parameters. Vision-language models also show their tiling facts;
    imported configs list every field that was filled by a default.

    \b
    Examples:
      dsplan models show deepseek-vl2
      dsplan models show ./my-model/config.json --json
    """
    spec, messages = load_model_with_warnings(model)
    for message in messages:  # one line each, never wrapped or read as rich markup
        click.echo(f"warning: {' '.join(message.split())}", err=True)
    summary = model_summary(spec, blocks=True)
    preset = resolve_preset_name(model)
    info = preset_info(preset) if preset else {}
    summary["aliases"] = info.get("aliases", [])
    summary["notes"] = info.get("notes", [])
    if as_json:
        print_json(summary)
        return
    _print_show(summary)


def _print_show(s: dict[str, Any]) -> None:
    stated = ""
    if s["stated_total_params"]:
        stated = f" (authors: {human_count(s['stated_total_params'])} / {human_count(s['stated_activated_params'])})"
    console.print(f"[bold]{s['name']}[/bold]  {s['family']}  (model_type {s['hf_model_type'] or '-'})")
    mtp = (f" ({human_count(s['total_params'] - s['mtp_params'])} main model + {human_count(s['mtp_params'])} in "
           f"{s['mtp_layers']} multi-token-prediction depth(s))" if s["mtp_layers"] else "")
    console.print(f"parameters: {human_count(s['total_params'])} total{mtp}, {human_count(s['activated_params'])} "
                  f"activated per token excluding the embedding table{stated}")
    attn = f"{s['attention'].upper()} {s['heads']} heads / {s['kv_heads']} KV heads"
    console.print(f"shape: {s['layers']} layers, hidden {s['hidden']}, {attn}, vocab {s['vocab']}, "
                  f"{'tied' if s['tied_embeddings'] else 'untied'} head; seq {s['train_seq_len']} for training "
                  f"(window {s['max_seq_len']})")
    if s["routed_experts"]:
        console.print(f"experts: {s['moe_layers']} MoE layers, {s['routed_experts']} routed (top-{s['top_k']}) "
                      f"+ {s['shared_experts']} shared")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for col, justify in (("#", "right"), ("block", "left"), ("count", "right"), ("params/block", "right"),
                         ("activated/block", "right"), ("params", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for g in s["blocks"]:
        label = g["label"]
        unused = g["block"].get("unused_params", 0)
        if unused:
            label += f" (+{human_count(unused)} unused head)"
        table.add_row(str(g["first_index"]), label, str(g["count"]), f"{g['params_each']:,}",
                      f"{g['activated_params_each']:,}", f"{g['params_total']:,}")
    table.add_row("", "[bold]total[/bold] (activated incl. embedding)", "", "",
                  f"{s['activated_params_incl_embedding']:,}",
                  f"[bold]{s['total_params']:,}[/bold]")
    console.print(table)
    t = s["tiling"]
    if t:
        view = " + a global view" if t["global_view"] else ""
        console.print(f"vision: {human_count(s['vision_params'])} params (tower + projector); {t['tile_px']}-px tiles, "
                      f"{t['patches_per_tile']} patches -> {t['tokens_per_tile']} tokens per tile, up to "
                      f"{t['max_local_tiles']} tiles per image{view}; planning default "
                      f"{t['default_images_per_sample']} image(s) x {t['default_tiles_per_image']} tile(s)"
                      f"{', newline tokens per row' if t['newline_tokens'] else ''}")
    console.print(describe_positions(s["positions"], s["norm_eps"]))
    if s["defaulted"]:
        console.print("filled by defaults: " + ", ".join(s["defaulted"]))
    for note in s["notes"]:
        console.print(f"note: {note}")


commands = [models]
