"""torchtitan's per-op selective activation checkpointing (``--recompute op``): what a Llama 3
block keeps (the outputs of its 1st, 3rd, 5th and 7th matmul, SDPA's, the TP reduce-scatters'),
what it runs again, worked by hand; float8 keeping no matmul; the search choosing it."""

from __future__ import annotations

import numpy as np
import pytest

from planner import api
from planner.cost import efficiency as eff
from planner.cost.block_times import BlockTables
from planner.cost.context import CostContext
from planner.cost.parallel import RECOMPUTES, Workload
from planner.model.catalog import load_model
from tests.scalar_oracle import oracle_estimate

NONE, SELECTIVE, FULL, OP = (RECOMPUTES.index(m) for m in ("none", "selective", "full", "op"))
H, Q, KV, FFN, HEADS = 4096, 4096, 1024, 14336, 32  # Llama 3.1 8B: 32 query heads, 8 KV heads of 128
SEQ = 8192


def _table(cluster, tp: int, recipe: str | None = None):
    model = load_model("llama-3.1-8b")
    w = Workload(global_batch=8, seq_len=SEQ, precision=recipe or "bf16")
    ctx = CostContext.of(cluster, w)
    table = BlockTables(model, cluster, w, ctx.dev).table(tp, int(tp > 1), 1, (1,))
    layer = next(i for i, b in enumerate(model.blocks) if b.kind == "decoder")
    return table, layer, ctx.dev


@pytest.mark.parametrize(("tp", "per_token"), [
    # input, wq out, wv out, SDPA out, fp32 log-sum-exp, w1 out, w2 out
    (1, 2 * H + 2 * Q + 2 * KV + 2 * Q + 4 * HEADS + 2 * FFN + 2 * H),
    # under TP 2 with sequence parallelism: the input, the column shards and the two reduce-scatters'
    # outputs split by 2; w2's output (before its reduce-scatter) is whole
    (2, (2 * H + 2 * Q + 2 * KV + 2 * Q + 4 * HEADS + 2 * FFN) / 2 + 2 * H + 2 * (2 * H / 2)),
])
def test_kept_bytes_by_hand(tp, per_token) -> None:
    table, layer, _ = _table(api.load_cluster("h100-grand-teton", nodes=1), tp)
    assert table.act[OP, layer] == pytest.approx(per_token * SEQ, rel=1e-12)
    assert table.act[FULL, layer] < table.act[OP, layer] < table.act[NONE, layer]


def test_runs_again_all_but_the_attention_and_the_kept_matmuls() -> None:
    table, layer, dev = _table(api.load_cluster("h100-grand-teton", nodes=1), 1)
    kept = sum(float(eff.gemm_time(SEQ, n, k, dev)) for n, k in ((Q, H), (KV, H), (FFN, H), (H, FFN)))
    rc = table.rc[:, 0, layer]
    # full reruns the forward; selective (flash) the attention core alone; op the rest but the kept GEMMs
    assert rc[FULL] - rc[OP] - rc[SELECTIVE] == pytest.approx(kept, rel=1e-9)
    assert 0.3 * rc[FULL] < rc[OP] < 0.6 * rc[FULL]


def test_float8_keeps_no_matmul() -> None:
    """torchao's Float8Linear multiplies with _scaled_mm, which the policy neither counts nor keeps."""
    table, layer, _ = _table(api.load_cluster("h100-grand-teton", nodes=1), 1, "fp8-tensorwise")
    assert table.act[OP, layer] == pytest.approx((2 * H + 2 * Q + 4 * HEADS) * SEQ, rel=1e-12)
    rc = table.rc[:, 0, layer]
    assert rc[FULL] - rc[OP] == pytest.approx(rc[SELECTIVE], rel=1e-12)


def test_tp_reruns_the_all_gathers_only_and_matches_the_oracle() -> None:
    cluster = api.load_cluster("h100-grand-teton", nodes=1)
    table, layer, _ = _table(cluster, 2)
    tp = table.tp[:, 0, layer]
    assert tp[NONE] < tp[OP] < tp[FULL]
    model = load_model("llama-3.1-8b")
    for recompute in ("op", "full", "none"):
        plan = api.estimate(model, cluster, framework="torchtitan", zero=3, tp=2, sequence_parallel=True,
                            micro_batch=1, global_batch=16, seq_len=SEQ, recompute=recompute)
        oracle = oracle_estimate(model, cluster, plan.workload, plan.cfg, partition=plan.partition)
        assert plan.step_time_s == pytest.approx(oracle.step_time_s, rel=1e-9)
        assert plan.time.recompute == pytest.approx(oracle.time.recompute, rel=1e-9)
        assert plan.time.tp_comm == pytest.approx(oracle.time.tp_comm, rel=1e-9)


def test_the_search_picks_it_where_keeping_everything_does_not_fit() -> None:
    """torchtitan's Table 1 layout (8B, FSDP over 8 GPUs, 2 x 8192 tokens per GPU): without
    checkpointing it needs more than the GPU's 96 GiB, with full checkpointing it reruns every
    forward; the per-op policy fits and runs faster, and suggest ranks it first."""
    cluster = api.load_cluster("h100-grand-teton", nodes=1)
    pins = dict(framework="torchtitan", zero=3, tp=1, pp=1, cp=1, micro_batch=2, offload="none")
    best = api.suggest("llama-3.1-8b", cluster, global_batch=16, seq_len=SEQ, top=3, **pins).plans
    assert best[0].plan.cfg.recompute == "op" and best[0].plan.fits
    assert [p.plan.cfg.recompute for p in best] == ["op", "full"]  # "none" does not fit
    est = {rc: api.estimate("llama-3.1-8b", cluster, global_batch=16, seq_len=SEQ, recompute=rc,
                            **pins) for rc in ("none", "op", "full")}
    assert not est["none"].fits and est["op"].fits
    assert est["op"].step_time_s == best[0].plan.step_time_s
    assert est["none"].step_time_s < est["op"].step_time_s < est["full"].step_time_s
    assert np.isclose(est["op"].memory.peak, best[0].plan.memory.peak, rtol=1e-12)


@pytest.mark.parametrize(("framework", "says"), [
    ("megatron", "framework megatron has none"), ("deepspeed", "framework deepspeed has none")])
def test_other_runtimes_refuse_it(framework, says) -> None:
    from planner.errors import UserError

    with pytest.raises(UserError, match=says):
        api.estimate("llama-3.1-8b", api.load_cluster("dgx-h100", nodes=1), framework=framework, zero=1,
                     recompute="op", global_batch=64, seq_len=4096)


def test_suggest_prints_torchtitan_plans_and_explains_op() -> None:
    from click.testing import CliRunner

    from planner.cli import main

    r = CliRunner().invoke(main, ["suggest", "--model", "llama-3.1-8b", "--hardware", "h100-grand-teton",
                                  "--global-batch", "16", "--seq-len", str(SEQ), "--framework", "torchtitan",
                                  "--zero", "3", "--micro-batch", "2", "--top", "2"])
    assert r.exit_code == 0, r.output
    assert "torchtitan" in r.output and "recompute op = torchtitan's per-op selective activation checkpointing" \
        in " ".join(r.output.split())
