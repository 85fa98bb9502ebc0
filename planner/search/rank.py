"""Ranking: prune by memory, order by the objective, explain the winner and the others.

Objectives (lower key is better):

- ``throughput``: highest tokens/s first.
- ``memory``: lowest peak memory per GPU first (then throughput): the plan with the most
  head-room, for people who expect longer sequences or bigger batches later.
- ``goodput``: most useful tokens/s, tokens/s x goodput (planner/cost/goodput.py): what a plan
  trains per hour of wall time once checkpoint stalls, failures and restarts are paid; the
  caller passes tokens/s already scaled by goodput.
- ``cost``: fewest GPU-hours per million tokens. The search runs on a fixed cluster, so this
  orders like throughput; equal costs go to the plan that keeps fewer bytes in host memory
  (offload) and then less GPU memory.

Ties are broken by a fixed order of the columns (fewer pipeline stages, lower ZeRO stage,
no offload, less recomputation, ...) so the same inputs always give the same ranking.
"""

from __future__ import annotations

import math

import numpy as np

OBJECTIVES = ("throughput", "memory", "cost", "goodput")

# Tie-breakers, most important first: simpler plans win ties.
_TIE_COLUMNS = ("pp", "vs", "tp", "ep", "zero", "offload", "recompute", "sp", "framework", "micro_batch")


def gpu_hours_per_mtok(tokens_per_s, gpus: int):
    """GPU-hours to train one million tokens."""
    tps = np.asarray(tokens_per_s, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(tps > 0, gpus * 1e6 / np.maximum(tps, 1e-300) / 3600.0, np.inf)


def order(objective: str, columns: dict[str, np.ndarray], tokens_per_s: np.ndarray, peak_bytes: np.ndarray,
          cpu_bytes: np.ndarray, gpus: int) -> np.ndarray:
    """Indices of the candidates, best first, under ``objective``."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}")
    ties = [columns[c] for c in reversed(_TIE_COLUMNS)]
    tps = np.asarray(tokens_per_s, dtype=float)
    if objective in ("throughput", "goodput"):
        keys = [*ties, peak_bytes, -tps]
    elif objective == "memory":
        keys = [*ties, -tps, peak_bytes]
    else:
        keys = [*ties, peak_bytes, cpu_bytes, gpu_hours_per_mtok(tps, gpus)]
    return np.lexsort(keys)


def objective_value(objective: str, tokens_per_s: float, peak_bytes: float, gpus: int, goodput: float = 1.0) -> float:
    """The number the objective ranks by, as shown to the user."""
    if objective == "throughput":
        return float(tokens_per_s)
    if objective == "goodput":
        return float(tokens_per_s * goodput)
    if objective == "memory":
        return float(peak_bytes)
    return float(gpu_hours_per_mtok(tokens_per_s, gpus))


_TIME_NAMES = {
    "compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel communication",
    "pp_bubble_s": "pipeline bubble", "pp_comm_s": "pipeline communication",
    "dp_comm_s": "exposed data-parallel communication", "ep_comm_s": "expert all-to-all",
    "cp_comm_s": "context-parallel communication",
    "optimizer_s": "optimizer step",
}
_MEMORY_PARTS = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes")


def why_better(best: dict, runner: dict, objective: str, describe) -> str:
    """``_why_better``; under the goodput objective on useful tokens/s, with both goodputs."""
    if objective != "goodput":
        return _why_better(best, runner, objective, describe)
    line = _why_better(_useful(best), _useful(runner), "throughput", describe)
    return f"{line.replace(' tokens/s', ' useful tokens/s', 1)}{_goodputs(best, runner)}"


def why_behind(best: dict, other: dict, objective: str) -> str:
    """``_why_behind``; under the goodput objective on useful tokens/s, with both goodputs."""
    if objective != "goodput":
        return _why_behind(best, other, objective)
    line = _why_behind(_useful(best), _useful(other), "throughput")
    return f"{line.replace(' tokens/s', ' useful tokens/s', 1)}{_goodputs(other, best)}"


def _useful(plan: dict) -> dict:
    """A plan dict whose tokens/s are the useful ones (tokens/s x goodput)."""
    return {**plan, "tokens_per_s": plan.get("goodput_tokens_per_s", plan["tokens_per_s"])}


def _goodputs(a: dict, b: dict) -> str:
    return f"; goodput {a.get('goodput', 1.0):.2%} vs {b.get('goodput', 1.0):.2%}"


def _why_better(best: dict, runner: dict, objective: str, describe) -> str:
    """One line on why ``best`` beat ``runner`` (plan dicts as ``Plan.to_json()`` gives them).

    Names the configuration difference, then the parts of the ranked quantity (step time, or
    peak memory for the memory objective) that differ most, each with its sign, and the other
    quantity's difference: what the user trades by taking the winner.
    ``describe(plan) -> str`` renders a plan's configuration briefly.
    """
    diff = _config_difference(best, runner)
    gib = 2**30
    time_deltas = {k: runner["time"].get(k, 0.0) - best["time"].get(k, 0.0) for k in _TIME_NAMES}
    mem_deltas = {k: runner["memory"].get(k, 0.0) - best["memory"].get(k, 0.0) for k in _MEMORY_PARTS}
    peak_delta = runner["memory"]["peak_bytes"] - best["memory"]["peak_bytes"]
    speedup = best["tokens_per_s"] / runner["tokens_per_s"] - 1 if runner["tokens_per_s"] else 0.0
    time_parts = _largest(time_deltas, lambda k: _TIME_NAMES[k], _seconds)
    mem_parts = _largest(mem_deltas, lambda k: k.removesuffix("_bytes"), lambda b: f"{b / gib:.2f} GiB")
    head = f"{describe(best)} beats {describe(runner)} ({diff})"
    if objective == "memory":
        other = f"; {speedup:+.1%} tokens/s" if abs(speedup) > 1e-9 else "; equal tokens/s"
        return f"{head}: {peak_delta / gib:.2f} GiB less peak memory ({mem_parts}){other}"
    mem = (f"; peak memory {best['memory']['peak_bytes'] / gib:.1f} vs {runner['memory']['peak_bytes'] / gib:.1f} GiB"
           if abs(peak_delta) > 1e-9 * max(best["memory"]["peak_bytes"], 1.0) else "; equal peak memory")
    if not time_parts:
        return f"{head} by {speedup:.1%} tokens/s at equal time parts; it wins the tie-break (simpler plan){mem}"
    return f"{head} by {speedup:.1%} tokens/s: {time_parts}{mem}"


def _why_behind(best: dict, other: dict, objective: str) -> str:
    """One line on why ``other`` ranks below ``best``: how its configuration differs, what it
    gives up in the ranked quantity (and which parts of it), and the other quantity's
    difference, so every row of the table says what choosing it would cost. When the ranked
    quantity ties, it names what settled the order (see ``order``)."""
    diff = _config_difference(other, best)
    gib = 2**30
    peak_b, peak_o = best["memory"]["peak_bytes"], other["memory"]["peak_bytes"]
    tps_b, tps_o = best["tokens_per_s"], other["tokens_per_s"]
    speed = tps_o / tps_b - 1 if tps_b else 0.0
    same_peak = abs(peak_o - peak_b) <= 1e-9 * max(peak_b, 1.0)
    same_speed = abs(speed) <= 1e-12
    if objective == "memory":
        other_q = ("equal tokens/s" if same_speed
                   else f"{_percent(abs(speed))} {'more' if speed > 0 else 'fewer'} tokens/s")
        if same_peak:
            tail = other_q if not same_speed else "equal tokens/s; the tie-break puts simpler plans first"
            return f"{diff}: equal peak memory, {tail}"
        parts = _largest({k: best["memory"].get(k, 0.0) - other["memory"].get(k, 0.0) for k in _MEMORY_PARTS},
                         lambda k: k.removesuffix("_bytes"), lambda b: f"{b / gib:.2f} GiB")
        return f"{diff}: {(peak_o - peak_b) / gib:.2f} GiB more peak memory ({parts}); {other_q}"
    mem = "equal peak memory" if same_peak else f"peak memory {peak_o / gib:.1f} vs {peak_b / gib:.1f} GiB"
    if same_speed:
        tie = "more peak memory" if not same_peak else "the tie-break (simpler plans first)"
        equal = "equal tokens/s"
        if objective == "cost":  # host memory for offload settles ties first (see ``order``)
            host_b = best["memory"].get("cpu_bytes_per_node", 0.0)
            host_o = other["memory"].get("cpu_bytes_per_node", 0.0)
            if abs(host_o - host_b) > 1e-9 * max(host_b, 1.0):
                tie = f"more host memory for offload ({host_o / gib:.1f} vs {host_b / gib:.1f} GiB per node)"
            else:
                equal = "equal tokens/s and host memory"
        return f"{diff}: {equal}; ranks lower on {tie}; {mem}"
    parts = _largest({k: best["time"].get(k, 0.0) - other["time"].get(k, 0.0) for k in _TIME_NAMES},
                     lambda k: _TIME_NAMES[k], _seconds)
    if objective == "cost":  # GPU-hours per token go as 1 / tokens/s on a fixed cluster
        return f"{diff}: {_percent(tps_b / tps_o - 1)} more GPU-hours per token ({parts}); {mem}"
    return f"{diff}: {_percent(-speed)} fewer tokens/s ({parts}); {mem}"


def _percent(x: float) -> str:
    """A positive fraction as a percentage that never rounds to 0.0%."""
    return f"{x:.1%}" if x >= 5e-4 else f"{x * 100:.2g}%"


def _largest(deltas: dict[str, float], name, fmt, count: int = 2) -> str:
    """The ``count`` parts that differ most (runner minus best), as "X less, Y more"."""
    total = sum(abs(v) for v in deltas.values())
    if total <= 0:
        return ""
    top = sorted((kv for kv in deltas.items() if abs(kv[1]) > 1e-3 * total), key=lambda kv: -abs(kv[1]))[:count]
    return ", ".join(f"{fmt(abs(v))} {'less' if v > 0 else 'more'} {name(k)}" for k, v in top)


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


_CONFIG_KEYS = ("dp", "tp", "pp", "ep", "etp", "cp", "cp_comm", "zero_stage", "dp_replicate", "offload", "micro_batch",
                "grad_accum", "recompute", "activation_offload", "sequence_parallel", "virtual_stages", "framework",
                "zero_pp", "pp_schedule")


def _shown(value: object) -> str:
    """A config value as the explanation names it (a ZeRO++ list as its comma list, or none)."""
    return (",".join(value) or "none") if isinstance(value, (list, tuple)) else str(value)


def _config_difference(a: dict, b: dict) -> str:
    parts = [f"{k} {_shown(a[k])} vs {_shown(b[k])}" for k in _CONFIG_KEYS if k in a and k in b and a[k] != b[k]]
    return ", ".join(parts) if parts else "same configuration, different partition"


_LAYOUT_COLUMNS = ("dp", "tp", "pp", "ep", "cp", "cp_comm", "vs", "zero", "offload", "recompute", "sp", "micro_batch",
                   "grad_accum")


def distinct_top(ranked: np.ndarray, columns: dict[str, np.ndarray], step: np.ndarray, peak: np.ndarray,
                 top: int) -> list[tuple[int, list[int]]]:
    """The first ``top`` distinct plans of ``ranked`` (candidate indices, best first).

    The same layout under two runtimes (DeepSpeed and Megatron-DeepSpeed often price it the
    same) is one plan, not two rows of the top K: candidates equal in every column but the
    framework and in predicted step time and peak memory collapse into the one with the
    simplest runtime (lowest index in FRAMEWORKS); the others' framework indices come back as
    its alternatives. Returns (representative, [alternative framework indices]).
    """
    out: list[tuple[int, list[int]]] = []
    seen: set[int] = set()
    fw = columns["framework"]
    # Rows equal in every layout column (at most one per runtime) share a group: group them with
    # one sort, then test the few members of each plan's group, not every ranked row.
    layout = np.column_stack([columns[c][ranked] for c in _LAYOUT_COLUMNS])
    by_layout = np.lexsort(layout.T[::-1])
    new_group = np.concatenate(([True], np.any(layout[by_layout[1:]] != layout[by_layout[:-1]], axis=1)))
    group = np.empty(len(ranked), dtype=np.int64)
    group[by_layout] = np.cumsum(new_group) - 1
    members_of = np.argsort(group, kind="stable")  # each group's rows, in ranked order
    starts = np.searchsorted(group[members_of], np.arange(int(new_group.sum()) + 1))
    rows, group = ranked.tolist(), group.tolist()
    for p, i in enumerate(rows):
        if i in seen:
            continue
        peers = [rows[q] for q in members_of[starts[group[p]]:starts[group[p] + 1]].tolist()]
        members = [j for j in peers
                   if _close(float(step[j]), float(step[i])) and _close(float(peak[j]), float(peak[i]))]
        members.sort(key=lambda j: int(fw[j]))  # stable: ranked order within a runtime
        seen.update(members)
        out.append((members[0], [int(fw[m]) for m in members[1:]]))
        if len(out) == top:
            break
    return out


def _close(x: float, y: float, rtol: float = 1e-12) -> bool:
    """``np.isclose(x, y, rtol=rtol, atol=0)`` on two floats."""
    return (abs(x - y) <= 0.0 + rtol * abs(y) and math.isfinite(y)) or x == y
