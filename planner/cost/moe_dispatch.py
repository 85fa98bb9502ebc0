"""Megatron-Core's MoE token dispatchers, and what the flex one moves between nodes.

``alltoall`` (--moe-token-dispatcher-type alltoall) sends each token's top-k copies to the
ranks holding its experts in one NCCL all-to-all over the EP group. ``allgather`` all-gathers
every rank's tokens (and their routing) over the experts' TP x EP group, each rank permutes out
the copies its local experts take, and a reduce-scatter over the same group brings the outputs
back (token_dispatcher.py, MoEAllGatherTokenDispatcher): G times a token's bytes on the wire for
a group of G against k for the all-to-all, whatever the routing, so it pays where the group is
small beside top-k; Megatron-Core does not overlap it with compute. ``flex`` hands dispatch and
combine to DeepEP (Hopper) or HybridEP (Blackwell, and the only backend for a multi-node NVLink
domain: TransformerConfig.moe_flex_dispatcher_backend). Across nodes both send a token once to
each node that holds one of its experts, over RDMA to the GPU of the same local rank, and forward
it inside the node over NVLink (DeepEP's "NVLink and RDMA forwarding", built for DeepSeek-V3's
node-limited routing: arXiv 2412.19437 sec. 3.2.2). The two legs run pipelined, so a dispatch
costs the slower of an all-to-all over the m nodes (one rank per node, every rank of the node
at once: the NICs are shared) carrying the distinct destination nodes' copies, and an all-to-all
inside the node carrying all k copies. DeepEP's published H800 figures reach the NIC's line rate
on that RDMA leg (43-58 GB/s at EP 16-64 on 50 GB/s CX7: deepseek-ai/DeepEP docs/legacy.md), so
the network efficiency is the one collectives.py uses. Inside one node (or NVLink domain) flex is
priced as the all-to-all. The SMs the flex kernels hold while they run (FLEX_SMS) are taken
from the compute they overlap (comm_overlap.overlapped_ep).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from planner.errors import UserError, arg

if TYPE_CHECKING:  # the CLI reads DISPATCHERS before numpy may load (planner/cli/__init__.py)
    from planner.cost.layer_cost import LayerCost
    from planner.hardware.cluster import Cluster
    from planner.hardware.placement import GroupShape
    from planner.hardware.profile import HardwareProfile

DISPATCHERS = ("alltoall", "allgather", "flex")
DISPATCHER_HELP = ("MoE token dispatcher (framework megatron): alltoall (NCCL all-to-all of every top-k copy), "
                   "allgather (every token to the experts' TP x EP group, reduce-scattered back; no overlap) "
                   "or flex (DeepEP on Hopper, HybridEP on Blackwell: one copy per destination node over the "
                   "network, forwarded over NVLink inside it) [default: alltoall].")


# SMs the flex kernels hold (Megatron-Core's --moe-flex-dispatcher-num-sms, which dsplan writes):
# DeepEP's default of 20 (TransformerConfig.moe_deepep_num_sms, "historical default 20"), and the
# 32 NVIDIA's Megatron-Bridge performance recipes give HybridEP (scripts/performance/utils/
# overrides.py: moe_hybridep_num_sms = 32).
FLEX_SMS = {"deepep": 20, "hybridep": 32}


def flex_backend(profile: HardwareProfile) -> str:
    """HybridEP on Blackwell (NVIDIA's Megatron-Bridge recipes; the only backend across an NVL72
    domain's trays), DeepEP on Hopper."""
    return "hybridep" if "fp4" in profile.gpu.peak_TFLOPs else "deepep"


def flex_sm_share(flex, cluster: Cluster, sms: int):
    """[group, block] share of the GPU's ``sms`` the flex dispatcher's kernels hold (FLEX_SMS) in
    the blocks that dispatch with it (``flex``, a boolean array), 0 elsewhere."""
    import numpy as np

    if not flex.any():
        return np.zeros(flex.shape)
    return np.where(flex, min(1.0, FLEX_SMS[flex_backend(cluster.profile)] / sms), 0.0)


def check_dispatcher(dispatcher: str, profile: HardwareProfile) -> None:
    """One clear error where the GPUs cannot run the flex dispatcher: DeepEP and HybridEP need
    NVIDIA Hopper or newer (sm_90 PTX) with NVLink between the GPUs of a node."""
    if dispatcher != "flex":
        return
    gpu = profile.gpu
    nvlink = profile.node.intra.kind in ("nvswitch", "nvlink_mesh")
    if gpu.vendor != "nvidia" or "fp8" not in gpu.peak_TFLOPs or not nvlink:
        raise UserError(f"{arg('moe_dispatcher')} flex: DeepEP and HybridEP need NVIDIA Hopper or newer GPUs with "
                        f"NVLink inside the node, which {profile.name} ({gpu.name}) does not have; use "
                        f"{arg('moe_dispatcher')} alltoall")


def distinct_nodes(nodes: int, experts: int, top_k: int, groups: int = 1, group_topk: int = 0) -> float:
    """Expected nodes a token's top-k experts fall on, the experts spread evenly over ``nodes``:
    the sum over nodes of the chance that one of the k draws lands there. Uniform routing draws
    k of the e experts, so a node is missed with C(e - e/nodes, k) / C(e, k). Group-limited
    routing (``groups`` expert groups, ``group_topk`` picked per token: DeepSeek-V3's node-limited
    routing, 8 and 4) draws them from the picked groups' experts only, so a node holding j
    picked groups (hypergeometric over the groups) is missed with C(pool - j g, k) / C(pool, k),
    g experts a group, pool = group_topk x g (DeepSeek-V3 on 8 nodes: 3.6 nodes, not 5.3). Where
    neither the groups nor the nodes divide the other, the uniform figure (an upper bound)."""
    if nodes <= 1:
        return 1.0
    k = min(top_k, experts)
    limited = groups > 1 and 0 < group_topk < groups
    if not limited or (groups % nodes and nodes % groups):
        return nodes * (1 - math.comb(experts - experts // nodes, k) / math.comb(experts, k))
    g, pool = experts // groups, group_topk * (experts // groups)
    k = min(k, pool)
    if nodes >= groups:  # a group spans nodes / groups nodes, of which this node holds e / nodes experts
        return nodes * group_topk / groups * (1 - math.comb(pool - experts // nodes, k) / math.comb(pool, k))
    held = groups // nodes  # groups on one node
    hit = sum(math.comb(held, j) * math.comb(groups - held, group_topk - j) / math.comb(groups, group_topk)
              * (1 - math.comb(pool - j * g, k) / math.comb(pool, k)) for j in range(1, min(held, group_topk) + 1))
    return nodes * hit


def tp_ep_shape(cluster: Cluster, ep_shape: GroupShape) -> GroupShape:
    """The experts' TP x EP group the allgather dispatcher spans: the expert-TP ranks innermost,
    the EP group ``ep_shape`` strided over them (cost/layout.py), so et x ep consecutive ranks."""
    from planner.hardware.placement import strided_shape

    return strided_shape(cluster, 1, ep_shape.stride * ep_shape.size, "ep")


@functools.cache
def _single() -> GroupShape:
    """A job with nothing to price (block_times._comm skips groups of one)."""
    from planner.hardware.placement import GroupShape

    return GroupShape(1, 1, 1, 1, 1)


def flex_legs(shape: GroupShape) -> tuple[GroupShape, GroupShape] | None:
    """The RDMA leg (one rank on each of the group's nodes, with every rank of the node running
    its own at once) and the NVLink leg (the group's ranks on one node) of a flex dispatch; None
    where the EP group stays inside one node or NVLink domain."""
    m, r = shape.nodes_spanned, shape.ranks_per_node
    if m <= 1:
        return None
    rail = shape._replace(size=m, stride=shape.stride * r, ranks_per_node=1, groups_per_node=shape.groups_per_node * r)
    node = shape._replace(size=r, nodes_spanned=1, leaf_blocks=1, pods=1) if r > 1 else _single()
    return rail, node


def flex_jobs(group: list[LayerCost], ep_shape: GroupShape) -> list[tuple[GroupShape, list[list[tuple[str, float]]]]]:
    """The two legs of ``group``'s flex dispatches as block_times prices collectives: over the
    network one copy per distinct destination node of each token, inside the node every top-k
    copy; nothing to price where a layer runs the all-to-all or the EP group stays on one node."""
    legs = flex_legs(ep_shape) if any("flex_topk" in c.extra for c in group) else None
    if legs is None:
        return [(_single(), [[] for _ in group]), (_single(), [[] for _ in group])]

    def net_bytes(c: LayerCost) -> float:
        x = c.extra
        nodes = distinct_nodes(ep_shape.nodes_spanned, int(x["flex_experts"]), int(x["flex_topk"]),
                               int(x["flex_groups"]), int(x["flex_group_topk"]))
        return c.ep_a2a * nodes / x["flex_topk"]

    flex = [bool(c.ep_a2a_count) and "flex_topk" in c.extra for c in group]
    return [(legs[0], [[("alltoall", net_bytes(c))] if f else [] for c, f in zip(group, flex)]),
            (legs[1], [[("alltoall", c.ep_a2a)] if f else [] for c, f in zip(group, flex)])]
