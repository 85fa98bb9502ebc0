"""A small search space, prepared for the evaluator: what several search tests start from."""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.parallel import Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.model.catalog import load_model
from planner.model.spec import ModelSpec
from planner.search.evaluate import Evaluator, Prepared
from planner.search.space import Constraints, Space
from planner.search.suggest import _space


@dataclass
class Case:
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    space: Space
    ev: Evaluator
    prep: Prepared


def prepared(name: str, nodes: int, cons: Constraints, global_batch: int = 64, seq_len: int = 4096) -> Case:
    """``name`` on ``nodes`` dgx-a100-80g nodes (one image of two tiles per sample for a VLM)."""
    model = load_model(name)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), nodes)
    images, tiles = (1, 2) if model.is_vlm else (0, 0)
    workload = Workload(global_batch=global_batch, seq_len=seq_len, images_per_sample=images, tiles_per_image=tiles)
    space = _space(model, cluster, workload, cons)
    ev = Evaluator(model, cluster, workload)
    return Case(model, cluster, workload, space, ev, ev.prepare(space))
