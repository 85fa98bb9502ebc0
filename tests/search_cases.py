"""A small search space, grouped and ready to price: what several search tests start from, and
a candidate's cost-model detail as the tests read it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from planner.cost.assemble import Assembly
from planner.cost.parallel import CP_COMMS, Workload
from planner.cost.rank_chunks import Split
from planner.cost.rank_tables import rank_fields
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.model.spec import ModelSpec
from planner.search.evaluate import Detail, Pricing, candidate_details, evaluate_rows
from planner.search.keys import KeyedSpace, group_by_key
from planner.search.request import candidate_space
from planner.search.space import Constraints, Space


@dataclass
class Case:
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    space: Space
    p: Pricing
    ks: KeyedSpace


def prepared(name: str, nodes: int, cons: Constraints, global_batch: int = 64, seq_len: int = 4096,
             profile: str = "dgx-a100-80g", balancer: str = "optimal", **knobs) -> Case:
    """``name`` on ``nodes`` nodes of ``profile`` (one image of two tiles per sample for a VLM);
    ``knobs``: other Workload fields."""
    model = load_model(name)
    cluster = Cluster.build(load_profile(profile), nodes)
    images, tiles = (1, 2) if model.is_vlm else (0, 0)
    workload = Workload(global_batch=global_batch, seq_len=seq_len, images_per_sample=images, tiles_per_image=tiles,
                        **knobs)
    space = candidate_space(model, cluster, workload, cons)
    return Case(model, cluster, workload, space, Pricing.of(model, cluster, workload, balancer), group_by_key(space))


def case_of(model: ModelSpec, cluster: Cluster, workload: Workload, space: Space, balancer: str = "optimal") -> Case:
    """The search's pricing of ``space``, whose candidates share one context-parallel split and
    one expert-TP choice (folded: some row's experts off its TP)."""
    c = space.columns
    cp = (int(c["cp"][0]), CP_COMMS[int(c["cp_comm"][0])]) if len(space) else (1, "p2p")
    etp = 1 if len(space) and bool((c["etp"] < c["tp"]).any()) else None
    return Case(model, cluster, workload, space, Pricing.of(model, cluster, workload, balancer, *cp, etp=etp),
                group_by_key(space))


def detail_row(asm: Assembly, n: int) -> dict[str, np.ndarray]:
    """Row ``n`` of an Assembly, every field as a one-row array."""
    return {f.name: getattr(asm, f.name)[n:n + 1] for f in fields(asm)}


def candidate(case: Case, i: int, known: dict[int, Detail] | None = None,
              overrides: dict[int, Split] | None = None) -> tuple[Split, dict, dict, tuple[float, float]]:
    """Candidate ``i`` in detail: its split, named rank-table rows, assembled row, bottlenecks."""
    overrides = overrides or {}
    (d,) = candidate_details(case.p, case.ks, [i], known or {}, overrides)
    return (overrides.get(i, d.split.parts), rank_fields(d.ranks), detail_row(d.asm, d.n),
            (d.split.greedy, d.split.optimal))


def evaluate_one(case: Case, i: int, parts: Split | None = None) -> tuple[float, float, float]:
    """Candidate ``i``'s (step time, peak bytes, CPU bytes per node), with ``parts`` as its split if given."""
    return evaluate_rows(case.p, case.ks, [i], {} if parts is None else {i: parts})[i]
