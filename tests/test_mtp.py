"""Multi-token prediction (``--mtp-layers N``, DeepSeek-V3's MTP module): each depth is one more
layer of the model's last kind, a 2h -> h projection with its norms, and the shared embedding
and head run again, on the last pipeline stage. The preset trains its published one by
default, 0 plans the main model; priced in the one cost model, refused off Megatron-Core, and
emitted as Megatron-LM's --mtp-num-layers (and an ``m`` in a custom pipeline layout)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.layers import ACT, layer_costs
from planner.model.catalog import load_model

LITE = "deepseek-v2-lite"  # 27 layers, 64 experts: small enough to price in a test
SEQ = 4096


def test_an_mtp_depth_costs_its_layer_its_projection_and_the_shared_head_again():
    model = load_model(LITE).with_mtp_layers(1)
    workload = api.make_workload(model, global_batch=8, seq_len=SEQ)
    t = 2
    costs = layer_costs(model, workload, t, True, 1)
    layer, head, mtp = costs[-4], costs[-2], costs[-1]
    assert (layer.kind, head.kind, mtp.kind) == ("decoder", "lm_head", "mtp")
    h, v = model.hidden, model.vocab
    projection = 2.0 * SEQ * (h / t) * 2 * h
    assert mtp.gemm_flops == pytest.approx(layer.gemm_flops + projection + head.gemm_flops)
    assert mtp.attn == layer.attn and mtp.ep_a2a == layer.ep_a2a
    block = model.blocks[-1]
    assert mtp.params == block.params() == layer.params + 2 * h * h + 3 * h  # its layer, projection, 3 RMSNorms
    assert mtp.params_rank == pytest.approx(layer.params_rank + 2 * h * h / t + 3 * h)  # embedding, head: shared
    # kept for backward besides the layer's: the head's input and fp32 logits, the projection's and norms' inputs
    kept = (ACT * h / t + 4.0 * v / t) * SEQ + (2 * ACT * h / t + 3 * ACT * h / t) * SEQ
    assert mtp.act["selective"] == pytest.approx(layer.act["selective"] + kept)


def _cluster():
    return api.load_cluster("dgx-h100", nodes=2)


def _pins(**kw):
    return {"framework": "megatron", "tp": 1, "pp": 2, "ep": 8, "micro_batch": 1, "recompute": "selective",
            "global_batch": 64, "seq_len": SEQ, "zero": 1, **kw}


def test_mtp_adds_its_work_and_weights_to_the_last_stage():
    main_only = api.estimate(LITE, _cluster(), mtp_layers=0, **_pins())
    with_mtp = api.estimate(LITE, _cluster(), mtp_layers=1, **_pins())
    assert (main_only.workload.mtp_layers, with_mtp.workload.mtp_layers) == (0, 1)
    assert with_mtp.to_json()["mtp_layers"] == 1
    model = load_model(LITE)
    mtp = model.with_mtp_layers(1).blocks[-1]
    # model FLOPs grow by the depth's forward x 3: its layer, projection and head
    extra = with_mtp.model_flops_per_step - main_only.model_flops_per_step
    assert extra > 0 and extra == pytest.approx(
        3 * 64 * sum(c.fwd_flops for c in layer_costs(model.with_mtp_layers(1), with_mtp.workload)[-1:]), rel=1e-9)
    assert with_mtp.step_time_s > main_only.step_time_s
    grown = [a.memory.weights - b.memory.weights for a, b in zip(with_mtp.stages, main_only.stages)]
    # the last stage holds the depth's weights and a copy of the embedding it looks the next tokens up in
    assert grown[0] == pytest.approx(0.0, abs=1.0)
    assert grown[-1] > 2 * (mtp.own_params() + model.vocab * model.hidden)


def test_the_preset_trains_its_published_depth_unless_told_otherwise():
    v3 = api.make_workload("deepseek-v3", global_batch=64)
    assert v3.mtp_layers == 1 and api.make_workload("deepseek-v3", global_batch=64, mtp_layers=0).mtp_layers == 0
    assert api.make_workload("qwen3-30b-a3b", global_batch=64).mtp_layers == 0


def test_runtimes_without_mtp_are_refused_and_the_search_keeps_megatron():
    r = CliRunner().invoke(main, ["estimate", "--model", "deepseek-v3", "--hardware", "dgx-h100", "--nodes", "32",
                                  "--ep", "8", "--pp", "8", "--global-batch", "512"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--mtp-layers 0" in lines[0] and "--framework megatron" in lines[0], r.output
    ok = CliRunner().invoke(main, ["estimate", "--model", "deepseek-v3", "--hardware", "dgx-h100", "--nodes", "32",
                                   "--ep", "8", "--pp", "8", "--global-batch", "512", "--mtp-layers", "0",
                                   "--allow-oom"])
    assert ok.exit_code == 0, ok.output
    out = api.suggest(LITE, _cluster(), mtp_layers=1, global_batch=64, seq_len=SEQ, top=3)
    assert out.inputs["mtp_layers"] == 1 and all(p.plan.cfg.framework == "megatron" for p in out.plans)


@pytest.mark.parametrize("value", ["-1", "17", "x"])
def test_a_depth_out_of_range_is_one_clear_error(value):
    r = CliRunner().invoke(main, ["estimate", "--model", LITE, "--hardware", "dgx-h100", "--nodes", "1",
                                  "--framework", "megatron", "--mtp-layers", value])
    assert r.exit_code == 2 and "--mtp-layers" in r.output and "Traceback" not in r.output, r.output


def test_generate_tells_megatron_the_depth_and_places_it_last(tmp_path):
    r = CliRunner().invoke(main, ["estimate", "--model", LITE, "--hardware", "dgx-h100", "--nodes", "2", "--json",
                                  "--allow-oom", "--mtp-layers", "1", "--stage-blocks", "0-12,12-31",
                                  *[f"--{k.replace('_', '-')}={v}" for k, v in _pins().items()]])
    assert r.exit_code == 0, r.output
    plan = tmp_path / "plan.json"
    plan.write_text(r.stdout)
    assert json.loads(r.stdout)["mtp_layers"] == 1
    entry = tmp_path / "pretrain_gpt.py"
    entry.write_text("# Megatron-LM's entry point stands here\n")
    g = CliRunner().invoke(main, ["generate", "--plan", str(plan), "--entry", str(entry), "--out",
                                  str(tmp_path / "run")])
    assert g.exit_code == 0, g.output
    args = (tmp_path / "run" / "megatron_args.sh").read_text()
    assert "--mtp-num-layers 1" in args
    layout = args.split("--pipeline-model-parallel-layout")[1].split()[0].strip("'\"")
    assert layout.endswith("mL") and layout.count("t") == 27, layout


@pytest.mark.parametrize("pins", [_pins(), _pins(pp=1, ep=16), _pins(tp=2, pp=2, ep=4, sequence_parallel=True)])
def test_the_scalar_oracle_prices_the_mtp_depth_alike(pins):
    """The array model against the independent scalar walk (tests/scalar_oracle.py) to 1e-9."""
    from tests.scalar_oracle import oracle_estimate

    plan = api.estimate(LITE, _cluster(), mtp_layers=1, **pins)
    oracle = oracle_estimate(load_model(LITE), _cluster(), plan.workload, plan.cfg, partition=plan.partition)
    assert plan.workload.mtp_layers == oracle.workload.mtp_layers == 1
    assert plan.step_time_s == pytest.approx(oracle.step_time_s, rel=1e-9)
    assert plan.memory.peak == pytest.approx(oracle.memory.peak, rel=1e-9)
