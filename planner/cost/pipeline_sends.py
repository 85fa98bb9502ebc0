"""How each runtime sends activations and gradients across pipeline-stage boundaries: the share
of a boundary tensor one rank sends, the transfers per micro-batch, DeepSpeed's meta tensors and
the TP all-gathers around a partitioned boundary (frameworks.Traits.pp_send; rank_tables.py
prices them)."""

from __future__ import annotations

from planner.cost.frameworks import Traits

# Megatron-LM as of Narayanan et al. 2021 (the "scatter/gather" of sec. 4.1): 1/t sent, one
# all-gather on each receiving side. Not a runtime dsplan plans for (Megatron-Core dropped it);
# benchmarks/bench_megatron_table1.py models the paper's runs with it.
PP_SENDS = ("full", "sequence_parallel", "partitioned", "scatter_gather")


def pp_send_divisor(send: str, tp: int, sequence_parallel: bool) -> int:
    """The share of a stage boundary's activation one rank sends (1/returned) under the
    pipeline-send behaviour ``send`` (Traits.pp_send)."""
    if tp > 1 and (send in ("partitioned", "scatter_gather") or (send == "sequence_parallel" and sequence_parallel)):
        return tp
    return 1


def pp_transfers(t: Traits) -> int:
    """Transfers per neighbour and micro-batch on each side of a stage boundary: 1 where the
    activation and the gradient crossing it travel as one batched exchange on a full-duplex
    link (Megatron), 2 where they are two blocking transfers in turn (Traits.pipe_engine)."""
    return 2 if t.pipe_engine else 1


def pp_meta_bytes(send: str, tp: int) -> float:
    """Bytes of the meta tensor DeepSpeed sends before each partitioned activation or gradient
    (runtime/utils.py PartitionedTensor.to_meta: int64 [ndims, s, b, h, parts, rank, the
    parts + 1 offsets]), 0 where nothing is partitioned."""
    return 8.0 * (7 + tp) if (send == "partitioned" and tp > 1) else 0.0


def pp_boundary_gathers(send: str, tp: int) -> tuple[int, int]:
    """All-gathers of a whole boundary tensor over the TP group, per micro-batch: (on the
    sending side of a boundary, on the receiving side). See Traits.pp_send."""
    if tp <= 1:
        return (0, 0)
    return {"partitioned": (2, 1), "scatter_gather": (1, 1)}.get(send, (0, 0))
