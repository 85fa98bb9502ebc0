"""The process groups of one parallel layout on a cluster, as the cost model lays ranks out.

Rank order is TP innermost, then EP, then the rest of DP, then PP (Megatron's and DeepSpeed's
order); EP ranks are part of the DP group, so the dense DP group spans both. Experts folded
out of TP (``etp`` 1 under tp > 1) lay out as Megatron-Core's expert RankGenerator does: expert
TP innermost, then EP, then expert DP, over the same ranks, so an EP group then takes the TP
ranks first. Under hybrid
sharding (``rep`` > 1) the DP group is one sharding group of dp / rep consecutive DP ranks, as
Megatron-Core cuts its intra-instance groups (parallel_state.py, intra_partial_data_parallel),
and the ``outer`` group joins the rep groups' same-numbered ranks. Each group is
summarised as a ``GroupShape`` (placement.py), which is what the collective model prices.
"""

from __future__ import annotations

import functools

import numpy as np

from planner.cost.parallel import expert_replicas
from planner.hardware.cluster import Cluster
from planner.hardware.placement import GroupShape, Placement, pipeline_hops


class Layout:
    """The TP, EP, expert-DP, dense-DP, outer (hybrid-sharding) and PP group shapes of
    (tp, ep, dp, pp, rep, etp) on a cluster.

    Each shape is found on first use: block costs need only tp and ep, and on thousands of
    GPUs a shape costs a sort over every rank."""

    def __init__(self, cluster: Cluster, tp: int, ep: int, dp: int, pp: int, rep: int = 1,
                 etp: int | None = None) -> None:
        self.cluster = cluster
        etp = tp if etp is None else etp
        self._full = Placement(cluster, dims={"tp": etp, "ep": ep, "dp": expert_replicas(dp, tp, ep, etp) // rep,
                                              "rep": rep, "pp": pp},
                               order=("tp", "ep", "dp", "rep", "pp"))
        self._dense = Placement(cluster, dims={"tp": tp, "dp": dp // rep, "rep": rep, "pp": pp},
                                order=("tp", "dp", "rep", "pp"))

    @functools.cached_property
    def tp(self) -> GroupShape:
        return self._dense.group("tp")

    @functools.cached_property
    def ep(self) -> GroupShape:
        return self._full.group("ep")

    @functools.cached_property
    def edp(self) -> GroupShape:
        """The group a routed expert's replicas reduce over (parallel.expert_replicas ranks)."""
        return self._full.group("dp")

    @functools.cached_property
    def pp(self) -> GroupShape:
        return self._full.group("pp")

    @functools.cached_property
    def dp(self) -> GroupShape:
        """The group dense parameters reduce over (all dp ranks, EP included)."""
        return self._dense.group("dp")

    @functools.cached_property
    def outer(self) -> GroupShape:
        """The group the hybrid-sharding groups' gradient shards are all-reduced over (rep ranks)."""
        return self._dense.group("rep")

    @functools.cached_property
    def pp_hops(self) -> tuple[np.ndarray, GroupShape | None]:
        """placement.pipeline_hops of the pp dimension: which rank's hop to the next leaves the
        node, and the shape that prices the others (None: every hop priced alike)."""
        crosses, near = pipeline_hops(self.cluster, self._dense.stride("pp"), self._dense.dims["pp"])
        return np.array(crosses, dtype=bool), near


@functools.lru_cache(maxsize=4096)
def layout(cluster: Cluster, tp: int, ep: int, dp: int, pp: int, rep: int = 1, etp: int | None = None) -> Layout:
    """The one ``Layout`` of (tp, ep, dp, pp, rep, etp) on ``cluster`` (its shapes are found once)."""
    return Layout(cluster, tp, ep, dp, pp, rep, etp)
