"""Memory per GPU: model states (ZeRO 0-3, offload, EP), activations, buffers, allowances.

Model states, bytes per parameter a GPU holds after TP/PP/EP (N = the ranks it is sharded over:
dp for dense parameters, dp/ep for routed experts), mixed precision with fp32 master weights and
Adam (K = 12: master, momentum, variance; Rajbhandari et al. SC20, reference/
zero_memory_formulas.csv):

=====================  =========  ===========================  ===============
runtime / stage        weights    gradients                    optimizer
=====================  =========  ===========================  ===============
DeepSpeed ZeRO-0       2          2                            12
DeepSpeed ZeRO-1       2          2 + 4/N (fp32 partition)     12/N
DeepSpeed ZeRO-2       2          (2 + 4)/N                    12/N
DeepSpeed ZeRO-3       2/N        4/N                          12/N
Megatron, bf16         2          4 (fp32 main_grad)           12   (12/N distributed optimizer)
Megatron, fp16         2          2                            16   (16/N: fp32 grad copy too)
=====================  =========  ===========================  ===============

ZeRO-2 and ZeRO-3 reproduce DeepSpeed 0.19's own estimators exactly (``estimate_zero2_model_
states_mem_needs``: 2P + 18P/N; ``estimate_zero3_model_states_mem_needs``: 18P/N + 4 x the
largest layer, the gathered 16-bit weights and gradients of the layer being computed); the
Megatron rows are its distributed-optimizer documentation (18 and 6 + 12/d bytes for bf16).
Offload moves the optimizer (and fp32 gradient partition) or, with ZeRO-3, the parameters too,
to pinned CPU memory, which DeepSpeed sizes with an additional_buffer_factor of 1.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost import frameworks as fw
from planner.cost.candidates import expert_shard_ranks, shard_ranks
from planner.cost.parallel import FRAMEWORKS, OFFLOADS
from planner.cost.zero3_fetch import keeps_stage_gathered, live_blocks

GiB = 2**30
# Allowances (documented estimates, not calibrated): the CUDA context with cuBLAS/cuDNN
# workspaces (PyTorch on A100/H100: 0.5-0.9 GiB), NCCL's per-communicator buffers
# (NCCL_BUFFSIZE 4 MiB x channels x peers, ~0.25 GiB per process group with tens of
# channels on NVSwitch), and the caching allocator's fragmentation (reserved minus allocated,
# typically 5-10% in long training runs).
CUDA_CONTEXT_BYTES = 1.0 * GiB
NCCL_BYTES_PER_GROUP = 0.25 * GiB
FRAGMENTATION = 0.05
CPU_BUFFER_FACTOR = 1.5  # DeepSpeed estimators' additional_buffer_factor (pinned staging buffers)


@dataclass(frozen=True, slots=True)
class ModelStates:
    weights: float
    grads: float
    optimizer: float
    cpu: float  # bytes this GPU keeps in host memory (before the CPU buffer factor)

    @property
    def gpu(self) -> float:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one GPU at its peak (the end of the warm-up of 1F1B, mid-backward)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    overhead: float  # CUDA context + fragmentation
    cpu_per_node: float = 0.0

    @property
    def peak(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.overhead


# -- published formulas ------------------------------------------------------------------


def zero_paper_bytes(psi: float, nd: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per GPU, Rajbhandari et al. SC20 Fig. 1 (fp16 params and grads, K)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    if stage == 3:
        return (2 + 2 + k) * psi / nd
    raise ValueError(f"ZeRO stage {stage}")


def zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                 cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) as DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (0.19).

    GPU: 2 (16-bit params) + 18/N (16-bit and fp32 gradient partitions, fp32 params, Adam
    moments); with offload only the 16-bit params stay. CPU: the fp32 copy each process builds
    at init (4 x GPUs per node), or with offload max(4 x total GPUs, 16) per parameter, times the
    buffer factor.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                 num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                 zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_bytes) as DeepSpeed's ``estimate_zero3_model_states_mem_needs``."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params  # gathered 16-bit weights + gradients of one layer
    if cpu_offload:
        per = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / total_gpus)
        if zero_init:
            cpu = total_params * per * gpus_factor * additional_buffer_factor
        else:
            cpu = total_params * max(4 * num_gpus_per_node, per * gpus_factor) * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        if zero_init:
            cpu = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


# -- the planner's model ----------------------------------------------------------------


def bytes_per_param(framework: str, zero: int, offload: str, n: int, precision: str = "bf16",
                    moments: int = 2, moment_bytes: int = 4,
                    master_bytes: int = 4) -> tuple[float, float, float, float]:
    """(weights, grads, optimizer, cpu) bytes per parameter held by a GPU, sharded over ``n``.
    ``moment_bytes`` and ``master_bytes`` are Workload.state_dtypes: 2 each under Megatron-Core's
    precision-aware optimizer (bf16 moments, 16-bit master remainders)."""
    work = 4 if precision == "fp32" else 2
    master = 0 if precision == "fp32" else master_bytes
    states = master + moment_bytes * moments  # K: 12 for Adam in mixed precision
    if framework == "torchtitan":
        return _fsdp2_bytes(zero, offload, n, moments)
    if framework == "megatron":
        if precision == "bf16":
            g, opt = 4.0, float(states)  # fp32 main_grad, reduced in fp32
        else:
            g, opt = float(work), float(states + (4 if precision == "fp16" else 0))
        if zero == 3:
            # Megatron-FSDP, optim_grads_params: bf16 weights, gradients in their dtype
            # (--megatron-fsdp-main-grads-dtype auto) and fp32 main weights with the Adam moments
            # (--megatron-fsdp-main-params-dtype fp32), all sharded over the DP x CP group
            # (docs/user-guide/features/megatron_fsdp.md, Mixed-Precision).
            return work / n, work / n, opt / n, 0.0
        if offload == "optimizer":
            # Megatron-Core's HybridDeviceOptimizer (bf16, distributed optimizer): the DP shard's
            # fp32 master weights and Adam moments, and a pinned fp32 copy of its gradients, live
            # on the host; the GPU keeps the bf16 weights and the fp32 main_grad buffer.
            return float(work), g, 0.0, (states + 4.0) / n
        return float(work), g, opt / n if zero >= 1 else opt, 0.0
    # DeepSpeed engine (deepspeed, megatron-deepspeed)
    fp32_grad = 0 if precision == "fp32" else 4
    if zero == 0:
        return float(work), float(work), float(states), 0.0
    if zero == 1:
        w, g, opt = float(work), work + fp32_grad / n, states / n
    elif zero == 2:
        w, g, opt = float(work), (work + fp32_grad) / n, states / n
    else:
        w, g, opt = work / n, fp32_grad / n if fp32_grad else work / n, states / n
    if offload == "none":
        return w, g, opt, 0.0
    # Offload: the optimizer states and the fp32 gradient partition live on the CPU; the GPU
    # keeps the 16-bit weights (ZeRO-3: its partition) and streams reduced gradients out.
    # ZeRO-1/2 (DeepSpeed 0.19 runtime/zero/stage_1_and_2.py) also pin a 16-bit copy of the
    # partition on the host (param_buffer_of_bit16_for_cpu_offload_groups), through which the
    # updated weights go back to the GPU: 16 + 2 bytes per parameter of the partition. (With
    # gradient accumulation, accumulated_grads_in_cpu adds 16-bit gradients of the partition's
    # parameters; not counted.)
    if zero <= 2:
        cpu = (work + fp32_grad + states) / n
        g = float(work) if zero == 1 else 0.0  # ZeRO-1 keeps whole 16-bit gradients on the GPU
    else:
        cpu = g + opt
        g = 0.0
    if offload == "optimizer+params":  # ZeRO-3 only: the 16-bit partition moves too
        cpu += w
        w = 0.0
    return w, g, 0.0, cpu


def _fsdp2_bytes(zero: int, offload: str, n: int, moments: int) -> tuple[float, float, float, float]:
    """torchtitan's model states per parameter. Its parameters stay in their fp32 init dtype
    (training.dtype float32); FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    casts them to bf16 only when it gathers a block and reduce-scatters fp32 gradient shards
    (torchtitan models/llama3/infra/parallelize.py apply_fsdp), so a rank holds fp32 shards of
    the weights (4/n), gradients (4/n) and Adam moments (8/n) and no separate master copy. DDP
    (``zero`` 0) keeps all of them whole under autocast; CPUOffloadPolicy moves them to the host."""
    w, g, opt = 4.0, 4.0, 4.0 * moments
    if zero == 0:
        return w, g, opt, 0.0
    if offload == "optimizer+params":
        return 0.0, 0.0, 0.0, (w + g + opt) / n
    return w / n, g / n, opt / n, 0.0


def state_bytes(col: dict[str, np.ndarray], dense: np.ndarray, expert: np.ndarray, largest: np.ndarray,
                precision: str, moments: int, **dtypes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate and rank ([candidate x rank] ``dense`` and ``expert`` parameters, the
    ``largest`` block's): weights, gradients, optimizer states and host bytes of the model
    states. Dense parameters shard over dp x cp (one hybrid-sharding group of those ranks:
    candidates.shard_ranks), routed experts over that / ep; with ZeRO-3 the largest block is
    gathered whole (weights and gradients, 2 + 2 bytes per parameter) while
    it runs, as in DeepSpeed's estimator, twice over where the runtime prefetches the next
    block into a second buffer (Megatron-FSDP: live_blocks).

    ``bytes_per_param`` is asked once per distinct (framework, ZeRO, offload, group size)
    among the candidates, on Python numbers; ``dtypes`` are its state dtypes (Workload.state_dtypes)."""
    factors: dict[tuple[int, int, int, int], tuple[float, float, float, float]] = {}

    def per_param(f: int, z: int, o: int, size: int) -> tuple[float, float, float, float]:
        hit = factors.get((f, z, o, size))
        if hit is None:
            hit = factors[f, z, o, size] = bytes_per_param(FRAMEWORKS[f], z, OFFLOADS[o], size, precision, moments,
                                                                    **dtypes)
        return hit

    dp = shard_ranks(col)
    rows = [per_param(f, z, o, d) + per_param(f, z, o, e) for f, z, o, d, e in zip(
        col["framework"].tolist(), col["zero"].tolist(), col["offload"].tolist(), dp.tolist(),
        np.maximum(expert_shard_ranks(col), 1).tolist())]
    wd, gd, od, cd, we, ge, oe, ce = np.array(rows, dtype=float).reshape(-1, 8).T[:, :, None]
    z3 = col["zero"] == 3
    live3 = np.where(z3[:, None], 2.0 * live_blocks(col)[:, None] * largest, 0.0) if z3.any() else 0.0
    w_live = g_live = live3
    whole = (z3 & keeps_stage_gathered(col))[:, None]  # FSDP2 under PP: the stage gathered, fp32 grads
    if whole.any():
        w_live, g_live = np.where(whole, 2.0 * (dense + expert), live3), np.where(whole, 4.0 * (dense + expert), live3)
    return (wd * dense + we * expert + w_live, gd * dense + ge * expert + g_live, od * dense + oe * expert,
            cd * dense + ce * expert)



def model_states(dense_params: float, expert_params: float, *, framework: str, zero: int, offload: str,
                 dp: int, ep: int, precision: str = "bf16", moments: int = 2,
                 live_layer_params: float = 0.0, **dtypes: int) -> ModelStates:
    """``state_bytes`` of one GPU holding ``dense_params`` and ``expert_params`` (``live_layer_params``:
    its largest layer), for one configuration."""
    col = {"framework": np.array([FRAMEWORKS.index(framework)]), "zero": np.array([zero]),
           "offload": np.array([OFFLOADS.index(offload)]), "dp": np.array([dp]), "ep": np.array([ep]),
           "cp": np.array([1]), "rep": np.array([1]), "tp": np.array([1]), "etp": np.array([1]), "pp": np.array([1])}
    one = np.array([[float(x)] for x in (dense_params, expert_params, live_layer_params)])
    return ModelStates(*(float(x[0, 0]) for x in state_bytes(col, *one[:, None], precision, moments,
                                                                    **dtypes)))


# Per framework (in FRAMEWORKS order): whether it keeps DeepSpeed's ZeRO bucket buffers.
_ZERO_BUCKETS = np.array([fw.traits(f).zero_buckets for f in FRAMEWORKS])


def process_groups(col: dict[str, np.ndarray]) -> np.ndarray:
    """Per candidate, the parallel dimensions with a process group of more than one rank (each
    holds NCCL buffers; hybrid sharding's outer group is one more)."""
    return sum((col[k] > 1).astype(float) for k in ("tp", "pp", "dp", "ep", "cp", "rep"))


def buffer_bytes(framework: np.ndarray, zero: np.ndarray, stage_params: np.ndarray, groups: np.ndarray,
                 pp_buffer: np.ndarray | float = 0.0) -> np.ndarray:
    """Communication buffers: NCCL's per process group, the pipeline receive buffers, and
    DeepSpeed's ZeRO buckets (ZeRO-1/2: reduce and all-gather buckets of 16-bit elements, 4.5x
    with overlap_comm; ZeRO-3: the prefetch and reduce buckets), none larger than the stage.
    Elementwise over arrays that broadcast together (``framework``: FRAMEWORKS codes);
    ``stage_params`` of inf gives the most the buckets can take."""
    buckets = _ZERO_BUCKETS[framework]
    z12 = buckets & ((zero == 1) | (zero == 2))
    z3 = buckets & (zero == 3)
    out = np.zeros(np.broadcast_shapes(np.shape(z12), np.shape(stage_params)))
    out = np.where(z12, fw.OVERLAP_COMM_FACTOR * 2 * (np.minimum(fw.REDUCE_BUCKET_SIZE, stage_params)
                                                      + np.minimum(fw.ALLGATHER_BUCKET_SIZE, stage_params)), out)
    out = np.where(z3, 2 * np.minimum(fw.STAGE3_PREFETCH_BUCKET_SIZE, stage_params)
                   + 2 * np.minimum(fw.REDUCE_BUCKET_SIZE, stage_params), out)
    return nccl_bytes(groups) + pp_buffer + out


def nccl_bytes(groups):
    """NCCL's buffers for ``groups`` process groups."""
    return NCCL_BYTES_PER_GROUP * groups


def microbatch_group(pp: int, microbatches: int) -> int:
    """Micro-batches an interleaved schedule runs on one virtual stage before moving to the next
    (Megatron-Core's ``microbatch_group_size_per_vp_stage``, flag
    ``--microbatch-group-size-per-virtual-pipeline-stage``; default pp).

    Megatron-Core's interleaved schedule (``pipeline_parallel/schedules.py``) accepts a group
    G with pp <= G <= M whose last group is empty or at least pp long (M mod G = 0 or >= pp);
    a shorter last group would leave dependency bubbles and is refused. So M divisible by pp
    runs with the default, and any other M >= pp with the smallest such G (G = M always
    qualifies): the step time is the same, and each extra micro-batch in the group is one
    more chunk-forward held in the warm-up, so the smallest G holds the least memory.
    """
    if microbatches < pp:
        raise ValueError(f"an interleaved schedule needs at least pp = {pp} micro-batches, got {microbatches}")
    for group in range(pp, microbatches + 1):
        rest = microbatches % group
        if rest == 0 or rest >= pp:
            return group
    raise AssertionError("unreachable: G = M always qualifies")


def group_to_set(pp: int, virtual: int, microbatches: int) -> int | None:
    """The micro-batch group a launch must name (``--microbatch-group-size-per-virtual-pipeline-stage``),
    or None where Megatron's default of pp runs the schedule (not interleaved, or pp divides M)."""
    return microbatch_group(pp, microbatches) if virtual > 1 and microbatches % pp and microbatches > pp else None


def microbatch_groups(pp: np.ndarray, microbatches: np.ndarray) -> np.ndarray:
    """``microbatch_group`` over arrays (pp where the schedule is not interleaved or has too few
    micro-batches to interleave: the group is then never read)."""
    pp, microbatches = np.asarray(pp, dtype=np.int64), np.asarray(microbatches, dtype=np.int64)
    out = pp.copy()
    odd = np.nonzero((microbatches % pp != 0) & (microbatches >= pp))[0]
    if odd.size:
        pairs, inverse = np.unique(np.stack([pp[odd], microbatches[odd]], axis=1), axis=0, return_inverse=True)
        groups = np.array([microbatch_group(int(p), int(m)) for p, m in pairs])
        out[odd] = groups[inverse.reshape(-1)]
    return out


def inflight_microbatches(rank: int, pp: int, virtual: int, microbatches: int) -> float:
    """Micro-batches of activations a pipeline rank holds at its peak, in units of its whole
    stage (all its chunks).

    1F1B: rank r runs p - r forwards before its first backward (Narayanan et al. 2021).
    Interleaved: Megatron's warm-up runs (p - r - 1) x 2 + (v - 1) x G chunk-forwards (G the
    ``microbatch_group``, p unless M is not a multiple of p), plus the one in steady state,
    each 1/v of the stage: with G = p rank 0 holds L(1 + (p-1)/(p v)) layers' worth,
    Korthikanti et al. Sec 4.2.3. tests/test_interleaved_schedule.py replays the schedule.
    """
    if pp == 1:
        return 1.0
    group = microbatch_group(pp, microbatches) if virtual > 1 and microbatches >= pp else pp
    return float(inflight_array(rank, pp, virtual, microbatches, group))


def inflight_array(rank, pp, virtual, microbatches, group):
    """``inflight_microbatches`` (pp > 1) over numpy arrays that broadcast together, ``group``
    from ``microbatch_groups``: the one formula assemble, the search's bounds and memfit read."""
    one_f1b = np.minimum(pp - rank, microbatches)
    chunks = np.minimum((pp - rank - 1) * 2 + (virtual - 1) * group + 1, microbatches * virtual)
    return np.where(virtual == 1, one_f1b, chunks / virtual)


def activation_bytes(stored_per_mb, live_extra_per_mb, inflight):
    """Activations at the peak: in-flight micro-batches plus one layer being recomputed."""
    return stored_per_mb * inflight + live_extra_per_mb


def overhead_bytes(allocated):
    """The CUDA context and the caching allocator's fragmentation on top of ``allocated``."""
    return CUDA_CONTEXT_BYTES + FRAGMENTATION * allocated


def peak_bytes(allocated):
    """A GPU's peak: what it allocates plus ``overhead_bytes``."""
    return allocated + CUDA_CONTEXT_BYTES + FRAGMENTATION * allocated


# peak_bytes is affine: CUDA_CONTEXT_BYTES with nothing allocated, GROWTH per byte allocated.
GROWTH = 1.0 + FRAGMENTATION


# Host memory an offloading job may use: the rest goes to the OS, the page cache, data-loader
# workers and the launcher (DeepSpeed's estimators leave the same headroom to the user).
HOST_USABLE_FRACTION = 0.85


def host_capacity_bytes(host_memory_GiB: float) -> float:
    """Host bytes per node that offloaded optimizer states and parameters may occupy."""
    return host_memory_GiB * 2**30 * HOST_USABLE_FRACTION


def cpu_bytes_per_node(cpu_per_gpu: float, gpus_per_node: int) -> float:
    """Host memory of a node's offloaded states, with DeepSpeed's pinned-buffer factor.

    For Megatron's HybridDeviceOptimizer the same 1.5 is the worst case of torch's pinned host
    allocator, which rounds each pinned tensor up to a power of two (pytorch/pytorch#95823,
    vllm-project/vllm#56410): the pinned fp32 weight and gradient copies, 8 of its 16 bytes
    per parameter, at most double; the Adam moments are plain host tensors."""
    return cpu_per_gpu * gpus_per_node * CPU_BUFFER_FACTOR
