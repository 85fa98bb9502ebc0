"""How a plan's runtime pays its blocks: what Megatron-Core with Transformer Engine does that the
other runtimes do not (frameworks.Traits.tp_comm_overlap, .te_attention, .ep_comm_overlap), as the
workload allows (Workload.tp_comm_overlap, .te_attention, .ep_comm_overlap). Block tables price both ways; a rank
table, a pipeline split and a bound pick the way of their plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from planner.cost.frameworks import traits

if TYPE_CHECKING:
    from planner.cost.context import CostContext


def tp_overlapped(framework: str, sp: bool, tp: int, tp_in_node: bool, allowed: bool) -> bool:
    """Whether a plan's TP collectives overlap its GEMMs (Traits.tp_comm_overlap): the runtime
    can, the workload allows it, and TE's userbuffers apply (sequence parallelism, TP > 1
    inside one node)."""
    return allowed and traits(framework).tp_comm_overlap and sp and tp > 1 and tp_in_node


def ep_overlapped(can: "bool | np.ndarray", ep, pp, vs, allowed: bool, dualpipe: "bool | np.ndarray" = False):
    """Whether plans' expert all-to-alls overlap the other micro-batch's compute (scalars or
    arrays): the runtime can (Traits.ep_comm_overlap), the workload allows it, there is expert
    parallelism, and a pipeline is interleaved (Megatron-Core asserts virtual stages when
    pp > 1, transformer_config.py); or DualPipeV runs a pipeline (``dualpipe``: the runtime has it,
    Traits.dualpipe, and the workload's schedule is it). Full recomputation, which Megatron
    refuses with it (torchtitan with any checkpointing), is priced without it
    (comm_overlap.overlapped_ep)."""
    return allowed & (ep > 1) & ((can & ((pp == 1) | (vs > 1))) | (dualpipe & (pp > 1)))


def runs_ep_overlap(framework: str, ep: int, pp: int, vs: int, recompute: str, allowed: bool) -> bool:
    """Whether a plan's run directory turns the expert all-to-all overlap on: where it was priced
    (``ep_overlapped``) and Megatron accepts it (no full recomputation)."""
    return bool(ep_overlapped(traits(framework).ep_comm_overlap, ep, pp, vs, allowed)) and recompute != "full"


def merged_share(rank: np.ndarray, pp: np.ndarray, vs: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The share of a pipeline rank's passes that Megatron-Core's combined 1F1B runs merged (a
    forward beside a backward, so their all-to-alls overlap): without a pipeline all but the
    first forward and the last backward, (m - 1) / m; in an interleaved pipeline all but the
    warm-up forwards and their cool-down backwards, (pp - rank - 1) x 2 + (vs - 1) x pp of the
    rank's m x vs chunk passes (schedules.py, forward_backward_pipelining_with_interleaving)."""
    warm = np.where(pp == 1, 1.0, np.minimum((pp - rank - 1) * 2 + (vs - 1) * pp, m * vs))
    return np.maximum(1.0 - warm / (m * vs), 0.0)


class Paid(NamedTuple):
    """How a plan's runtime pays its blocks: TP overlapped with the GEMMs, TE's attention, the
    expert all-to-alls overlapped with the other micro-batch, the backward's TP reductions under
    the weight-gradient GEMMs (where the GEMM overlap does not apply)."""

    overlap: bool = False
    te: bool = False
    ep_overlap: bool = False
    tp_async: bool = False


def paid(ctx: "CostContext", framework: str, sp: bool, tp: int, ep: int, dp: int, pp: int, vs: int = 1) -> Paid:
    """What ``framework`` does with the blocks of a plan of these degrees on ``ctx``'s cluster, as
    its workload allows (Workload.tp_comm_overlap, .te_attention, .ep_comm_overlap)."""
    w = ctx.workload
    in_node = ctx.layout(tp, 1, dp, pp).tp.nodes_spanned == 1
    overlap = tp_overlapped(framework, sp, tp, in_node, w.tp_comm_overlap)
    return Paid(overlap, w.te_attention and traits(framework).te_attention,
                bool(ep_overlapped(traits(framework).ep_comm_overlap, ep, pp, vs, w.ep_comm_overlap,
                                   traits(framework).dualpipe and w.pp_schedule == "dualpipev")),
                not overlap and tp > 1 and traits(framework).tp_backward_overlap)
