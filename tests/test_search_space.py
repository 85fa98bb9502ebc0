"""The candidate space honours every divisibility rule, the pins, and counts rejections."""

from __future__ import annotations

import numpy as np
import pytest

from planner.cost.framework_rules import ConfigColumns
from planner.cost.parallel import FRAMEWORKS, OFFLOADS
from planner.model.catalog import list_presets, load_preset
from planner.search.space import (
    Constraints,
    ModelFacts,
    degree_combinations,
    divisors,
    enumerate_space,
)

DENSE = ModelFacts(heads=(32,), kv_heads=8, routed_experts=0, units=32)
MOE = ModelFacts(heads=(32, 16), kv_heads=32, routed_experts=72, units=57)


def anything_goes(cols: ConfigColumns) -> np.ndarray:
    return np.full(len(cols.tp), -1)  # no rule broken


def no_pipeline_zero3(cols: ConfigColumns) -> np.ndarray:
    """PipelineModule rejects ZeRO-2/3 (rule 0 of this one-rule table)."""
    return np.where((cols.pp > 1) & (cols.zero_stage >= 2), 0, -1)


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(16384)[-1] == 16384 and len(divisors(16384)) == 15


def test_every_row_obeys_the_rules() -> None:
    space = enumerate_space(64, 8, 1024, MOE, Constraints(), anything_goes)
    c = space.columns
    assert len(space) > 1000
    assert np.all(c["dp"] * c["tp"] * c["pp"] == 64)
    assert np.all(c["micro_batch"] * c["grad_accum"] * c["dp"] == 1024)
    assert np.all((32 % c["tp"] == 0) & (16 % c["tp"] == 0) & (c["tp"] <= 8))
    assert np.all((72 % c["ep"] == 0) & (c["dp"] % c["ep"] == 0))
    assert np.all(c["pp"] * c["vs"] <= 57)
    assert np.all((c["vs"] == 1) | (c["pp"] > 1))
    assert np.all((c["sp"] == 0) | (c["tp"] > 1))
    off = np.array(OFFLOADS)[c["offload"]]
    assert np.all((off != "optimizer") | (c["zero"] > 0))
    assert np.all((off != "optimizer+params") | (c["zero"] == 3))
    # Every row is a valid ParallelConfig.
    for i in range(0, len(space), 997):
        cfg = space.config(i)
        assert cfg.world_size == 64 and cfg.samples_per_step == 1024


def test_tp_stays_in_the_node_unless_allowed() -> None:
    facts = ModelFacts(heads=(64,), kv_heads=64, routed_experts=0, units=80)
    inside = enumerate_space(32, 8, 256, facts, Constraints(), anything_goes)
    assert set(inside.columns["tp"]) == {1, 2, 4, 8}
    across = enumerate_space(32, 8, 256, facts, Constraints(allow_tp_across_nodes=True), anything_goes)
    assert set(across.columns["tp"]) == {1, 2, 4, 8, 16, 32}


def test_gqa_kv_heads_limit_tp() -> None:
    facts = ModelFacts(heads=(64,), kv_heads=2, routed_experts=0, units=80)
    space = enumerate_space(8, 8, 64, facts, Constraints(), anything_goes)
    assert set(space.columns["tp"]) == {1, 2}


def test_pins_and_lists_restrict_each_axis() -> None:
    cons = Constraints(tp=(8,), pp=(2, 4), zero=(1,), micro_batch=(1, 2), recompute=("full",),
                       framework=("megatron",), virtual_stages=(1,), sequence_parallel=(True,))
    space = enumerate_space(64, 8, 1024, DENSE, cons, anything_goes)
    c = space.columns
    assert set(c["tp"]) == {8} and set(c["pp"]) == {2, 4} and set(c["zero"]) == {1}
    assert set(c["micro_batch"]) == {1, 2} and set(c["vs"]) == {1} and set(c["sp"]) == {1}
    assert set(c["framework"]) == {FRAMEWORKS.index("megatron")}
    # dp = 64 / (8 * pp) = 4 or 2; offload none/optimizer (ZeRO-1): 2 x 2 x 2 rows
    assert len(space) == 2 * 2 * 2


def test_exact_count_on_a_tiny_space() -> None:
    facts = ModelFacts(heads=(4,), kv_heads=4, routed_experts=0, units=4)
    cons = Constraints(zero=(0,), offload=("none",), recompute=("none",), framework=("deepspeed",),
                       virtual_stages=(1,))
    space = enumerate_space(4, 4, 8, facts, cons, anything_goes)
    # (tp, pp, dp): (1,1,4) (1,2,2) (1,4,1) (2,1,2) (2,2,1) (4,1,1); micro-batch divides 8/dp;
    # sequence parallel doubles the tp>1 rows.
    expected = 0
    for tp, pp, dp in [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]:
        expected += len(divisors(8 // dp)) * (2 if tp > 1 else 1)
    assert len(space) == expected
    assert space.rejected == {"indivisible": 0, "framework": 0}


def test_framework_rule_rejections_are_counted() -> None:
    cons = Constraints(tp=(1,), pp=(2,), offload=("none",), recompute=("none",), framework=("deepspeed",),
                       virtual_stages=(1,), micro_batch=(1,))
    space = enumerate_space(8, 8, 64, DENSE, cons, no_pipeline_zero3)
    assert set(space.columns["zero"]) == {0, 1}
    assert space.rejected["framework"] == 2  # ZeRO-2 and ZeRO-3 with pp = 2
    # Per broken rule: how many it refused and the first of them, with its real degrees.
    count, cfg = space.most_refused()
    assert count == 2 and (cfg.pp, cfg.zero_stage, cfg.dp, cfg.framework) == (2, 2, 4, "deepspeed")


def test_indivisible_degrees_are_counted() -> None:
    # 12 heads on 8 GPUs: tp = 8 breaks the heads rule; global batch 6 excludes dp = 4 and 8.
    facts = ModelFacts(heads=(12,), kv_heads=12, routed_experts=0, units=24)
    _, rejected = degree_combinations(8, 8, 6, facts, Constraints(virtual_stages=(1,)))
    # (tp, pp, dp) over 8 GPUs: 10 combinations; valid: dp in {1, 2} with tp | 12 and tp <= 8
    valid, _ = degree_combinations(8, 8, 6, facts, Constraints(virtual_stages=(1,)))
    assert {(d.tp, d.pp, d.dp) for d in valid} == {(1, 4, 2), (1, 8, 1), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1)}
    assert rejected == 10 - 6 + 0  # the ep loop runs once per (tp, pp) for a dense model


def test_experts_must_divide_by_ep() -> None:
    space = enumerate_space(64, 8, 1024, MOE, Constraints(tp=(1,), pp=(1,)), anything_goes)
    assert set(space.columns["ep"]) == {1, 2, 4, 8}  # dp = 64: 16, 32, 64 do not divide 72


@pytest.mark.parametrize("name", list_presets())
def test_block_table_per_run_of_identical_blocks_equals_the_direct_call(name: str) -> None:
    from planner.cost.block_times import BlockTables, block_tables
    from planner.cost.efficiency import device
    from planner.cost.layers import layer_costs
    from planner.cost.layout import layout
    from planner.cost.parallel import Workload
    from planner.hardware.cluster import Cluster
    from planner.hardware.load import load_profile

    model = load_preset(name)
    vlm = model.vision is not None
    wl = Workload(global_batch=8, seq_len=2048, images_per_sample=1 if vlm else 0, tiles_per_image=2 if vlm else 0)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    dev = device(cluster.profile)
    for tp, sp, ep in ((1, False, 1), (2, True, 2 if model.is_moe else 1)):
        if model.attention_heads % tp or model.kv_heads % tp:
            continue
        shapes = layout(cluster, tp, ep, 16 // tp, 1)
        fast = BlockTables(model, cluster, wl, dev).table(tp, int(sp), ep, (1, 2))
        (direct,) = block_tables([(layer_costs(model, wl, tp, sp, ep), shapes.tp, shapes.ep)], (1, 2), dev, cluster)
        for f in ("fwd", "bwd", "rc", "tp", "ep", "params", "expert", "act", "act_live", "pp_bytes"):
            assert np.array_equal(getattr(fast, f), getattr(direct, f)), f


@pytest.mark.parametrize("name", ["deepseek-vl2", "mixtral-8x7b", "llama-3-8b"])
def test_tables_built_in_one_pass_equal_one_at_a_time(name: str) -> None:
    """BlockTables.prepare prices many (tp, sp, ep) groups side by side over the union of their
    micro-batch sizes; each table must hold exactly what building it alone gives."""
    from planner.cost.block_times import BlockTables
    from planner.cost.efficiency import device
    from planner.cost.parallel import Workload
    from planner.hardware.cluster import Cluster
    from planner.hardware.load import load_profile

    model = load_preset(name)
    vlm = model.vision is not None
    wl = Workload(global_batch=64, seq_len=2048, images_per_sample=1 if vlm else 0, tiles_per_image=2 if vlm else 0)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 8)
    eps = (1, 2, 8) if model.is_moe else (1,)
    groups = {(tp, sp, ep): micro
              for tp, sp in ((1, 0), (2, 0), (2, 1), (8, 1)) for ep in eps
              for micro in [(1, 2) if tp == 1 else (2, 4, 8)]}
    dev = device(cluster.profile)
    together = BlockTables(model, cluster, wl, dev)
    together.prepare(groups)
    for (tp, sp, ep), micro in groups.items():
        wide = together.table(tp, sp, ep, micro)
        assert wide.micro_batches == (1, 2, 4, 8)  # the union
        alone = BlockTables(model, cluster, wl, dev).table(tp, sp, ep, micro)
        for b in micro:
            i, j = wide.b_index(b), alone.b_index(b)
            for f in ("fwd", "bwd"):
                assert np.array_equal(getattr(wide, f)[i], getattr(alone, f)[j]), (tp, sp, ep, b, f)
            for f in ("rc", "tp", "ep"):
                assert np.array_equal(getattr(wide, f)[:, i], getattr(alone, f)[:, j]), (tp, sp, ep, b, f)
        for f in ("params", "expert", "act", "act_live", "pp_bytes"):
            assert np.array_equal(getattr(wide, f), getattr(alone, f)), (tp, sp, ep, f)


@pytest.mark.parametrize("name", list_presets())
def test_flops_per_step_per_run_of_identical_blocks_equals_model_flops(name: str) -> None:
    from planner.cost.estimate import model_flops
    from planner.cost.parallel import Workload
    from tests.scalar_oracle import model_flops as walked_flops

    model = load_preset(name)
    vlm = model.vision is not None
    wl = Workload(global_batch=32, seq_len=4096, images_per_sample=2 if vlm else 0, tiles_per_image=3 if vlm else 0)
    assert model_flops(model, wl) == walked_flops(model, wl)  # bitwise: same numbers, same order
