"""How much of a block's TP and EP communication its own compute hides, where a runtime overlaps them.

Two runtimes' schedules, priced per [group, recompute mode, micro-batch, block] on the block
tables' arrays (block_times.py): Transformer Engine's userbuffers overlap of TP collectives
with the GEMMs (frameworks.Traits.tp_comm_overlap), and Megatron-Core's combined 1F1B that
hides one micro-batch's expert all-to-alls under another's compute (Traits.ep_comm_overlap).
"""

from __future__ import annotations

import numpy as np

from planner.cost.parallel import RECOMPUTES


def overlapped_tp(tp: np.ndarray, gemm: np.ndarray, ckpt: np.ndarray, tp_size: np.ndarray) -> np.ndarray:
    """[group, mode, b, block] TP seconds left exposed when each block's TP collectives overlap
    its GEMMs (frameworks.Traits.tp_comm_overlap): the GEMMs hide up to their own seconds,
    forward and twice that backward (and the recomputed forward's again), and the first of the
    tp chunks is always exposed."""
    passes = np.full((tp.shape[0], tp.shape[1], 1, tp.shape[3]), 3.0)
    passes[:, RECOMPUTES.index("full"), 0] += ckpt
    passes[:, RECOMPUTES.index("op"), 0] += ckpt  # per-op SAC runs the forward's GEMMs again, most of them
    chunk = tp / tp_size[:, None, None, None]
    return np.where(tp > 0, np.maximum(tp - passes * gemm[:, None], chunk), 0.0)


def async_backward_tp(tp: np.ndarray, reduced: np.ndarray, wgrad: np.ndarray) -> np.ndarray:
    """[group, mode, b, block] TP seconds left exposed where the runtime reduces each column-parallel
    linear's input gradient while its weight-gradient GEMM runs (frameworks.Traits.tp_backward_overlap:
    Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication since Sep 2021, an async all-reduce,
    or under sequence parallelism an async reduce-scatter, then the wgrad GEMM; TE's Linear alike).
    ``reduced``: the backward's reductions ([group, b, block]: its all-reduces and reduce-scatters;
    its all-gathers are the row-parallel outputs' gradients, needed before any GEMM), hidden up to
    the block's weight-gradient GEMMs (its forward GEMMs' shapes, ``wgrad``). Under sequence
    parallelism the backward also gathers each column-parallel input again under the data-gradient
    GEMM: counted nowhere, as before (the model prices a forward gather's mirror only)."""
    return tp - np.minimum(reduced, wgrad)[:, None]


def overlapped_ep(ep: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, sm_share: np.ndarray | float = 0.0) -> np.ndarray:
    """[group, mode, b, block] EP seconds left exposed when Megatron-Core's combined 1F1B runs the
    forward of one micro-batch beside the backward of another, layer by layer, each one's
    all-to-alls on a second stream under the other's compute (frameworks.Traits.ep_comm_overlap,
    ``--overlap-moe-expert-parallel-comm``): a layer pair takes max(compute, all-to-alls), so
    what passes the block's forward and backward seconds (attention as TE runs it) stays exposed.
    Dispatch kernels that hold ``sm_share`` of the GPU's SMs while they run ([group, block]: the
    flex dispatcher's, moe_dispatch.FLEX_SMS) slow the compute beside them by that share of the
    all-to-alls' seconds: a pair takes max(compute + share x all-to-alls, all-to-alls).
    Megatron refuses it under full recomputation (transformer_config.py): that mode keeps all."""
    share = np.broadcast_to(np.asarray(sm_share, dtype=float), ep.shape[:1] + ep.shape[3:])[:, None, None, :]
    out = np.maximum(ep - (fwd + bwd)[:, None], share * ep)
    out[:, RECOMPUTES.index("full")] = ep[:, RECOMPUTES.index("full")]
    out[:, RECOMPUTES.index("op")] = ep[:, RECOMPUTES.index("op")]  # torchtitan's: no combined 1F1B
    return out
