"""Ranking: prune by memory, order by the objective, explain the winner.

Objectives (lower key is better):

- ``throughput``: highest tokens/s first.
- ``memory``: lowest peak memory per GPU first (then throughput): the plan with the most
  head-room, for people who expect longer sequences or bigger batches later.
- ``cost``: fewest GPU-hours per million tokens. The search runs on a fixed cluster, so this
  orders like throughput, except that ties (equal tokens/s to 0.1%) go to the plan that keeps
  fewer bytes on CPU (offload needs host memory that is billed too) and then less memory.

Ties are broken by a fixed order of the columns (fewer pipeline stages, lower ZeRO stage,
no offload, less recomputation, ...) so the same inputs always give the same ranking.
"""

from __future__ import annotations

import numpy as np

OBJECTIVES = ("throughput", "memory", "cost")

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
    if objective == "throughput":
        keys = [*ties, peak_bytes, -tps]
    elif objective == "memory":
        keys = [*ties, -tps, peak_bytes]
    else:
        cost = gpu_hours_per_mtok(tps, gpus)
        bucket = np.round(np.log(np.maximum(cost, 1e-300)) / np.log1p(1e-3))  # 0.1% buckets
        keys = [*ties, peak_bytes, cpu_bytes, cost, bucket]
    return np.lexsort(keys)


def objective_value(objective: str, tokens_per_s: float, peak_bytes: float, gpus: int) -> float:
    """The number the objective ranks by, as shown to the user."""
    if objective == "throughput":
        return float(tokens_per_s)
    if objective == "memory":
        return float(peak_bytes)
    return float(gpu_hours_per_mtok(tokens_per_s, gpus))


_TIME_PARTS = {
    "compute_s": "less compute time",
    "recompute_s": "less recomputation",
    "tp_comm_s": "less tensor-parallel communication",
    "pp_bubble_s": "a smaller pipeline bubble",
    "pp_comm_s": "less pipeline communication",
    "dp_comm_s": "less exposed data-parallel communication",
    "ep_comm_s": "less expert all-to-all",
    "optimizer_s": "a faster optimizer step",
}


def why_better(best: dict, runner: dict, objective: str, describe) -> str:
    """One line on why ``best`` beat ``runner`` (plan dicts as ``Plan.to_json()`` gives them).

    Names the configuration difference and the time (or memory) component that moved most.
    ``describe(plan) -> str`` renders a plan's configuration briefly.
    """
    diff = _config_difference(best, runner)
    if objective == "memory":
        delta = runner["memory"]["peak_bytes"] - best["memory"]["peak_bytes"]
        part, saved = max(((k, runner["memory"].get(k, 0) - best["memory"].get(k, 0))
                           for k in ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes")),
                          key=lambda kv: kv[1])
        return (f"{describe(best)} beats {describe(runner)} ({diff}): {delta / 2**30:.2f} GiB less peak memory, "
                f"mostly {part.removesuffix('_bytes')} ({saved / 2**30:.2f} GiB)")
    speedup = best["tokens_per_s"] / runner["tokens_per_s"] - 1 if runner["tokens_per_s"] else 0.0
    deltas = {k: runner["time"].get(k, 0.0) - best["time"].get(k, 0.0) for k in _TIME_PARTS}
    key, saved = max(deltas.items(), key=lambda kv: kv[1])
    if saved <= 0:
        return f"{describe(best)} beats {describe(runner)} ({diff}) by {speedup:.1%} tokens/s at equal time parts; it wins the tie-break (simpler plan)"
    return (f"{describe(best)} beats {describe(runner)} ({diff}) by {speedup:.1%} tokens/s: "
            f"{_TIME_PARTS[key]} ({_seconds(saved)} less per step)")


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


_CONFIG_KEYS = ("dp", "tp", "pp", "ep", "zero_stage", "offload", "micro_batch", "grad_accum", "recompute",
                "sequence_parallel", "virtual_stages", "framework")


def _config_difference(a: dict, b: dict) -> str:
    parts = [f"{k} {a[k]} vs {b[k]}" for k in _CONFIG_KEYS if k in a and k in b and a[k] != b[k]]
    return ", ".join(parts) if parts else "same configuration, different partition"
