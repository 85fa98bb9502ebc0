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

import math

import numpy as np

from planner.cost import efficiency as eff
from planner.cost import frameworks as fw
from planner.cost.collectives import collective_time_array
from planner.cost.context import CostContext
from planner.cost.layer_cost import LayerCost
from planner.cost.layout import Layout
from planner.cost.parallel import FRAMEWORKS
from planner.cost.precision import gathers_fp8_params
from planner.cost.runtime_copies import flat_copy_seconds, fresh_buffer_seconds
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, strided_shape

# ZeRO++ (Wang et al. 2023, arXiv:2306.10209) as DeepSpeed 0.19 runs it:
# qwZ gathers int8 weights with an fp32 scale per group of ~8K elements
# (partition_parameters.py CUDAQuantizer.target_group_size) and dequantizes them on arrival;
QWZ_BYTES = 1.0 + 4.0 / 8000
# each (de)quantize pass reads the 16-bit tensor and writes the 8- or 4-bit one, or back: ~3 bytes
# of HBM traffic per element of the gathered weights or of the gradients it quantizes.
QUANT_HBM_BYTES = 3.0
QGZ_BYTES = 0.5  # qgZ: int4 gradients (coalesced_collectives.py all_to_all_quant_reduce)

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


def tensor_count(cost: LayerCost) -> float:
    """The block's fetched (not resident) weight tensors: qgZ's all-to-alls go one tensor at a time."""
    keep = fw.stage3_persistence_threshold(cost.hidden)
    return float(sum(1 for n in weight_tensors(cost) if n >= keep))


def node_ranks(gpus_per_node: int, dp: int) -> int:
    """Consecutive DP ranks inside one node: hpZ's secondary partition group (ZeRO++'s advice, one
    node) and qgZ's first all-to-all (DeepSpeed takes the accelerator's device count)."""
    return math.gcd(dp, gpus_per_node)


def secondary_bytes(cluster: Cluster, dp: np.ndarray, params: np.ndarray) -> np.ndarray:
    """hpZ's secondary partition: 16-bit weights split over the node's DP ranks only, held beside
    the primary shard ([candidate x rank]; ``dp``: the candidates' sharding group sizes)."""
    ranks = np.gcd(dp, cluster.gpus_per_node)[:, None].astype(float)
    return 2.0 * params / ranks


def block_seconds(ctx: CostContext, layout: Layout, dp: int, edp: int, framework: int, params: np.ndarray,
                  expert: np.ndarray, low: np.ndarray, fetch: np.ndarray, tensors: np.ndarray) -> dict[str, np.ndarray]:
    """Per block, ZeRO-3's seconds of the step's first forward gather (``first``), of every
    other gather (``rest``: the backward's, and the later micro-batches' forward), of the
    gradient reduction (``reduce``), with the workload's ZeRO++ where the runtime is DeepSpeed,
    and the host time of DeepSpeed's fetch hooks per micro-batch (``host``).
    ``params``, ``expert``: elements; ``low``: the recipe's low-precision GEMM weights;
    ``fetch``: fetch_calls and ``tensors``: tensor_count per block."""
    cluster, w, name = ctx.cluster, ctx.workload, FRAMEWORKS[framework]
    module = fw.traits(name).zero3_module_fetch
    zpp = set(w.zero_pp) if module else set()
    gbytes = ctx.grad_bytes(framework, zero=3)
    fetches, grads = call_counts(params, expert, fetch, module)

    def on(op: str, d: np.ndarray, e: np.ndarray, calls: Calls) -> np.ndarray:
        t = seconds_over_calls(cluster, op, layout.dp, d, calls[0]) if dp > 1 else np.zeros_like(d)
        if edp > 1:
            t = t + np.where(e > 0, seconds_over_calls(cluster, op, layout.edp, e, calls[1]), 0.0)
        return t

    # Weights are gathered in the working precision (fp32 runs gather fp32); FP8 parameter gather
    # moves its GEMM weights at 1 byte (an MoE block's at 2: the table does not say which of its
    # low-precision weights are experts', as step_time.dp_collectives).
    fp8 = gathers_fp8_params(w.recipe, w.fp8_param_gather, name, 3)
    wbytes = w.bytes_per_param
    if "qwz" in zpp:
        first = on("allgather", QWZ_BYTES * params, QWZ_BYTES * expert, fetches)
        first = first + eff.hbm_time(QUANT_HBM_BYTES * (params + expert), ctx.dev)
    else:
        first = on("allgather", wbytes * params - (np.where(expert == 0, (wbytes - 1) * low, 0.0) if fp8 else 0.0),
                   wbytes * expert, fetches)
    rest = first
    if "hpz" in zpp:  # DeepSpeed's secondary tensor is in the weights' dtype (partition_parameters.py)
        group = strided_shape(cluster, 1, node_ranks(cluster.gpus_per_node, dp))
        rest = seconds_over_calls(cluster, "allgather", group, wbytes * (params + expert), fetches[0])
    reduce = on("reducescatter", gbytes * params, gbytes * expert, grads)
    if "qgz" in zpp:
        reduce = np.where(tensors > 0, qgz_seconds(ctx, dp, params + expert, tensors), reduce)
    if fw.traits(name).flat_copies:  # DeepSpeed gathers into new storage and flattens what it reduces
        touched = fresh_buffer_seconds(ctx.dev, wbytes * (params + expert))
        first, rest = first + touched, rest + touched
        reduce = reduce + flat_copy_seconds(ctx.dev, gbytes * (params + expert))
    host = tensors * fw.ZERO3_HOST_S_PER_MODULE if module else np.zeros_like(params)
    return {"first": first, "rest": rest, "reduce": reduce, "host": host}


def qgz_seconds(ctx: CostContext, dp: int, params: np.ndarray, tensors: np.ndarray) -> np.ndarray:
    """qgZ per block: each weight tensor's gradient quantized to int4, all-to-all inside the node
    (its whole tensor), reduced there, all-to-all across the nodes (1/r of it), each with its
    scales, then dequantized (coalesced_collectives.py all_to_all_quant_reduce)."""
    cluster = ctx.cluster
    r = node_ranks(cluster.gpus_per_node, dp)
    m = dp // r
    each = np.divide(params, tensors, out=np.zeros_like(params), where=tensors > 0)
    scales = 4.0 * each / 8000

    def a2a(shape: GroupShape, size: np.ndarray) -> np.ndarray:
        return collective_time_array(cluster, "alltoall", shape, size) if shape.size > 1 else np.zeros_like(size)

    inner, outer = strided_shape(cluster, 1, r), strided_shape(cluster, r, m)
    per_tensor = (a2a(inner, QGZ_BYTES * each) + a2a(inner, scales)
                  + a2a(outer, QGZ_BYTES * each / r) + a2a(outer, scales / r))
    return tensors * per_tensor + eff.hbm_time(QUANT_HBM_BYTES * params, ctx.dev)


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


# -- what a ZeRO-3 rank holds gathered ---------------------------------------------------------

_LIVE_BLOCKS = np.array([fw.traits(f).zero3_live_blocks for f in FRAMEWORKS], dtype=float)
_KEEPS_STAGE = np.array([fw.traits(f).fsdp_pp_keeps_stage_gathered for f in FRAMEWORKS])


def live_blocks(col: dict[str, np.ndarray]) -> np.ndarray:
    """Per candidate, the gathered blocks a ZeRO-3 rank holds whole (frameworks.Traits.zero3_live_blocks)."""
    return _LIVE_BLOCKS[col["framework"]]


def keeps_stage_gathered(col: dict[str, np.ndarray]) -> np.ndarray:
    """Per candidate, whether its ZeRO-3 runtime keeps the stage's weights gathered and its
    gradients unsharded over the step (frameworks.Traits.fsdp_pp_keeps_stage_gathered, pp > 1)."""
    return _KEEPS_STAGE[col["framework"]] & (col["pp"] > 1)
