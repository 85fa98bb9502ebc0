"""Pipeline splits of the search's keys: which blocks go to which stage.

The balancers (partition.py) split pipeline units, each a layer with the small blocks before
it, by their seconds per micro-batch from the block tables. One split per (tp, sp, ep,
micro-batch, recompute, pp, virtual stages), shared by every ZeRO stage, offload, dp and
framework of it; both balancers run, the chosen one's split is used, both bottlenecks are
reported.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from planner.cost.block_times import BlockTable
from planner.cost.paid import Paid
from planner.cost.rank_chunks import Split
from planner.model.spec import ModelSpec
from planner.search.partition import greedy_partition, optimal_partition

BALANCERS = ("greedy", "optimal")


def pipeline_units(model: ModelSpec) -> list[tuple[int, int]]:
    """Block ranges the balancers move as one: each layer (ViT or decoder) with the small
    blocks before it (patch embedding, projector, token embedding); the final norm and the LM
    head stay with the last layer, so the first and last stages carry them."""
    layers = [i for i, b in enumerate(model.blocks) if b.kind in ("vision", "decoder")]  # by kind tag, not isinstance
    starts = [0] + [layers[k - 1] + 1 for k in range(1, len(layers))]
    ends = starts[1:] + [len(model.blocks)]
    return list(zip(starts, ends))


class Units:
    """A model's pipeline units, as ranges and as index arrays (prefix sums over blocks become
    per-unit sums with one subtraction)."""

    def __init__(self, model: ModelSpec) -> None:
        self.ranges = pipeline_units(model)
        self.starts = np.array([a for a, _ in self.ranges])
        self.ends = np.array([e for _, e in self.ranges])
        self.nblocks = len(model.blocks)

    def blocks(self, counts: tuple[int, ...]) -> Split:
        """Block ranges of a split given as units per stage."""
        bounds, u = [], 0
        for c in counts:
            bounds.append((self.ranges[u][0], self.ranges[u + c - 1][1]))
            u += c
        return bounds


class SplitResult(NamedTuple):
    parts: Split
    greedy: float  # seconds per micro-batch of the greedy split's slowest stage (nan: one stage)
    optimal: float
    id: int  # the split's number among every split of the search (Splits.all)


class Splits:
    """The time-balanced split of each key, and every unit's seconds per micro-batch, kept."""

    def __init__(self, units: Units, balancer: str = "optimal") -> None:
        self.units, self.balancer = units, balancer
        self.all: list[Split] = []  # every split a result refers to, by id
        self._splits: dict[tuple, SplitResult] = {}
        self._unit_costs: dict[tuple, tuple[BlockTable, list[float]]] = {}

    def unit_costs(self, table: BlockTable, mode: int, b: int, paid: Paid = Paid()) -> list[float]:
        """Seconds per micro-batch of each pipeline unit: what the balancers split (the same for
        every pp and virtual-stage count, so kept per table, mode, micro-batch and how the
        runtime pays the blocks, frameworks.Paid)."""
        key = (id(table), mode, b, paid)
        hit = self._unit_costs.get(key)
        if hit is None or hit[0] is not table:
            prefix = np.concatenate(([0.0], np.cumsum(table.total(mode, table.b_index(b), paid))))
            hit = (table, (prefix[self.units.ends] - prefix[self.units.starts]).tolist())
            self._unit_costs[key] = hit  # holding the table keeps its id unique
        return hit[1]

    def split(self, table: BlockTable, key: tuple[int, int, int, int, int, int, int],
              paid: Paid = Paid()) -> SplitResult:
        """The split of ``key`` = (tp, sp, ep, micro-batch, recompute, pp, virtual stages), its
        blocks costed as the candidates' runtime pays them (``paid``)."""
        hit = self._splits.get((*key, paid))
        if hit is not None:
            return hit
        _, _, _, b, mode, pp, vs = key
        costs = self.unit_costs(table, mode, b, paid)
        if pp * vs == 1:
            parts, greedy, optimal = [(0, self.units.nblocks)], float("nan"), float("nan")
        else:
            g = greedy_partition(costs, pp * vs)
            o = optimal_partition(costs, pp * vs, upper=g.bottleneck)
            parts, greedy, optimal = self.units.blocks((o if self.balancer == "optimal" else g).counts), g.bottleneck, \
                o.bottleneck
        self.all.append(parts)
        out = self._splits[(*key, paid)] = SplitResult(parts, greedy, optimal, len(self.all) - 1)
        return out
