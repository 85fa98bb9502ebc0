"""How a plan's runtime pays its blocks: what Megatron-Core with Transformer Engine does that the
other runtimes do not (frameworks.Traits.tp_comm_overlap, Traits.te_attention), as the workload
allows (Workload.tp_comm_overlap, Workload.te_attention). Block tables price both ways; a rank
table, a pipeline split and a bound pick the way of their plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from planner.cost.frameworks import traits

if TYPE_CHECKING:
    from planner.cost.context import CostContext


def tp_overlapped(framework: str, sp: bool, tp: int, tp_in_node: bool, allowed: bool) -> bool:
    """Whether a plan's TP collectives overlap its GEMMs (Traits.tp_comm_overlap): the runtime
    can, the workload allows it, and TE's userbuffers apply (sequence parallelism, TP > 1
    inside one node)."""
    return allowed and traits(framework).tp_comm_overlap and sp and tp > 1 and tp_in_node


class Paid(NamedTuple):
    """How a plan's runtime pays its blocks: TP overlapped with the GEMMs, TE's attention."""

    overlap: bool = False
    te: bool = False


def paid(ctx: "CostContext", framework: str, sp: bool, tp: int, ep: int, dp: int, pp: int) -> Paid:
    """What ``framework`` does with the blocks of a plan of these degrees on ``ctx``'s cluster, as
    its workload allows (Workload.tp_comm_overlap, Workload.te_attention)."""
    w = ctx.workload
    in_node = ctx.layout(tp, ep, dp, pp).tp.nodes_spanned == 1
    return Paid(tp_overlapped(framework, sp, tp, in_node, w.tp_comm_overlap),
                w.te_attention and traits(framework).te_attention)
