"""Memory and step time of candidates from their rank tables: the last step of the cost model.

Per candidate and pipeline rank ([candidate x rank] arrays, rank_tables.py): model states
under ZeRO / offload, activations of the in-flight micro-batches, buffers and allowances
(memory.py); then the pipeline, exposed data-parallel traffic and the optimizer step
(step_time.py). Row by row: a candidate's numbers do not depend on which others are assembled
with it, so ``estimate`` (one candidate) and the search (thousands) get the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost import activation_offload as aoff
from planner.cost import dualpipe
from planner.cost import memory as mem
from planner.cost import step_time as st
from planner.cost.candidates import shard_ranks
from planner.cost.context import CostContext
from planner.cost.frameworks import traits
from planner.cost.paid import ep_overlapped
from planner.cost.parallel import FRAMEWORKS, RECOMPUTES
from planner.cost.precision import RECIPES
from planner.cost.zero3_fetch import secondary_bytes

_EP_OVERLAP = np.array([traits(f).ep_comm_overlap for f in FRAMEWORKS])
_MEGATRON = FRAMEWORKS.index("megatron")
_MODULE_FETCH = np.array([traits(f).zero3_module_fetch for f in FRAMEWORKS])


@dataclass(frozen=True)
class Assembly:
    """Per candidate (``step_time``, ``peak_bytes``, ``cpu_bytes``, ``worst``, ``bubble``) or per
    candidate and rank (the rest) of one ``assemble`` call."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    buffers: np.ndarray
    overhead: np.ndarray
    cpu_per_node: np.ndarray  # host bytes of each rank's node, had every rank its offload
    inflight: np.ndarray
    dp: np.ndarray  # exposed data-parallel seconds
    opt: np.ndarray  # optimizer seconds
    worst: np.ndarray  # the slowest rank
    bubble: np.ndarray
    step_time: np.ndarray
    peak_bytes: np.ndarray  # the fullest rank's
    cpu_bytes: np.ndarray  # host bytes per node of the rank offloading the most (what must fit)
    act_offload: np.ndarray  # decoder layers whose activations go to host memory (the search's choice where AUTO)
    act_offload_s: np.ndarray  # seconds per step their copies leave exposed


def assemble(ctx: CostContext, col: dict[str, np.ndarray], r: dict[str, np.ndarray], pp: int) -> Assembly:
    """Memory and step time of candidates ``col`` whose rank tables ``r`` are ``pp`` wide.

    Candidates of several pipeline depths go together (one pass, not one per depth): a table
    shallower than ``pp`` is padded with zeros past its last rank. Padded ranks hold nothing,
    so their time, DP, optimizer and host parts are zero and never pass a real rank's (all
    non-negative); their peak (context and NCCL buffers) is masked out, and the bubble sums
    each depth's ranks alone, as a table of that depth would."""
    w, gpus_per_node = ctx.workload, ctx.cluster.gpus_per_node
    vs = col["vs"].astype(float)
    m = col["grad_accum"][:, None].astype(float)
    weights, grads, opt, cpu = mem.state_bytes(col, r["dense"], r["expert"], r["largest"], w.precision,
                                               w.optimizer_moments, **w.state_dtypes)
    if w.recipe is not None:
        weights = weights + _recipe_weights(ctx, col, r)
    if "hpz" in w.zero_pp:  # ZeRO++ on DeepSpeed's ZeRO-3 (the rules keep the others out)
        hpz = (col["zero"] == 3) & _MODULE_FETCH[col["framework"]]
        weights = weights + np.where(hpz[:, None], secondary_bytes(ctx.cluster, shard_ranks(col), r["dense"]), 0.0)
    inflight = _inflight(ctx, col, pp, r)
    acts = mem.activation_bytes(r["stored"], r["live"], inflight)
    buffers = mem.buffer_bytes(col["framework"][:, None], col["zero"][:, None], r["dense"] + r["expert"],
                               mem.process_groups(col)[:, None], r["ppbuf"])
    allocated = weights + grads + opt + acts + buffers
    profile = ctx.cluster.profile
    layer = r["dec_act"][:, 0] / np.maximum(r["dec_n"][:, 0], 1.0)  # one decoder layer's, on rank 0 (pp 1)
    k = np.where(col["aoff"] == aoff.AUTO,
                 aoff.layers_to_fit(mem.peak_bytes(allocated[:, 0]), profile.gpu.memory_bytes, layer, r["dec_n"][:, 0]),
                 np.maximum(col["aoff"], 0))
    if k.any():  # Megatron-Core offloads without a pipeline only: the candidate's one rank
        moved = np.zeros_like(acts)
        moved[:, 0] = k * layer
        acts, cpu, allocated = acts - moved, cpu + moved, allocated - moved
    peak = mem.peak_bytes(allocated)
    cpu_node = mem.cpu_bytes_per_node(cpu, gpus_per_node)

    total = r["fwd"] + r["bwd"] + r["rc"] + r["tp"] + r["ep"] + r["pp"] + r["cp"]
    worst, bubble = st.pipeline(total, col["pp"], vs)
    if w.pp_schedule == "dualpipev":
        comm = (r["tp"] + r["ep"] + r["pp"] + r["cp"]) / 2.0
        v = dualpipe.bubble(r["fwd"] + comm, r["bwd"] + r["rc"] + comm, r["wg"], worst, col["pp"])
        bubble = np.where(col["pp"] > 1, v, bubble)
    body = m[:, 0] * total[np.arange(len(total)), worst]
    dp_t = st.dp_exposed(col, r, *st.dp_collectives(ctx, col, r), profile.calibration.overlap,
                         profile.gpu.vendor == "cpu")
    opt_t = st.optimizer_seconds(ctx, col, r["dense"], r["expert"], m)
    off_t = m[:, 0] * aoff.exposed_seconds(k, r["dec_n"][:, 0], layer, r["fwd"][:, 0], r["bwd"][:, 0],
                                           profile.node.host_Bps)
    step = body + bubble + dp_t.max(axis=1) + opt_t.max(axis=1) + off_t
    if len(st.depths(col["pp"], pp)) > 1:  # padded ranks: context and NCCL buffers only, never a candidate's peak
        peak = np.where(np.arange(pp)[None, :] < col["pp"][:, None], peak, -np.inf)
    return Assembly(weights, grads, opt, acts, buffers, mem.overhead_bytes(allocated), cpu_node, inflight, dp_t, opt_t,
                    worst, bubble, step, peak.max(axis=1), cpu_node.max(axis=1), k, off_t)


def _recipe_weights(ctx: CostContext, col: dict[str, np.ndarray], r: dict[str, np.ndarray]) -> np.ndarray:
    """Bytes a TE recipe adds to each rank's weights ([candidate x rank]). A rank holding its
    whole stage caches both quantized layouts of every GEMM weight across the step's
    micro-batches; Megatron-FSDP (ZeRO-3) quantizes each gathered unit and frees the copies with
    it (--keep-fp8-transpose-cache off), so only its live blocks' exist (torchao under FSDP2
    alike). Under FP8 parameter gather the FP8 copies are the weights: no 16-bit copy (whole
    stage), or FP8 gathered units instead of 16-bit ones (FSDP), and on Megatron-FSDP a 1-byte
    shard for the 16-bit one (torchtitan keeps its fp32 shard and casts it for the gather)."""
    w = ctx.workload
    cache = RECIPES[w.recipe].weight_cache_bytes
    fp8 = st.fp8_param_gather(ctx, col)
    live = mem.live_blocks(col)[:, None] * r["largest"]
    whole = cache * r["low"] - np.where(fp8, w.bytes_per_param * r["low"], 0.0)
    shard = shard_ranks(col)[:, None].astype(float)
    fp8_shard = np.where((col["framework"] == _MEGATRON)[:, None], (w.bytes_per_param - 1) * r["low"] / shard, 0.0)
    sharded = cache * live - np.where(fp8, fp8_shard + w.bytes_per_param * live, 0.0)
    return np.where((col["zero"] == 3)[:, None], sharded, whole)


def _inflight(ctx: CostContext, col: dict[str, np.ndarray], pp: int, r: dict[str, np.ndarray]) -> np.ndarray:
    """Micro-batches of activations each rank holds at its peak (memory.inflight_array; DualPipeV's
    from its two chunks' stored bytes, dualpipe.inflight). Without a pipeline, one; two where the
    expert all-to-alls overlap (paid.ep_overlapped), since the next micro-batch's forward runs
    before this one's backward has freed its activations."""
    merged = (ep_overlapped(_EP_OVERLAP[col["framework"]], col["ep"], col["pp"], col["vs"],
                            ctx.workload.ep_comm_overlap)
              & (col["grad_accum"] > 1) & (col["recompute"] != RECOMPUTES.index("full")))
    if pp == 1:
        return np.where(merged, 2.0, 1.0)[:, None]
    found = st.depths(col["pp"], pp)
    depth = pp if len(found) == 1 else col["pp"][:, None]
    rank = np.arange(pp)[None, :].astype(float)
    inflight = mem.inflight_array(rank, depth, col["vs"][:, None].astype(float),
                                  col["grad_accum"][:, None].astype(float),
                                  mem.microbatch_groups(col["pp"], col["grad_accum"])[:, None])
    if ctx.workload.pp_schedule == "dualpipev":
        inflight = np.where(col["pp"][:, None] > 1, dualpipe.inflight(rank, depth, r["stored"], r["stored_v"]),
                            inflight)
    if 1 in found:
        inflight = np.where(col["pp"][:, None] == 1, np.where(merged, 2.0, 1.0)[:, None], inflight)
    return inflight
