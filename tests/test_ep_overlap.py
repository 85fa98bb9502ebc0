"""Megatron-Core's expert all-to-all overlap (``--overlap-moe-expert-parallel-comm``): the combined
1F1B runs one micro-batch's forward beside another's backward, each one's dispatch and combine
under the other's compute. Hand calculations from the block table against estimate and suggest,
the passes it cannot merge, where it does not apply, its memory, and the flags it emits."""

from __future__ import annotations

import numpy as np
import pytest

from planner import api
from planner.cost.block_times import BlockTables
from planner.cost.context import CostContext
from planner.cost.estimate import estimate
from planner.cost.paid import merged_share
from planner.cost.parallel import RECOMPUTES, ParallelConfig, Workload
from planner.emit.megatron_args import megatron_lm_args
from planner.emit.nccl import nccl_env
from planner.model.catalog import load_model
from tests.test_emit_ds_config import make_plan

S, B = 4096, 1


def _plan(m: int, overlap: bool, **cfg):
    """Mixtral-8x7B on one DGX H100, ep = dp, m micro-batches of one sample, through ``estimate``."""
    model, cluster = load_model("mixtral-8x7b"), api.load_cluster("dgx-h100", 1)
    dp = 8 // cfg.get("pp", 1)
    kw = dict(dp=dp, ep=dp, zero_stage=1, framework="megatron", micro_batch=B, grad_accum=m) | cfg
    w = Workload(global_batch=kw["dp"] * B * m, seq_len=S, ep_comm_overlap=overlap)
    c = ParallelConfig(**kw)
    return estimate(model, cluster, w, c), model, cluster, w, c


def test_merged_share_counts_megatrons_warm_up_passes():
    """pp 1: all but the first forward and the last backward, (m - 1) / m. Interleaved, rank r of
    pp: (pp - r - 1) x 2 + (vs - 1) x pp warm-up chunk passes of m x vs (schedules.py)."""
    assert merged_share(np.array(0), np.array(1), np.array(1), np.array(4)) == pytest.approx(3 / 4)
    assert merged_share(np.array(0), np.array(1), np.array(1), np.array(1)) == 0.0
    ranks = np.arange(4)
    got = merged_share(ranks, np.full(4, 4), np.full(4, 4), np.full(4, 64))
    warm = (4 - ranks - 1) * 2 + 3 * 4
    assert got == pytest.approx(1 - warm / 256)
    assert merged_share(np.array(0), np.array(4), np.array(2), np.array(2)) == 0.0  # all warm-up


@pytest.mark.parametrize("m", [2, 4])
def test_exposed_all_to_all_by_hand_from_the_block_table(m: int):
    """Per MoE block: ep seconds off, max(0, ep - (fwd + bwd)) in a merged pair; a step pays
    m x (ep - share x (ep - merged)), share = (m - 1) / m."""
    on, model, cluster, w, c = _plan(m, True)
    off = _plan(m, False)[0]
    table = BlockTables(model, cluster, w, CostContext.of(cluster, w).dev).table(1, 0, 8, (B,))
    none = RECOMPUTES.index("none")
    ep, merged = table.ep[none, 0], np.maximum(table.ep[none, 0] - (table.fwd[0] + table.bwd[0]), 0.0)
    share = (m - 1) / m
    assert off.time.ep_comm == pytest.approx(m * ep.sum(), rel=1e-9)
    assert on.time.ep_comm == pytest.approx(m * (ep - share * (ep - merged)).sum(), rel=1e-9)
    assert on.time.ep_comm < off.time.ep_comm
    assert on.step_time_s < off.step_time_s


def test_not_where_megatron_cannot_run_it():
    """Full recomputation (Megatron refuses it), a pipeline without virtual stages (asserted),
    no expert parallelism, or another runtime: priced exposed, as with the overlap off."""
    for cfg in ({"recompute": "full"}, {"pp": 2}, {"framework": "deepspeed", "zero_stage": 2}):
        on, off = _plan(4, True, **cfg)[0], _plan(4, False, **cfg)[0]
        assert on.time.ep_comm == pytest.approx(off.time.ep_comm, rel=1e-12), cfg
        assert on.time.ep_comm > 0
    on, off = _plan(4, True, pp=2, virtual_stages=2)[0], _plan(4, False, pp=2, virtual_stages=2)[0]
    assert on.time.ep_comm < off.time.ep_comm


def test_two_micro_batches_in_flight_without_a_pipeline():
    """The next micro-batch's forward runs before this one's backward frees its activations."""
    on, off = _plan(4, True)[0], _plan(4, False)[0]
    assert (on.stages[0].inflight, off.stages[0].inflight) == (2.0, 1.0)
    assert on.stages[0].memory.activations == pytest.approx(2 * off.stages[0].memory.activations, rel=0.02)
    assert _plan(1, True)[0].stages[0].inflight == 1.0  # one micro-batch: nothing to merge


def test_suggest_prices_it_as_estimate_does():
    plan, model, cluster, w, c = _plan(4, True, pp=2, virtual_stages=2)
    out = api.suggest(model, cluster, global_batch=w.global_batch, seq_len=S, tp=1, pp=2, ep=4, dp=4,
                      virtual_stages=2, micro_batch=B, zero=1, framework="megatron", recompute="none", top=1)
    best = out.plans[0].plan
    again = estimate(model, cluster, w, best.cfg, partition=best.partition)
    assert best.step_time_s == pytest.approx(again.step_time_s, rel=1e-9)
    assert best.time.ep_comm == pytest.approx(again.time.ep_comm, rel=1e-9)


def _flags(**overrides) -> set[str]:
    plan, model = make_plan("mixtral-8x7b", 1, framework="megatron", ep=4, grad_accum=4, **overrides)
    return {a.flag for a in megatron_lm_args(model, plan)}


def test_emitted_as_priced():
    want = {"--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"}
    assert want <= _flags()
    assert not want & _flags(recompute="full")
    assert not want & _flags(ep_comm_overlap=False)
    assert not want & _flags(pp=2)  # no virtual stages
    assert want <= _flags(pp=2, virtual_stages=2)
    plan, _ = make_plan("mixtral-8x7b", 1, framework="megatron", ep=8, grad_accum=4)
    env = {e.name: e.value for e in nccl_env(api.load_hardware("dgx-h100"), plan)}
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


def test_the_reference_trainer_is_planned_and_checked_without_it():
    """The trainer runs DeepSpeed MoE: its search prices the all-to-alls exposed, and a plan
    priced with the overlap is refused before any rank starts."""
    from planner.cli.trainer_plans import trainer_pins
    from planner.errors import UserError
    from planner.run.rundir import check_reference_trainer

    opts: dict = {}
    trainer_pins(opts, is_moe=True)
    assert opts["ep_comm_overlap"] is False
    with pytest.raises(UserError, match="--ep-comm-overlap: the reference trainer"):
        trainer_pins({"ep_comm_overlap": True}, is_moe=True)
    plan, model = make_plan("mixtral-8x7b", 1, framework="megatron", ep=4, grad_accum=4)
    with pytest.raises(UserError, match="ep_comm_overlap is true"):
        check_reference_trainer(plan, {}, is_moe=True)
    plan, _ = make_plan("mixtral-8x7b", 1, framework="megatron", ep=4, grad_accum=4, ep_comm_overlap=False)
    check_reference_trainer(plan, {}, is_moe=True)
