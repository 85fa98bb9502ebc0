"""The checkpoint and goodput model (planner/cost/checkpoint_io.py, planner/cost/goodput.py):
Daly's closed form against a simulated failure process, his interval against a brute-force
optimum, the MTBF against Llama 3's report, the checkpoint sizes against the bytes the runtimes
write, and the CLI around them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from planner.api import estimate, load_cluster, make_workload
from planner.cli import main
from planner.cost.candidates import columns_of
from planner.cost.checkpoint_io import checkpoint_arrays
from planner.cost.goodput import daly_interval, goodput, job_mtbf_s, schedule
from planner.cost.parallel import ParallelConfig, Workload
from planner.hardware.load import load_profile
from planner.model.catalog import load_model

H = 3600.0


def run_cli(args: list[str]):
    return CliRunner().invoke(main, args)


def _simulate(tau: float, delta: float, restart: float, mtbf: float, work: float, seed: int) -> float:
    """Wall time to finish ``work`` seconds of compute under Poisson failures: segments of tau
    compute + delta save; a failure anywhere (restarts included) loses the segment in progress."""
    rng = np.random.default_rng(seed)
    wall, done = 0.0, 0.0
    next_failure = rng.exponential(mtbf)
    pending_restart = 0.0
    while done < work:
        need = pending_restart + tau + delta
        if next_failure >= need:
            wall += need
            next_failure -= need
            done += tau
            pending_restart = 0.0
        else:
            wall += next_failure
            next_failure = rng.exponential(mtbf)
            pending_restart = restart
    return wall


def test_goodput_matches_a_simulated_failure_process() -> None:
    tau, delta, restart, mtbf = 0.8 * H, 0.05 * H, 0.2 * H, 6 * H
    work = 4000 * H
    walls = [_simulate(tau, delta, restart, mtbf, work, seed) for seed in range(4)]
    simulated = work / np.mean(walls)
    assert float(goodput(tau, delta, restart, mtbf)) == pytest.approx(simulated, rel=0.01)
    assert 0.75 < simulated < 0.9  # the case weighs failures: not the trivial tau / (tau + delta)


def test_goodput_without_failures_is_the_save_overhead() -> None:
    assert float(goodput(100.0, 5.0, 300.0, 1e12)) == pytest.approx(100 / 105, rel=1e-6)


@pytest.mark.parametrize(("delta", "mtbf"), [(2.0, 49 * H), (60.0, 3 * H), (600.0, 2 * H)])
def test_daly_interval_is_the_optimum_of_the_goodput_it_prices(delta, mtbf) -> None:
    taus = np.linspace(1.0, 8 * np.sqrt(2 * delta * mtbf), 200_001)
    best = taus[np.argmax(goodput(taus, delta, 300.0, mtbf))]
    tau = float(daly_interval(np.array([delta]), mtbf)[0])
    assert tau == pytest.approx(best, rel=0.02)
    young = np.sqrt(2 * delta * mtbf)
    assert 0.8 * young < tau < 1.05 * young  # Young's first-order estimate, within its known error


def test_job_mtbf_reproduces_llama3_every_three_hours() -> None:
    h100 = load_profile("dgx-h100")
    assert job_mtbf_s(h100, 2048, 8) / H == pytest.approx(3.1, abs=0.05)  # Dubey et al. 2024, Sec. 3.3.4
    assert job_mtbf_s(h100, 128, 8) / H == pytest.approx(49.3, abs=0.1)
    assert job_mtbf_s(h100, 128, 8, mtbf_hours=12.0) == 12 * H


def _ckpt(cfg: ParallelConfig, nodes: int, workload: Workload, model: str = "llama-3-8b", hw: str = "dgx-h100"):
    return checkpoint_arrays(columns_of([cfg]), load_model(model), workload, load_profile(hw), nodes)


def test_checkpoint_sizes_are_the_bytes_each_runtime_writes() -> None:
    model = load_model("llama-3-8b")
    p = model.total_params()
    wl = Workload(global_batch=64, seq_len=8192)
    mega = _ckpt(ParallelConfig(dp=32, framework="megatron", zero_stage=1), 4, wl)
    assert mega.full_bytes[0] == 14 * p  # bf16 weights + fp32 master + two fp32 moments
    assert mega.model_bytes[0] == 2 * p
    titan = _ckpt(ParallelConfig(dp=32, framework="torchtitan", zero_stage=3), 4, wl)
    assert titan.full_bytes[0] == 12 * p  # fp32 parameters and moments, no master copy
    aware = Workload(global_batch=64, seq_len=8192, precision_aware_optimizer=True)
    small = _ckpt(ParallelConfig(dp=32, framework="megatron", zero_stage=1), 4, aware)
    assert small.full_bytes[0] == (2 + 2 + 2 * 2) * p  # bf16 moments, 16-bit master remainders


def test_who_writes_sets_the_save_time() -> None:
    wl = Workload(global_batch=64, seq_len=8192)
    nodes = 16
    z1 = _ckpt(ParallelConfig(dp=128, framework="deepspeed", zero_stage=1), nodes, wl)
    z3 = _ckpt(ParallelConfig(dp=128, framework="deepspeed", zero_stage=3), nodes, wl)
    mega = _ckpt(ParallelConfig(dp=128, framework="megatron", zero_stage=1), nodes, wl)
    storage = load_profile("dgx-h100").storage
    p = load_model("llama-3-8b").total_params()
    # ZeRO-3: every node writes 1/16 of 14 bytes per parameter.
    assert z3.persist_s[0] == pytest.approx(14 * p / nodes / (storage.write_GBps_per_node * 1e9))
    # ZeRO-1: DP rank 0 (one node) also writes the 16-bit weights.
    assert z1.persist_s[0] == pytest.approx((12 * p / nodes + 2 * p) / (storage.write_GBps_per_node * 1e9))
    assert z1.stall_s[0] == z1.persist_s[0]  # DeepSpeed saves synchronously
    # Megatron spreads everything and saves asynchronously: it stalls for the host copy only.
    assert mega.persist_s[0] == pytest.approx(z3.persist_s[0])
    assert mega.stall_s[0] < 0.2 * mega.persist_s[0]


def test_aggregate_filesystem_bandwidth_caps_a_large_job() -> None:
    wl = Workload(global_batch=2048, seq_len=8192)
    big = _ckpt(ParallelConfig(dp=1024, tp=8, pp=2, framework="megatron", zero_stage=1), 2048, wl,
                model="llama-3.1-405b")
    storage = load_profile("dgx-h100").storage
    assert big.persist_s[0] == pytest.approx(big.full_bytes[0] / (storage.aggregate_write_GBps * 1e9))


def test_schedule_waits_for_an_async_save_to_persist() -> None:
    sched = schedule(np.array([1.0]), np.array([0.1]), np.array([50.0]), np.array([10.0]), 300.0, 1e6)
    assert sched.interval_steps[0] * 1.0 >= 50.0 - 0.1


def test_estimate_reports_the_checkpoint_and_goodput() -> None:
    cluster = load_cluster("dgx-h100", 4)
    plan = estimate("llama-3-8b", cluster, tp=2, micro_batch=1, global_batch=512, mtbf_hours=6.0)
    data = plan.to_json()
    ck = data["checkpoint"]
    assert ck["mtbf_hours"] == 6.0
    assert data["mtbf_hours"] == 6.0
    assert 0.9 < data["goodput"] < 1.0
    assert data["goodput_tokens_per_s"] == pytest.approx(data["tokens_per_s"] * data["goodput"])
    assert ck["interval_s"] == pytest.approx(ck["interval_steps"] * data["step_time_s"])
    # A shorter MTBF checkpoints more often and trains a smaller share of the time.
    worse = estimate("llama-3-8b", cluster, tp=2, micro_batch=1, global_batch=512, mtbf_hours=1.0)
    assert worse.checkpoint.interval_steps < plan.checkpoint.interval_steps
    assert worse.goodput < plan.goodput


@pytest.mark.parametrize("value", ["0", "-3", "nan", "1e9"])
def test_a_bad_mtbf_is_one_message_and_exit_2(value) -> None:
    res = run_cli(["estimate", "--model", "llama-3-8b", "--mtbf-hours", value])
    assert res.exit_code == 2
    assert "--mtbf-hours" in res.output and "Traceback" not in res.output


def test_make_workload_refuses_a_zero_mtbf() -> None:
    from planner.errors import UserError

    with pytest.raises(UserError, match="mtbf_hours"):
        make_workload("llama-3-8b", mtbf_hours=0)


def test_suggest_json_carries_goodput_and_ranks_by_it() -> None:
    res = run_cli(["suggest", "--model", "llama-3-8b", "--nodes", "4", "--hardware", "dgx-h100", "--top", "3",
                   "--objective", "goodput", "--mtbf-hours", "2", "--json"])
    assert res.exit_code == 0, res.output
    plans = json.loads(res.output)["plans"]
    useful = [p["goodput_tokens_per_s"] for p in plans]
    assert useful == sorted(useful, reverse=True)
    assert all(p["objective_value"] == pytest.approx(p["goodput_tokens_per_s"]) for p in plans)


@pytest.mark.parametrize(("section", "field", "value"), [("storage", "write_GBps_per_node", 0),
                                                          ("storage", "aggregate_read_GBps", -5),
                                                          ("reliability", "gpu_mtbf_hours", 0)])
def test_a_zero_storage_bandwidth_or_mtbf_in_a_profile_is_refused(tmp_path, section, field, value):
    import yaml

    from planner.resources import hardware_profiles_dir

    data = yaml.safe_load((hardware_profiles_dir() / "dgx-h100.yaml").read_text())
    data["name"] = "mine"
    data[section] = {field: value}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    res = run_cli(["estimate", "--model", "llama-3-8b", "--hardware", str(path)])
    assert res.exit_code == 2
    assert f"{section}.{field}" in res.output and "greater than 0" in res.output and "Traceback" not in res.output
