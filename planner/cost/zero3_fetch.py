"""How many collectives DeepSpeed's ZeRO-3 issues per block: what sets its latency at scale.

Bandwidth alone says ZeRO-3 hides its traffic on a fast network; what stops it at hundreds of
ranks is the number of calls, each paying a ring's latency, which grows with the ranks
(nccl_algorithms._ring_latency). DeepSpeed's PartitionedParameterCoordinator
(deepspeed/runtime/zero/partitioned_param_coordinator.py, fetch_sub_module) gathers a module's
parameters as it is about to run and prefetches the next ones of the recorded trace, one
coalesced all-gather per prefetch, until ``stage3_prefetch_bucket_size`` elements are on the
way; a parameter is never split. So a tensor at least a bucket large is a call of its own,
smaller ones share calls a bucket's worth at a time, and tensors under
``stage3_param_persistence_threshold`` stay gathered and cost no call at all. Gradients go out
in one reduce-scatter per ``reduce_bucket_size`` elements (stage3.py,
__reduce_and_partition_ipg_grads). FSDP2 and Megatron-FSDP gather and reduce one wrapped unit
(a block) per call instead (Traits.zero3_module_fetch).
"""

from __future__ import annotations

import numpy as np

from planner.cost import frameworks as fw
from planner.cost.collectives import collective_time_array
from planner.cost.layer_cost import LayerCost
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape

Calls = tuple[np.ndarray, np.ndarray]  # per block: over the DP group (dense), over the expert-DP group


def weight_tensors(cost: LayerCost) -> list[float]:
    """Elements of the parameter tensors of the block one rank holds (after TP) that may be
    fetched: every GEMM's weight in its separate tensors, once per local expert; in a block
    without GEMMs (embeddings) its table. What else a block with GEMMs holds are its norms and
    biases, each a few times the hidden size at most: under the persistence threshold."""
    out = [g.n * g.k * share for g in cost.gemms for share in g.split for _ in range(g.batch)]
    rest = cost.params_rank + cost.expert_params_rank
    return out if out else ([rest] if rest > 0 else [])


def fetch_calls(cost: LayerCost) -> float:
    """All-gathers DeepSpeed issues to fetch the block once (fractional: blocks whose small
    tensors share a prefetch bucket share its call)."""
    bucket, keep = fw.STAGE3_PREFETCH_BUCKET_SIZE, fw.stage3_persistence_threshold(cost.hidden)
    sizes = weight_tensors(cost)
    return sum(1.0 if n >= bucket else n / bucket for n in sizes if n >= keep)


def call_counts(params: np.ndarray, expert: np.ndarray, fetch: np.ndarray, module_fetch: bool) -> tuple[Calls, Calls]:
    """Per block, the all-gathers and the reduce-scatters of its dense and expert parameters
    (elements ``params``, ``expert``; ``fetch``: fetch_calls per block): DeepSpeed's, or one
    each per wrapped block."""
    if not module_fetch:
        one = np.ones_like(params)
        return (one, one), (one, one)
    return (fetch, fetch), (params / fw.REDUCE_BUCKET_SIZE, expert / fw.REDUCE_BUCKET_SIZE)


def seconds_over_calls(cluster: Cluster, op: str, shape: GroupShape, size: np.ndarray,
                       calls: np.ndarray) -> np.ndarray:
    """Seconds of moving ``size`` bytes per block in ``calls`` equal collectives (none where the
    block makes no call: its tensors stay resident)."""
    each = np.divide(size, calls, out=np.zeros_like(size), where=calls > 0)
    return calls * collective_time_array(cluster, op, shape, each)
