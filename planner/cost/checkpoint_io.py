"""Checkpoint size, write and restore time per candidate, from the runtime's save layout.

Size: a full checkpoint holds each parameter once in the working dtype and its optimizer states
(master weights and Adam moments, Workload.state_dtypes); model-only holds the weights alone.
Sharding does not change the size, only who writes it:

- Megatron-Core (torch_dist or fsdp_dtensor, fully parallel save, its default) and torchtitan
  (DCP, whose save planner dedups replicated tensors across ranks) spread every byte over all
  ranks;
- DeepSpeed writes the ZeRO-partitioned states from every rank, but what ZeRO replicates (all of
  it at stage 0, the 16-bit weights at stages 1-2) only from data-parallel rank 0 of each
  model-parallel group (``mp_rank_*_model_states.pt``), so those nodes write the most.

Write time: the busiest node's bytes at the node's storage bandwidth, or the whole checkpoint at
the filesystem's aggregate, whichever is slower. The step stalls for all of it when the save is
synchronous (DeepSpeed, Megatron-FSDP); Megatron-Core (--async-save) and torchtitan
(checkpoint.async_mode) stall only for the copy of each GPU's share to host memory and write in the background.
Restore: every rank reads what it holds (replicas read the replicated bytes again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.cost.parallel import FRAMEWORKS, Workload
from planner.hardware.profile import HardwareProfile
from planner.model.spec import ModelSpec

_DEEPSPEED = (FRAMEWORKS.index("deepspeed"), FRAMEWORKS.index("megatron-deepspeed"))
_MEGATRON, _TITAN = FRAMEWORKS.index("megatron"), FRAMEWORKS.index("torchtitan")


def saves_async(framework: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Where ``generate`` turns on the runtime's asynchronous save: Megatron-Core's --async-save
    (torch_dist format: not under Megatron-FSDP's fsdp_dtensor, ZeRO-3) and torchtitan's
    checkpoint.async_mode. DeepSpeed's engine saves synchronously."""
    return ((framework == _MEGATRON) & (zero < 3)) | (framework == _TITAN)


@dataclass(frozen=True)
class CheckpointArrays:
    """Per candidate: bytes of one full checkpoint, of a model-only one, the seconds the step
    stalls to save it, the seconds until it is durable, and the seconds to read it back."""

    full_bytes: np.ndarray
    model_bytes: np.ndarray
    stall_s: np.ndarray
    persist_s: np.ndarray
    restore_s: np.ndarray


def routed_expert_params(model: ModelSpec) -> int:
    """Parameters of the routed experts (sharded over EP, replicated over dp / ep)."""
    return sum(b.mlp.routed_experts * b.mlp.expert_params(b.hidden) for b in model.blocks
               if getattr(getattr(b, "mlp", None), "kind", None) == "moe")


def bytes_per_param(framework: np.ndarray, workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """(weight, optimizer-state) bytes per parameter in a checkpoint. torchtitan keeps fp32
    parameters and no separate master copy (memory._fsdp2_bytes)."""
    dtypes, moments = workload.state_dtypes, workload.optimizer_moments
    work = 4 if workload.precision == "fp32" else 2
    master = 0 if workload.precision == "fp32" else dtypes["master_bytes"]
    states = master + moments * dtypes["moment_bytes"]
    titan = framework == FRAMEWORKS.index("torchtitan")
    return np.where(titan, 4.0, float(work)), np.where(titan, 4.0 * moments, float(states))


def checkpoint_arrays(col: dict[str, np.ndarray], model: ModelSpec, workload: Workload, profile: HardwareProfile,
                      nodes: int) -> CheckpointArrays:
    """Checkpoint facts of each candidate of ``col`` on ``nodes`` nodes of ``profile``."""
    total = float(model.total_params())
    experts = float(routed_expert_params(model))
    w, s = bytes_per_param(col["framework"], workload)
    full, weights = total * (w + s), total * w
    gpn = profile.gpus_per_node
    ds = np.isin(col["framework"], _DEEPSPEED)
    # What DeepSpeed writes only from data-parallel rank 0: everything at ZeRO-0, the weights at 1-2.
    replicated = np.where(ds & (col["zero"] == 0), full, np.where(ds & (col["zero"] < 3), weights, 0.0))
    # Those ranks: the first tp (x ep, for experts) ranks of each pipeline stage's block of nodes.
    e = col["ep"] if experts > 0 else np.ones_like(col["ep"])
    stage_nodes = nodes / col["pp"]
    per_stage = np.minimum(np.maximum(stage_nodes, 1.0), np.ceil(col["tp"] * e / gpn))
    writer_nodes = np.clip(np.where(stage_nodes >= 1, col["pp"] * per_stage, nodes), 1, nodes)
    st = profile.storage
    busiest = (full - replicated) / nodes + replicated / writer_nodes
    persist = np.maximum(busiest / (st.write_GBps_per_node * 1e9), full / (st.aggregate_write_GBps * 1e9))
    # Async: each GPU copies its share to pinned host memory over its PCIe link, then writes on.
    copy = (full / (nodes * gpn)) / profile.node.host_Bps
    stall = np.where(saves_async(col["framework"], col["zero"]), np.minimum(copy, persist), persist)
    dp_replicas = col["dp"] * col["cp"]
    read_total = full + replicated * (dp_replicas - 1)
    restore = np.maximum(read_total / nodes / (st.read_GBps_per_node * 1e9),
                         read_total / (st.aggregate_read_GBps * 1e9))
    shape = col["tp"].shape
    return CheckpointArrays(np.broadcast_to(full, shape).astype(float), np.broadcast_to(weights, shape).astype(float),
                            stall, persist, restore)
