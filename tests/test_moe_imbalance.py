"""``--moe-imbalance F``: the busiest expert-parallel rank receives F x the mean token copies, and
every rank waits for it at each all-to-all, so its grouped GEMMs, permutes and received bytes
scale by F (1.0: the forced balance of NVIDIA's published MoE benchmarks)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import main
from planner.cost.layers import layer_costs
from planner.cost.parallel import Workload
from planner.model.catalog import load_model


def _moe(ep: int, f: float):
    w = Workload(global_batch=8, seq_len=4096, moe_imbalance=f)
    return next(c for c in layer_costs(load_model("mixtral-8x7b"), w, tp=1, sp=False, ep=ep) if c.ep_a2a_count)


def test_the_busiest_rank_gets_f_times_the_copies():
    """Mixtral: s x k x h x 2 bytes per dispatch, s x k / (8 / ep) rows per local expert GEMM."""
    s, k, h = 4096, 2, 4096
    even, busy = _moe(8, 1.0), _moe(8, 1.5)
    assert (even.ep_a2a, busy.ep_a2a) == (s * k * h * 2, 1.5 * s * k * h * 2)
    experts = [g for g in busy.gemms if g.batch == 1 and g.n == 2 * 14336]  # fc1 (gate + up) of the one local expert
    assert experts and experts[0].tokens == pytest.approx(1.5 * s * k / 1)
    assert busy.hbm_fwd > even.hbm_fwd
    # without expert parallelism every rank holds every expert: nothing to wait for
    assert _moe(1, 1.5).gemms == _moe(1, 1.0).gemms and _moe(1, 1.5).hbm_fwd == _moe(1, 1.0).hbm_fwd


def test_estimate_and_suggest_price_it_alike():
    cluster = api.load_cluster("dgx-h100", 1)
    kw = dict(global_batch=32, seq_len=4096, tp=1, pp=1, ep=8, micro_batch=1, zero=1, framework="megatron",
              recompute="full", offload="optimizer")
    even = api.estimate("mixtral-8x7b", cluster, **kw)
    busy = api.estimate("mixtral-8x7b", cluster, moe_imbalance=1.5, **kw)
    assert busy.step_time_s > even.step_time_s and busy.time.ep_comm > even.time.ep_comm
    assert busy.model_flops_per_step == even.model_flops_per_step  # the model's work, not the rank's
    out = api.suggest("mixtral-8x7b", cluster, moe_imbalance=1.5, top=1, **kw)
    assert out.plans[0].plan.step_time_s == pytest.approx(busy.step_time_s, rel=1e-9)
    assert busy.to_json()["moe_imbalance"] == 1.5


@pytest.mark.parametrize("command", ["estimate", "suggest"])
@pytest.mark.parametrize("value", ["0.5", "100", "nan"])
def test_out_of_range_is_one_message(command: str, value: str):
    r = CliRunner().invoke(main, [command, "--model", "mixtral-8x7b", "--hardware", "dgx-h100", "--ep", "8",
                                  "--moe-imbalance", value])
    assert r.exit_code == 2 and "--moe-imbalance: need a number from 1 to 64" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_plan_file_carries_it(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    r = CliRunner().invoke(main, ["generate", "--model", "mixtral-8x7b", "--hardware", "dgx-h100", "--ep", "8",
                                  "--pp", "1", "--framework", "megatron", "--recompute", "full", "--global-batch", "32",
                                  "--moe-imbalance", "1.25", "--entry", str(script), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["moe_imbalance"] == 1.25


def test_deepspeed_moe_runs_at_the_capacity_it_was_priced_at(tmp_path):
    """DeepSpeed's top-k gating sends fixed [experts, capacity, hidden] buffers: the ds_config's
    capacity factor and the reference trainer's MoE layers both take the planned imbalance, so
    every rank moves and computes the F x mean copies the plan priced at the busiest rank."""
    from planner.run.model_layers import MoEFeedForward

    r = CliRunner().invoke(main, ["generate", "--model", "mixtral-8x7b", "--hardware", "dgx-h100", "--ep", "8",
                                  "--pp", "1", "--framework", "deepspeed", "--zero", "1", "--global-batch", "32",
                                  "--moe-imbalance", "1.25", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    moe = json.loads((tmp_path / "run" / "moe.json").read_text())["deepspeed_moe"]
    assert moe["capacity_factor"] == moe["eval_capacity_factor"] == 1.25 and moe["drop_tokens"] is True
    # The trainer builds DeepSpeed's own gate with it (plan.moe_imbalance -> TopKGate.capacity_factor).
    mlp = load_model("mixtral-8x7b").decoder_blocks[0].mlp.model_copy(update={"expert_ffn": 32})
    gate = MoEFeedForward(64, mlp, 1, 1.25).experts.deepspeed_moe.gate
    assert (type(gate).__name__, gate.capacity_factor, gate.eval_capacity_factor) == ("TopKGate", 1.25, 1.25)
