"""Activations offloaded to host memory: Megatron-Core's ``--cpu-offloading-num-layers``, which
Transformer Engine's CPU offload context runs (transformer_engine/pytorch/cpu_offload.py; its
documentation, docs/features/other_optimizations/cpu_offloading).

TE's default schedule, for k offloaded of a block's L decoder layers: the first k layers copy
each tensor they save for backward to pinned host memory as soon as it is saved, on a stream of
their own, and copy it back during the backward; at most L - k layers' activations are on the
GPU at once, and compute or copies wait to keep it so. Megatron-Core runs it without a pipeline
and without recomputation (transformer_config.py refuses both), so the one pipeline rank holds
every decoder layer and one micro-batch at a time.

Memory: the k layers' stored activations leave the GPU (dsplan takes the mean decoder layer's
bytes, exact for a uniform stack) and occupy pinned host memory.

Time, per micro-batch, with t the copy of one layer over the host link (``pcie_GBps``: per
direction per GPU, NVLink-C2C on Grace systems) and F, B the rank's forward and backward
seconds:

- forward: the k copies run one after another from the first layer on; layer j waits for layer
  j - (L - k)'s copy, so the last layer starts once all k are out: ``max(0, k t - F (L-1)/L)``;
- backward: a reload needs a slot the backward has freed, so the first starts after the last
  layer's backward, and layer 0's must land before its backward: ``max(0, k t - B (L-2)/L)``;
- with one slot (k = L - 1) nothing overlaps: 2 k t (TE warns of it).

The copies take HBM bandwidth from memory-bound kernels beside them; not priced. With the EP
all-to-all overlap two micro-batches interleave layer by layer, which TE's layer-ordered
schedule does not follow: dsplan refuses the pair (framework_rules.py).
"""

from __future__ import annotations

import numpy as np

from planner.cost import memory as mem

# Suggest's column value for "offload as few layers as make the candidate fit" (ParallelConfig
# holds the count the search chose, never this).
AUTO = -1


def layers_to_fit(peak: np.ndarray, capacity: float, layer_bytes: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """The fewest layers whose activations, offloaded, bring ``peak`` within ``capacity``: 0 where
    it fits already, and 0 where even L - 1 layers would not do (the plan stays out of memory as
    it is). ``layer_bytes`` of one decoder layer per micro-batch; every byte counts
    ``memory.GROWTH`` times toward the peak."""
    per = mem.GROWTH * layer_bytes
    need = np.ceil(np.divide(peak - capacity, per, out=np.full(np.shape(peak), np.inf), where=per > 0) - 1e-9)
    return np.where((need > 0) & (need <= layers - 1), need, 0).astype(np.int64)


def exposed_seconds(k: np.ndarray, layers: np.ndarray, layer_bytes: np.ndarray, fwd: np.ndarray, bwd: np.ndarray,
                    host_Bps: float) -> np.ndarray:
    """Seconds per micro-batch the copies of ``k`` offloaded layers leave exposed (module doc)."""
    copies = k * layer_bytes / host_Bps
    n = np.maximum(layers, 1)
    overlapped = np.maximum(0.0, copies - fwd * (n - 1) / n) + np.maximum(0.0, copies - bwd * np.maximum(n - 2, 0) / n)
    return np.where(k <= 0, 0.0, np.where(layers - k >= 2, overlapped, 2.0 * copies))
