"""Pipeline hops inside a node go over NVLink, the ones between nodes over the network: a pp
group that spans nodes is not priced at the network rate on every hop."""

from __future__ import annotations

import pytest

from planner.cost.collectives import collective_seconds
from planner.cost.estimate import estimate
from planner.cost.parallel import ParallelConfig, Workload
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.hardware.placement import Placement, pipeline_hops
from planner.model.catalog import load_model
from planner.search.space import Constraints
from planner.search.suggest import suggest
from tests.scalar_oracle import build_comms


def cluster(nodes: int) -> Cluster:
    return Cluster.build(load_profile("dgx-a100-80g"), nodes)


def test_hops_leave_the_node_only_where_the_ranks_do() -> None:
    c = cluster(2)
    # tp x dp = 2 on 8-GPU nodes: pp ranks 0-3 on node 0, 4-7 on node 1; 3 -> 4 and 7 -> 0 cross.
    crosses, near = pipeline_hops(c, 2, 8)
    assert crosses == (False, False, False, True, False, False, False, True)
    assert near is not None and near.size == 2 and not near.crosses_nodes
    # Checked against the placement's own ranks: hop r -> r + 1 crosses iff the GPUs' nodes differ.
    ranks = Placement(c, {"tp": 1, "dp": 2, "pp": 8}, ("tp", "dp", "pp")).ranks("pp")
    assert crosses == tuple(ranks[r] // 8 != ranks[(r + 1) % 8] // 8 for r in range(8))
    # A node per stage: every hop crosses; a pipeline inside one node: none does. One shape prices all.
    assert pipeline_hops(c, 8, 2) == ((True, True), None)
    assert pipeline_hops(c, 4, 2)[0] == (False, False) and pipeline_hops(c, 4, 2)[1] is None


def test_estimate_prices_each_hop_by_the_link_it_takes() -> None:
    c = cluster(2)
    model = load_model("llama-3.1-8b")
    cfg = ParallelConfig(dp=2, tp=1, pp=8, micro_batch=1, grad_accum=32, framework="megatron", zero_stage=1)
    plan = estimate(model, c, Workload(global_batch=64, seq_len=8192), cfg)
    comms = build_comms(c, cfg)
    nbytes = 8192 * 4096 * 2  # one micro-batch's (s, b, h) bf16 activation, sent whole (no SP)
    far, near = comms.pp(nbytes), comms.pp_near(nbytes)
    placement = Placement(c, {"tp": 1, "ep": 1, "dp": 2, "pp": 8}, ("tp", "ep", "dp", "pp"))
    assert far == pytest.approx(collective_seconds(c, "p2p", placement.group("pp"), nbytes))
    assert near < far / 5  # NVLink against one NIC's share
    per_rank = [s.microbatch.pp for s in plan.stages]
    # ends send or receive once, the rest do both; ranks 3 and 4 take the hop between nodes
    expected = [near, 2 * near, 2 * near, near + far, far + near, 2 * near, 2 * near, near]
    assert per_rank == pytest.approx(expected, rel=1e-9)


def test_the_search_prices_hops_as_estimate_does() -> None:
    """The vectorised evaluation and estimate agree on plans whose hops are mixed, interleaved
    ones (whose last chunk wraps from the last rank to the first) included."""
    c = cluster(2)
    model = load_model("llama-3.1-8b")
    for cons in (Constraints(pp=(8,), tp=(1,), framework=("megatron",)),
                 Constraints(pp=(4,), tp=(2,), virtual_stages=(2,), framework=("megatron",)),
                 Constraints(pp=(8,), tp=(1,), framework=("megatron-deepspeed",))):
        res = suggest(model, nodes=2, constraints=cons, top=3)
        assert res.plans
        for rp in res.plans:
            p = rp.plan
            assert pipeline_hops(c, p.cfg.tp * p.cfg.dp_ranks, p.cfg.pp)[1] is not None  # mixed hops
            again = estimate(model, c, p.workload, p.cfg, partition=p.partition)
            assert again.step_time_s == pytest.approx(p.step_time_s, rel=1e-9)
            assert again.time.pp_comm == pytest.approx(p.time.pp_comm, rel=1e-9)
