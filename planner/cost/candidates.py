"""Candidates as columns: the form every array formula of the cost model reads.

A set of parallel configurations is a dict of equal-length int arrays, one per field of
``COLUMNS`` (offload, recompute and framework as indices into the tuples of parallel.py; ``aoff``
the layers whose activations are offloaded, or activation_offload.AUTO where the search decides).
``estimate`` prices one configuration as a set of one; the search prices thousands.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from planner.cost.parallel import CP_COMMS, FRAMEWORKS, OFFLOADS, RECOMPUTES, ParallelConfig, expert_replicas

COLUMNS = ("dp", "tp", "pp", "ep", "vs", "zero", "offload", "recompute", "sp", "framework", "micro_batch", "grad_accum",
           "cp", "cp_comm", "rep", "etp", "aoff")

Columns = dict[str, np.ndarray]


def columns_of(configs: Iterable[ParallelConfig]) -> Columns:
    """The columns of ``configs``, in order."""
    rows = [(c.dp, c.tp, c.pp, c.ep, c.virtual_stages, c.zero_stage, OFFLOADS.index(c.offload),
             RECOMPUTES.index(c.recompute), int(c.sequence_parallel), FRAMEWORKS.index(c.framework), c.micro_batch,
             c.grad_accum, c.cp, CP_COMMS.index(c.cp_comm), c.dp_replicate, c.expert_tp, c.activation_offload)
            for c in configs]
    table = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    return {name: table[:, k].copy() for k, name in enumerate(COLUMNS)}


def config_of(row: dict[str, int]) -> ParallelConfig:
    """One row of columns (index codes) as a ParallelConfig."""
    return ParallelConfig(
        dp=row["dp"], tp=row["tp"], pp=row["pp"], ep=row["ep"], zero_stage=row["zero"],  # type: ignore[arg-type]
        offload=OFFLOADS[row["offload"]], micro_batch=row["micro_batch"], grad_accum=row["grad_accum"],  # type: ignore[arg-type]
        recompute=RECOMPUTES[row["recompute"]], sequence_parallel=bool(row["sp"]),  # type: ignore[arg-type]
        virtual_stages=row["vs"], framework=FRAMEWORKS[row["framework"]],  # type: ignore[arg-type]
        cp=row.get("cp", 1), cp_comm=CP_COMMS[row.get("cp_comm", 0)],  # type: ignore[arg-type]
        dp_replicate=row.get("rep", 1), etp=row.get("etp"),
        activation_offload=max(row.get("aoff", 0), 0),  # the search's AUTO (-1) is resolved when assembled
    )


def dp_ranks(columns: Columns) -> np.ndarray:
    """Per candidate, the ranks a dense gradient is reduced and ZeRO-sharded over: dp x cp
    (ParallelConfig.dp_ranks)."""
    return columns["dp"] * columns["cp"]


def shard_ranks(columns: Columns) -> np.ndarray:
    """Per candidate, the ranks ZeRO shards over: one hybrid-sharding group of the dp x cp ranks
    (ParallelConfig.dp_shard)."""
    return dp_ranks(columns) // columns["rep"]


def expert_ranks(columns: Columns) -> np.ndarray:
    """Per candidate, the replicas of each routed expert (parallel.expert_replicas)."""
    return expert_replicas(dp_ranks(columns), columns["tp"], columns["ep"], columns["etp"])


def expert_shard_ranks(columns: Columns) -> np.ndarray:
    """Per candidate, the ranks ZeRO shards a routed expert over: its replicas within one
    hybrid-sharding group."""
    return expert_ranks(columns) // columns["rep"]


def config_at(columns: Columns, i: int) -> ParallelConfig:
    """Candidate ``i`` of ``columns`` as a ParallelConfig."""
    return config_of({k: int(v[i]) for k, v in columns.items()})


def take(columns: Columns, rows: np.ndarray) -> Columns:
    """The candidates ``rows`` of ``columns``."""
    return {k: v[rows] for k, v in columns.items()}
