"""The cells of ``dsplan suggest``'s ranked table, its narrow-terminal lines and its legend:
one plan's JSON (Plan.to_json) turned into short text, each abbreviation explained once."""

from __future__ import annotations

import math

_SHORT_FW = {"deepspeed": "deepspeed", "megatron-deepspeed": "meg-ds", "megatron": "megatron",
             "torchtitan": "torchtitan"}
_SHORT_OFFLOAD = {"none": "-", "optimizer": "opt", "optimizer+params": "opt+params"}

COLUMNS = ("#", "framework", "dp", "tp", "pp", "ep", "cp", "zero", "offload", "mb x acc", "recompute", "peak / cap",
           "step", "tokens/s", "MFU", "goodput", "stage, greedy")


def plan_lines(cell: dict[str, str]) -> tuple[str, str]:
    """A table row as two lines of text, for terminals too narrow for the table."""
    layout = (f"#{cell['#']} {cell['framework']}: dp {cell['dp']} x tp {cell['tp']} x pp {cell['pp']}"
              + (f" (ep {cell['ep']})" if cell["ep"] != "1" else "")
              + (f" x cp {cell['cp']}" if cell["cp"] != "1" else "") + f", ZeRO-{cell['zero']}"
              + (f", offload {cell['offload']}" if cell["offload"] != "-" else "")
              + f", mb x acc {cell['mb x acc']}, recompute {cell['recompute']}")
    figures = (f"    peak {cell['peak / cap']}, step {cell['step']}, {cell['tokens/s']} tokens/s, MFU {cell['MFU']}, "
               f"goodput {cell['goodput']}"
               + ("" if cell["stage, greedy"] == "-" else f"; stage, greedy {cell['stage, greedy']}"))
    return layout, figures


_ZERO_PP_MARK = {"qwz": "w", "hpz": "p", "qgz": "g"}  # the zero column's ZeRO++ letters (h is hybrid sharding)


def table_row(rp, ties, precision: bool = False) -> tuple[str, ...]:
    """One plan's cells, in COLUMNS order; ``ties``: the ids within the model's error of #1
    (marked "~", #1 itself aside); ``precision``: name the plan's precision beside its runtime."""
    from planner.cli.output import human_count, human_time

    p = rp.plan.to_json()
    gib = 2**30
    mem = p["memory"]
    return (
        f"{rp.id}{'~' if rp.id in ties and rp.id != 1 else ''}",
        "/".join(_SHORT_FW[f] for f in (p["framework"], *rp.also_runs_on))  # identical predictions
        + (f" {p['precision']}" if precision else ""),
        str(p["dp"]), f"{p['tp']}{'+sp' if p['sequence_parallel'] else ''}",
        _pp_cell(p),
        f"{p['ep']}{'f' if p['etp'] < p['tp'] else ''}",
        f"{p['cp']}{_CP_MARK[p['cp_comm']] if p['cp'] > 1 else ''}",
        f"{p['zero_stage']}{'h' + str(p['dp_replicate']) if p['dp_replicate'] > 1 else ''}"
        + ("++" + "".join(_ZERO_PP_MARK[k] for k in p["zero_pp"]) if p.get("zero_pp") else ""),
        _offload_cell(p), f"{p['micro_batch']}x{p['grad_accum']}", p["recompute"],
        f"{mem['peak_bytes'] / gib:.1f}/{mem['capacity_bytes'] / gib:.0f} GiB", human_time(p["step_time_s"]),
        human_count(p["tokens_per_s"]), f"{p['mfu']:.1%}", _floor_percent(p.get("goodput", 1.0)),
        _bottlenecks(rp.balancer_bottleneck_s))


def _offload_cell(p: dict) -> str:
    """What a plan keeps in host memory: optimizer states (opt), parameters, decoder layers' activations (act N)."""
    parts = [_SHORT_OFFLOAD[p["offload"]]] if p["offload"] != "none" else []
    parts += [f"act {p['activation_offload']}"] if p.get("activation_offload") else []
    return "+".join(parts) or "-"


def _floor_percent(x: float) -> str:
    """A share as a percentage rounded down, so 99.96% reads 99.9%, not 100.0%."""
    return f"{math.floor(x * 1000) / 10:.1f}%"


def _bottlenecks(b: dict) -> str:
    """The slowest stage per micro-batch under the optimal balancer and how much slower the
    greedy one's is ("1.26 s +2.1%"), so every pipelined row shows what greedy costs; "-"
    without a pipeline."""
    if b.get("optimal") is None or b.get("greedy") is None:
        return "-"
    from planner.cli.output import human_time

    o, g = b["optimal"], b["greedy"]
    star = "*" if "memory_constrained" in b else ""  # the plan uses a split balanced within memory
    return f"{human_time(o)} +{(g / o - 1) * 100 if o > 0 else 0.0:.1f}%{star}"


# The cp column's mark for how the ranks exchange (none: the ring, Megatron's default).
_CP_MARK = {"p2p": "", "a2a": "a", "a2a+p2p": "h"}


def _pp_cell(p: dict) -> str:
    """The pipeline: its depth, x its interleaved chunks per rank, or V for DualPipeV's two a rank."""
    if p["pp"] > 1 and p.get("pp_schedule") == "dualpipev":
        return f"{p['pp']}V"
    return f"{p['pp']}{'x' + str(p['virtual_stages']) if p['virtual_stages'] > 1 else ''}"


def legend(rows: list[tuple[str, ...]], modules: "tuple[str, ...] | list[str] | None" = None) -> str:
    """One line naming each abbreviation the table shows (only those that appear); ``modules``:
    what the search's selective recompute runs again (Workload.recompute_modules)."""
    cells = [dict(zip(COLUMNS, row)) for row in rows]

    def first(column: str, mark: str) -> str | None:
        return next((c[column] for c in cells if mark in c[column]), None)

    parts = []
    if first("#", "~"):
        parts.append("~ = within the model's error of #1 (below)")
    if sp := first("tp", "+sp"):
        parts.append(f"{sp} = TP {sp.removesuffix('+sp')} with sequence parallelism")
    if vs := first("pp", "x"):
        stages, virtual = vs.split("x")
        parts.append(f"pp {vs} = {stages} pipeline stages x {virtual} interleaved virtual stages per rank")
    if v_shape := first("pp", "V"):
        parts.append(f"pp {v_shape} = {v_shape[:-1]} pipeline ranks holding 2 model chunks each in DualPipeV's V")
    if folded := first("ep", "f"):
        parts.append(f"ep {folded} = EP {folded.removesuffix('f')} with the experts folded out of TP (etp 1: "
                     "each rank holds whole experts)")
    for comm, mark in _CP_MARK.items():
        if cp := first("cp", mark or "\0"):
            parts.append(f"cp {cp} = context parallel over {cp.removesuffix(mark)} ranks, {comm}")
    if any(c["cp"] != "1" and c["cp"].isdigit() for c in cells):
        parts.append("cp = context-parallel ranks, exchanging K/V in a ring (p2p)")
    if hybrid := first("zero", "h"):
        stage, groups = hybrid.split("h")
        parts.append(f"zero {hybrid} = ZeRO-{stage} sharded within each of {groups} groups that replicate "
                     "each other (hybrid sharding)")
    if zpp := first("zero", "++"):
        parts.append(f"zero {zpp} = ZeRO-3 with DeepSpeed's ZeRO++ (w qwz: int8 weight gathers, p hpz: "
                     "node-local secondary weights, g qgz: int4 gradients)")
    offloads = {c["offload"].split("+act")[0] for c in cells}
    if "opt" in offloads:
        parts.append("opt = optimizer states offloaded to the CPU")
    if "opt+params" in offloads:
        parts.append("opt+params = optimizer states and parameters offloaded to the CPU")
    if act := first("offload", "act "):
        act = act.split("+")[-1]
        parts.append(f"{act} = the activations of {act.removeprefix('act ')} decoder layers offloaded to host memory")
    if first("framework", "meg-ds"):
        parts.append("meg-ds = megatron-deepspeed")
    if both := first("framework", "/"):
        parts.append(f"{both} = the same prediction under each")
    if modules and any(c["recompute"] == "selective" for c in cells):
        parts.append(f"recompute selective = Megatron's selective recompute of {', '.join(modules)} "
                     "(--recompute-modules)")
    if any(c["recompute"] == "op" for c in cells):
        parts.append("recompute op = torchtitan's per-op selective activation checkpointing")
    parts.append("mb x acc = micro-batch x gradient-accumulation steps")
    if any(c["stage, greedy"] != "-" for c in cells):
        parts.append("stage, greedy = the slowest pipeline stage per micro-batch (optimal balancer), "
                     "+ how much slower the greedy balancer's would be")
    return "legend: " + "; ".join(parts)
