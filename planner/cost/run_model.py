"""A model cut to the first block of each run of identical blocks, and that short model's
layer costs: what the block tables are built from (block_times.py)."""

from __future__ import annotations

import numpy as np

from planner.cost.layers import LayerCost, layer_costs
from planner.cost.parallel import Workload, expert_tp_of
from planner.model.spec import ModelSpec


class RunModel:
    """A model with each run of identical consecutive blocks cut to its first block, and the
    layer costs of that short model, kept per (block, tp, sp, ep).

    A block's cost depends on the block, the workload and (for a norm) whether the block
    before it is a vision block, so the first block of each run stands for the run: the 27
    SigLIP blocks or 126 Llama layers are priced once, and per-block arrays are widened
    afterwards (``block_tables(..., runs=)``). Equal to pricing every block
    (tests/test_search_space.py)."""

    def __init__(self, model: ModelSpec, workload: Workload, cp: int = 1, etp: int | None = None) -> None:
        self.model, self.workload, self.cp, self.etp = model, workload, cp, etp
        blocks = model.blocks
        # Most copies are one object: ``is`` answers before pydantic's field-by-field ==.
        keep = [i for i in range(len(blocks))
                if i == 0 or (blocks[i] is not blocks[i - 1] and blocks[i] != blocks[i - 1])]
        self.positions = np.searchsorted(keep, np.arange(len(blocks)), side="right") - 1
        self.runs = np.bincount(self.positions)
        self.short = model.model_copy(update={"blocks": [blocks[i] for i in keep]})
        self._memo: dict = {}
        self._flops: float | None = None

    def layer_costs(self, tp: int, style: int, ep: int) -> list[LayerCost]:
        """The blocks under ``tp`` of TP style ``style`` (frameworks.TP_STYLES) and ``ep``."""
        return layer_costs(self.short, self.workload, tp, style == 1, ep, self._memo, self.cp, self.expert_tp(tp),
                           vocab_parallel=style != 2)

    def expert_tp(self, tp: int) -> int:
        """The routed experts' TP degree beside ``tp``: ``etp`` (1) when folded, else tp."""
        return expert_tp_of(self.etp, tp)

    def flops_per_step(self) -> float:
        """Model FLOPs of one step: 3x the forward (backward = 2x), no recomputation, attention
        at full s^2 (the Megatron/Korthikanti convention); each block's own forward, summed in
        model order."""
        if self._flops is None:
            fwd = [c.fwd_flops for c in layer_costs(self.short, self.workload, 1, False, 1, self._memo)]
            self._flops = 3.0 * sum(fwd[j] for j in self.positions.tolist()) * self.workload.global_batch
        return self._flops
