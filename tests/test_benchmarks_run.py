"""The benchmark scripts the README quotes still run against today's code (a renamed helper
once broke bench_suggest_speed without any test noticing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_suggest_speed_full_evaluation_covers_the_whole_space():
    from planner.model.catalog import load_model
    from planner.search.suggest import suggest

    bench = _load("bench_suggest_speed")
    n, cpu = bench.full_evaluation("gpt3-125m", 1)
    res = suggest(load_model("gpt3-125m"), nodes=1)
    assert n == res.evaluated > 100 and cpu > 0


def test_every_benchmark_script_parses_its_arguments():
    for script in sorted(BENCH.glob("bench_*.py")):
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (script.name, proc.stderr[-2000:])


def test_mosaic_rows_reproduce_the_published_shapes_and_fit():
    """The MPT stand-ins reproduce llm-foundry's NumParams (mosaic() asserts it per row), every
    published layout fits in its GPU, and the A100 rows stay where docs/accuracy.md puts them: within
    8% without activation checkpointing, -16% to -5% (priced slow) with it."""
    rows = _load("bench_published_runs").mosaic()
    assert len(rows) == 18 and all(r["fits"] for r in rows)
    a100 = [r for r in rows if r["case"].endswith("A100")]
    plain = [r["error"] for r in a100 if "ckpt" not in r["layout"]]
    ckpt = [r["error"] for r in a100 if "ckpt" in r["layout"]]
    assert len(plain) == 5 and max(map(abs, plain)) < 0.08
    assert len(ckpt) == 4 and all(-0.17 < e < -0.04 for e in ckpt)


def test_mosaic_runs_across_nodes_hold_the_issues_ten_percent():
    """FSDP across 2-16 nodes: 49 published runs, mean |error| under 10%; on A100 40GB every row
    but the two the source itself runs 18-27% below their same-model neighbours is within 10%."""
    rows = _load("bench_published_runs").mosaic_nodes()
    assert len(rows) == 49 and all(r["fits"] for r in rows)
    assert sum(abs(r["error"]) for r in rows) / len(rows) < 0.10
    a40 = [r for r in rows if r["case"].endswith("A100 40GB")]
    off = sorted((r["case"], r["gpus"]) for r in a40 if abs(r["error"]) > 0.10)
    assert len(a40) == 32 and off == [("1B s2048 A100 40GB", 32), ("70B s2048 A100 40GB", 64)]


def test_no_global_factor_pair_meets_both_megatron_targets():
    """docs/accuracy.md's evidence that #25's Korthikanti (each within 5%) and MT-NLG (within 8%)
    targets conflict: along Table 1's fitted line a larger GEMM share brings Korthikanti closer and
    pushes MT-NLG and Llama 3 further off, and no point meets both; the same 530B layer's published
    time per sample is 10-25% longer in MT-NLG than in Korthikanti, while dsplan prices the two
    within 3% of each other."""
    bench = _load("bench_global_factors")
    line = bench.fitted_line((0.78, 0.84, 0.90), np.round(np.arange(0.56, 0.96, 0.02), 2))
    assert [p["hbm"] for p in line] == sorted((p["hbm"] for p in line), reverse=True)
    korth = [p["Korthikanti 2022 T5"] for p in line]
    mt, llama = [p["MT-NLG 2022"]["mean"] for p in line], [p["Llama 3 2024 T4"]["mean"] for p in line]
    assert korth[0]["mean"] > korth[1]["mean"] > korth[2]["mean"] and mt[0] < mt[1] < mt[2] and llama[0] < llama[2]
    assert not any(p["Korthikanti 2022 T5"]["worst"] <= 0.05 and p["MT-NLG 2022"]["worst"] <= 0.08 for p in line)
    assert all(p["table1"] < 0.05 for p in line)
    per_sample = bench.sample_times()
    assert 1.10 < per_sample["mtnlg"]["published"] / per_sample["korthikanti"]["published"] < 1.25
    assert abs(per_sample["mtnlg"]["predicted"] / per_sample["korthikanti"]["predicted"] - 1) < 0.03


def test_mtnlg_micro_batch_comes_from_its_own_times_and_its_runs_hold_eight_percent():
    """The micro-batch MT-NLG's paper leaves out is read off its three times (the 1F1B bubble in
    the intercept): 2. With it, the runs are within #25's 8% and dsplan's bubble plus once-a-step
    costs land within 10% of the published intercept (12.7 s)."""
    bench = _load("bench_published_runs")
    assert bench.mtnlg_micro_batch() == 2
    rows = bench.mtnlg()
    assert all(0 < r["error"] < 0.08 and "mb2" in r["layout"] for r in rows)
    mt = _load("bench_global_factors").sample_times()["mtnlg"]
    assert mt["published_intercept"] == pytest.approx(12.68, abs=0.01)
    assert mt["predicted_intercept"] == pytest.approx(mt["published_intercept"], rel=0.10)


def test_suggest_speed_names_the_processor_its_per_core_rate_was_measured_on():
    """A per-core rate means little without the core: the benchmark prints which one."""
    name = _load("bench_suggest_speed").cpu_name()
    assert isinstance(name, str) and name.strip() and name != "unknown processor"


def test_megatron_bridge_rows_dsplan_can_express_are_priced_and_the_rest_say_why():
    """The table's 32 rows: every one either priced with its layout pinned, or named with what
    dsplan lacks for it; the expressible dense rows on DGX systems (context parallelism included)
    stay inside the band docs/accuracy.md quotes (0.94-1.17 of published), the NVL72 rows
    (GB200 / GB300, trays of 4 GPUs) are priced, and NVIDIA's B200 layout is as fast as dsplan's own
    first choice."""
    bench = _load("bench_megatron_bridge")
    rows = bench.rows()
    assert len(rows) == 32
    expressible = [r for r in rows if bench.not_expressible(r) is None]
    dgx = {("DGX-B200", "LLAMA3_8B", "FP8-CS"), ("DGX-B200", "LLAMA3_8B", "FP8-MX"),
           ("DGX-H100", "LLAMA3_70B", "FP8-CS"), ("DGX-B200", "LLAMA3.1_405B", "FP8-CS"),
           ("DGX-B200", "LLAMA3.1_405B", "FP8-MX"), ("DGX-H100", "LLAMA3.1_405B", "FP8-CS"),
           ("DGX-H100", "LLAMA3_8B", "FP8-CS")}  # the last: Megatron-FSDP over its 8 GPUs
    nvl72 = {(s, m, p) for s in ("DGX-GB200", "DGX-GB300") for m, p in (
        ("LLAMA3_8B", "FP8-CS"), ("LLAMA3_8B", "FP8-MX"), ("LLAMA3_70B", "FP8-CS"), ("LLAMA3.1_405B", "FP8-CS"))}
    # Every MoE row: DeepSeek-V3 with its MTP depth (B200) and without (the others); Qwen3-235B's
    # EP 32 over TP 2 x DP 16 (H100) with its experts folded out of TP (expert TP 1).
    moe = {(r["system"], r["model"], r["precision"]) for r in rows if "LLAMA" not in r["model"]}
    assert [bench.mtp_layers(r) for r in rows if r["model"] == "DeepSeekV3"].count(1) == 1
    assert {(r["system"], r["model"], r["precision"]) for r in expressible} == dgx | nvl72 | moe
    for row in expressible:
        got = bench.pinned(row)
        assert got["predicted"] > 0, (row["system"], row["model"], got)
        if (row["system"], row["model"], row["precision"]) in dgx:
            assert 0.90 < got["ratio"] < 1.20, (row["system"], row["model"], got)
        if row["model"] == "Qwen3-235B-A22B" and row["system"] == "DGX-H100":
            assert got["chosen"].endswith("sp"), got  # Megatron's MoE layers need SP under TP
        if row["system"] == "DGX-GB200" and row["model"] == "DeepSeekV3":
            # EP 64 / 32 inside 16-tray segments (HardwareProfile.for_job): on NVLink, not InfiniBand,
            # where they read 0.27-0.62; HybridEP without the all-to-all overlap, as the recipe runs;
            # NVIDIA's mla_up_proj recompute fits where the attention core's does not
            assert bench.recipe(row) == {"ep_comm_overlap": False, "moe_dispatcher": "flex",
                                         "recompute_modules": "mla_up_proj"}
            assert 0.9 < got["ratio"] < 1.3 and got["chosen"] == "recompute selective", (row["precision"], got)
    # NVIDIA's B200 layout (distributed optimizer, micro-batch 2) ties dsplan's best: Megatron-FSDP's
    # shards make room for micro-batch 4, 0.14% faster (docs/accuracy.md).
    b200 = next(r for r in expressible if r["system"] == "DGX-B200")
    best = bench.free(b200)
    assert best["rank"] <= 10 and bench.pinned(b200)["predicted"] >= 0.995 * best["best_tokens"]


def test_goodput_benchmark_agrees_with_simulation_and_llama3():
    """The closed form within 1% of the simulated failure process; Llama 3's job at the MTBF its
    report implies, and a goodput above the published lower bound of 90%."""
    bench = _load("bench_goodput")
    assert bench.closed_form_check()["worst_relative_difference"] < 0.01
    ll = bench.llama3()
    assert abs(ll["mtbf_hours"] - ll["published_mtbf_hours"]) < 0.05
    assert 0.9 < ll["goodput"] < 1.0


def test_cpu_predicted_vs_measured_runs_a_real_plan_and_compares(tmp_path):
    """A small version of bench_cpu_predicted_vs_measured: profile gpt3-125m on this CPU, plan
    DP 2 with ZeRO-2 on cpu-local with the profile, run it for real, compare (all measured now)."""
    bench = _load("bench_cpu_predicted_vs_measured")
    prof = bench.profile("gpt3-125m", 64, tmp_path)
    row = bench.plan_and_run("gpt3-125m", "zero2", 64, 3, prof, tmp_path)
    report = json.loads(Path(row["report"]).read_text())
    assert report["status"] == "completed" and report["measured"]["steps_measured"] >= 2
    assert "the planner's accuracy" in report["note"]  # the same job on both sides: no scaling
    assert report["local_adaptation"]["scale"] == "1" and report["local_adaptation"]["seq_len"] == 64
    plan = json.loads((Path(row["report"]).parent / "plan.json").read_text())
    assert plan["layer_profile"]["model"] == "gpt3-125m"
    assert row["measured_s"] > 0 and row["predicted_s"] > 0
    # On an idle host ZeRO-2 reads -11..-14% here (docs/accuracy.md, the benchmark). The suite runs
    # this beside another test worker on the same two cores, which measured the step up to twice
    # as long: the bound is for that, and the benchmark (run alone) is the accuracy check.
    assert 0.3 < row["predicted_s"] / row["measured_s"] < 1.5
    # calibrating on the run prices it as its plan was priced: with the same measured blocks
    refused = bench.subprocess.run([*bench.DSPLAN, "calibrate", row["report"], "--out", str(tmp_path / "c.yaml")],
                                   capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 2 and "pass that file with --profile" in refused.stderr
    fitted = bench.dsplan("calibrate", row["report"], "--profile", str(prof), "--out", str(tmp_path / "c.yaml"),
                          "--json", cwd=tmp_path)
    (run,) = json.loads(fitted.stdout)["runs"]
    assert run["predicted_before_s"] == pytest.approx(row["predicted_s"], rel=1e-6)
    assert abs(run["error_after"]) < 0.01


def test_the_gpu_loop_script_passes_shellcheck_and_uses_only_real_flags():
    """benchmarks/gpu_profile_plan_run.sh cannot run here (no GPU); what can be checked is that
    shellcheck passes and every dsplan command and flag it calls exists."""
    import re
    import shutil

    from click.testing import CliRunner

    from planner.cli import main

    script = BENCH / "gpu_profile_plan_run.sh"
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r"^dsplan (\w+)(.*)$", text, flags=re.M)
    assert {c for c, _ in calls} == {"profile", "suggest", "generate", "run", "calibrate"}
    for command, rest in calls:
        helptext = CliRunner().invoke(main, [command, "--help"]).output
        for flag in re.findall(r"(--[a-z][a-z-]*)", rest):
            assert flag in helptext, (command, flag)
