"""Expert tensor parallelism (``--etp``, MoE parallel folding): the routed experts keep the
attention's TP (etp = tp, Megatron-Core's default) or leave it (etp 1), and then their
expert-parallel ranks take the TP ranks too, so EP divides tp x dp x cp. Priced in the one cost
model (per-rank expert weights and GEMMs, the all-to-all over the wider EP group, no expert-TP
gather), searched by ``suggest`` as its own search, refused where the runtime has none, and
emitted as Megatron-LM's --expert-tensor-parallel-size and torchtitan's
expert_tensor_parallel_degree."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.layers import ACT, layer_costs
from planner.cost.parallel import ParallelConfig
from planner.model.catalog import load_model
from tests.test_torchtitan import parse_with_torchtitan

MODEL = "qwen3-30b-a3b"  # 128 experts, top 8, no shared expert
SEQ = 4096


def _moe_layer(tp: int, ep: int, etp: int | None):
    model = load_model(MODEL)
    workload = api.make_workload(model, global_batch=16, seq_len=SEQ)
    costs = layer_costs(model, workload, tp, True, ep, etp=etp)
    return model, next(c for c in costs if c.ep_a2a > 0)


def test_folded_experts_hold_their_whole_width_over_twice_the_expert_ranks():
    """tp 2: folded (etp 1, ep 16) against on TP (etp 2, ep 8): the same expert FLOPs per GPU,
    the same weights per GPU, each rank's own tokens sent over EP, and no expert-TP gather."""
    model, folded = _moe_layer(2, 16, 1)
    _, on_tp = _moe_layer(2, 8, None)
    moe = next(b.mlp for b in model.blocks if getattr(getattr(b, "mlp", None), "kind", None) == "moe")
    h, e, k = model.blocks[1].hidden, moe.routed_experts, moe.top_k
    per_expert = moe.expert_params(h)
    assert folded.expert_params_rank == pytest.approx(e * per_expert / 16)  # etp 1 x ep 16
    assert on_tp.expert_params_rank == pytest.approx(e * per_expert / (2 * 8))

    def expert_flops(c):
        return sum(g.flops for g in c.gemms if g.batch > 1)

    # tokens x top_k / tp copies per GPU, whole experts (3 matrices of h x ffn: gate, up, down)
    assert expert_flops(folded) == pytest.approx(2 * SEQ * k / 2 * 3 * h * moe.expert_ffn)
    assert expert_flops(folded) == pytest.approx(expert_flops(on_tp))
    grouped = [g for g in folded.gemms if g.batch > 1]
    assert all(g.batch == e // 16 for g in grouped)  # 8 local experts
    assert grouped[0].tokens == pytest.approx(SEQ * k / 2 / 8)  # each local expert's copies
    assert grouped[0].n == 2 * moe.expert_ffn  # gate and up at full width (no TP split)
    assert folded.ep_a2a == pytest.approx(on_tp.ep_a2a) == pytest.approx(SEQ * k * h * ACT / 2)
    # TP: the attention's gather/reduce-scatter pair only; on TP the experts add their own pair
    # over the gathered copies (k x the layer's tokens)
    assert folded.tp_fwd == (("allgather", SEQ * h * ACT), ("reducescatter", SEQ * h * ACT))
    assert on_tp.tp_fwd[2:] == (("allgather", SEQ * k * h * ACT), ("reducescatter", SEQ * k * h * ACT))


@pytest.mark.parametrize("dp, ep, etp, ok", [
    (8, 16, 1, True),    # ep over tp 2 x dp 8
    (8, 16, 2, False),   # on TP, ep must divide dp 8
    (8, 32, 1, False),   # 32 does not divide 16
    (8, 8, 3, False),    # etp is 1 or tp
])
def test_the_expert_group_fits_the_ranks_it_folds(dp, ep, etp, ok):
    cfg = dict(dp=dp, tp=2, ep=ep, etp=etp, framework="megatron", sequence_parallel=True)
    if ok:
        c = ParallelConfig(**cfg)
        assert (c.expert_tp, c.expert_dp) == (1, dp * 2 // ep)
    else:
        with pytest.raises(ValueError):
            ParallelConfig(**cfg)


def test_an_unset_expert_tp_is_the_attention_tp():
    assert ParallelConfig(dp=4, tp=2, ep=2).etp == 2
    assert ParallelConfig(dp=4, tp=2, ep=2) == ParallelConfig(dp=4, tp=2, ep=2, etp=2)


def test_the_folded_expert_group_takes_the_tp_ranks_first():
    cluster = api.load_cluster("dgx-h100", nodes=2)
    from planner.cost.layout import layout

    folded, on_tp = layout(cluster, 2, 16, 8, 1, 1, 1), layout(cluster, 2, 8, 8, 1, 1, 2)
    assert (folded.ep.size, folded.ep.stride, folded.edp.size) == (16, 1, 1)
    assert (on_tp.ep.size, on_tp.ep.stride, on_tp.edp.size) == (8, 2, 1)
    assert folded.tp == on_tp.tp and folded.tp.size == 2


def _pins(**kw):
    return {"framework": "megatron", "tp": 2, "pp": 1, "ep": 16, "micro_batch": 1, "recompute": "selective",
            "sequence_parallel": True, "global_batch": 64, "seq_len": SEQ, "zero": 1, **kw}


def test_suggest_prices_a_folded_plan_as_estimate_does_and_searches_it_unasked():
    cluster = api.load_cluster("dgx-h100", nodes=2)
    alone = api.estimate(MODEL, cluster, etp=1, **_pins())
    best = api.suggest(MODEL, cluster, top=1, **_pins()).plans[0].plan  # ep 16 > dp 8: only folded plans
    assert best.cfg.etp == 1 and best.cfg == alone.cfg
    assert best.step_time_s == pytest.approx(alone.step_time_s, rel=1e-9)
    assert best.memory.peak == pytest.approx(alone.memory.peak, rel=1e-9)
    assert best.to_json()["etp"] == 1
    # the experts' gradients reduce over no one (ep 16 = tp x dp): only dense DP traffic remains
    on_tp = api.estimate(MODEL, cluster, **_pins(ep=8))
    assert on_tp.cfg.etp == 2 and alone.time.tp_comm < on_tp.time.tp_comm


@pytest.mark.parametrize("args, words", [
    (["--etp", "3"], ["--etp 3", "1 or 2"]),
    (["--etp", "1", "--framework", "megatron-deepspeed", "--zero", "1"], ["--etp 1", "megatron or torchtitan"]),
    (["--etp", "1", "--framework", "megatron"], ["--sequence-parallel"]),
    (["--etp", "2", "--ep", "16", "--framework", "megatron", "--sequence-parallel"], ["ep (16)", "dp x cp (8)"]),
])
def test_expert_tp_the_plan_cannot_take_is_one_clear_error(args, words):
    r = CliRunner().invoke(main, ["estimate", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "2", "--tp", "2",
                                  "--ep", "8", "--global-batch", "64", *args])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert all(w in lines[0] for w in words), r.output


def test_suggest_names_the_folded_plans_and_refuses_other_values():
    r = CliRunner().invoke(main, ["suggest", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "2", "--tp", "2",
                                  "--ep", "16", "--framework", "megatron", "--global-batch", "64", "--top", "2"])
    assert r.exit_code == 0, r.output
    assert "16f" in r.output and "folded out of TP" in r.output, r.output
    bad = CliRunner().invoke(main, ["suggest", "--model", MODEL, "--hardware", "dgx-h100", "--nodes", "2",
                                    "--etp", "2"])
    assert bad.exit_code == 2 and "--etp" in bad.output and "1, tp" in bad.output, bad.output


def _plan(tmp_path, model: str, *flags: str):
    r = CliRunner().invoke(main, ["estimate", "--model", model, "--hardware", "dgx-h100", "--nodes", "2", "--json",
                                  "--allow-oom", "--tp", "2", "--etp", "1", "--ep", "16", "--global-batch", "64",
                                  "--seq-len", str(SEQ), *flags])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["etp"] == 1
    path = tmp_path / "plan.json"
    path.write_text(r.stdout)
    return path


def test_generate_tells_megatron_and_torchtitan_the_experts_tp(tmp_path):
    entry = tmp_path / "pretrain_gpt.py"
    entry.write_text("# Megatron-LM's entry point stands here\n")
    plan = _plan(tmp_path, MODEL, "--framework", "megatron", "--sequence-parallel", "--zero", "1")
    r = CliRunner().invoke(main, ["generate", "--plan", str(plan), "--entry", str(entry), "--out",
                                  str(tmp_path / "mg")])
    assert r.exit_code == 0, r.output
    args = (tmp_path / "mg" / "megatron_args.sh").read_text()
    assert "--expert-tensor-parallel-size 1" in args and "--expert-model-parallel-size 16" in args
    assert "experts off TP" in r.output
    plan = _plan(tmp_path, "deepseek-v2-lite", "--framework", "torchtitan", "--sequence-parallel", "--zero", "3")
    r = CliRunner().invoke(main, ["generate", "--plan", str(plan), "--out", str(tmp_path / "tt")])
    assert r.exit_code == 0, r.output
    p = parse_with_torchtitan(tmp_path / "tt" / "torchtitan.toml").parallelism
    assert (p.tensor_parallel_degree, p.expert_parallel_degree, p.expert_tensor_parallel_degree) == (2, 16, 1)


@pytest.mark.parametrize("pins", [_pins(etp=1), _pins(etp=1, recompute="full", pp=2, ep=8),
                                  _pins(ep=8, etp=2, zero=3, pp=1)])
def test_the_scalar_oracle_prices_folded_and_unfolded_experts_alike(pins):
    """The array model against the independent scalar walk (tests/scalar_oracle.py) to 1e-9."""
    from tests.scalar_oracle import oracle_estimate

    cluster = api.load_cluster("dgx-h100", nodes=2)
    plan = api.estimate(MODEL, cluster, **pins)
    oracle = oracle_estimate(load_model(MODEL), cluster, plan.workload, plan.cfg, partition=plan.partition)
    assert plan.step_time_s == pytest.approx(oracle.step_time_s, rel=1e-9)
    assert plan.memory.peak == pytest.approx(oracle.memory.peak, rel=1e-9)
