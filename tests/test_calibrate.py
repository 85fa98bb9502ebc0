"""``dsplan calibrate``: the fit recovers known factors, the readers parse real log formats, and
``--calibration`` applies what was fitted.

"Measured" step times here are the cost model's own predictions under known factors, so a fit
that works must find those factors again and predict every run to well under 1%.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner import api
from planner.calibrate import Run, fit, predict
from planner.cli import main
from planner.emit.plan_file import PlanFile, plan_from_dict
from planner.errors import UserError
from planner.hardware.profile import Calibration
from planner.run.report import plan_inputs
from planner.run.train_logs import deepspeed_step_times, megatron_step_times, read_log, read_report

DATA = Path(__file__).parent / "data" / "calibrate"
MODEL = "gpt3-1.3b"
# Plans that spend their time differently: data-parallel gradients across 2 nodes, tensor-parallel
# all-reduces inside one, ZeRO-3's gathers, and a 3D plan with a pipeline bubble.
PLANS = {
    "dp16-2n": (2, dict(dp=16, zero=1, micro_batch=4, global_batch=64)),
    "tp8-1n": (1, dict(tp=8, micro_batch=4, global_batch=32)),
    "zero3-1n": (1, dict(dp=8, zero=3, micro_batch=2, global_batch=64)),
    "tp4-pp4-2n": (2, dict(tp=4, pp=4, framework="megatron", micro_batch=1, global_batch=64)),
}


def _plan(nodes: int, knobs: dict, hardware: str = "dgx-a100-80g") -> dict:
    return api.estimate(MODEL, api.load_cluster(hardware, nodes), seq_len=2048, **knobs).to_json()


def _runs(true: Calibration, plans: dict = PLANS) -> list[Run]:
    profile, spec = api.load_hardware("dgx-a100-80g"), api.load_model(MODEL)
    runs = []
    for name, (nodes, knobs) in plans.items():
        plan = plan_from_dict(_plan(nodes, knobs))
        runs.append(Run(name, plan, spec, profile, predict(Run(name, plan, spec, profile, 1.0), true)))
    return runs


# -- the fit ---------------------------------------------------------------------------------------


def test_the_fit_recovers_the_gemm_and_network_factors() -> None:
    runs = _runs(Calibration(gemm=0.7, network=0.5))
    result = fit(runs)
    assert all(abs(r.error_before) > 0.3 for r in result.runs)  # the uncalibrated model is far off
    assert all(abs(r.error_after) < 0.01 for r in result.runs), [r.to_json() for r in result.runs]
    cal = result.calibration
    assert cal.gemm == pytest.approx(0.7, rel=0.02)
    assert cal.network == pytest.approx(0.5, rel=0.05)
    assert cal.hbm == pytest.approx(1.0, rel=0.1)
    # no data-parallel traffic is exposed in these runs: the overlap is not identified, stays 1.0
    assert cal.overlap == 1.0 and result.identified == {"gemm": True, "hbm": True, "network": True, "overlap": False}
    assert cal.fitted_on == list(PLANS)


def test_the_fit_finds_an_overlap_that_the_gradient_alone_cannot_see() -> None:
    # Megatron hides the whole gradient reduce-scatter of this plan at overlap 1.0 (the model is
    # flat there); measured with overlap 0.3, part of it shows. Beside the four runs above, not
    # instead of one: four runs for four factors leave a family of exact fits once the 3D plan's
    # TP gradient reductions hide under its wgrad GEMMs (cost/comm_overlap.async_backward_tp).
    plans = {**PLANS, "dp16-2n-megatron": (2, dict(dp=16, zero=1, micro_batch=1, global_batch=16,
                                                   framework="megatron"))}
    result = fit(_runs(Calibration(gemm=0.7, network=0.5, overlap=0.3), plans))
    assert all(abs(r.error_after) < 0.01 for r in result.runs), [r.to_json() for r in result.runs]
    assert result.calibration.overlap == pytest.approx(0.3, rel=0.05)
    assert result.calibration.gemm == pytest.approx(0.7, rel=0.02)


def test_runs_on_two_systems_are_refused() -> None:
    (a100,) = _runs(Calibration(), {"a": PLANS["tp8-1n"]})
    h100 = Run("b", a100.plan, a100.model, api.load_hardware("dgx-h100"), 1.0)
    with pytest.raises(UserError, match="runs on different systems: a on dgx-a100-80g, b on dgx-h100"):
        fit([a100, h100])


# -- the readers -----------------------------------------------------------------------------------


def test_megatron_log_median_after_the_first_iteration_line() -> None:
    run = read_log(DATA / "plan-dp8.json", DATA / "megatron.log")
    assert run.kind == "megatron" and run.steps == 4
    assert run.step_time_s == pytest.approx((1001.5 + 1000.0) / 2 / 1e3)  # median of 1002.1, 998.7, 1001.5, 1000.0
    text = (DATA / "megatron.log").read_text()
    assert megatron_step_times(text)[0] == (1, pytest.approx(1.4503))
    assert megatron_step_times(text, global_batch=128) == []  # only the lines of the plan's batch


def test_deepspeed_throughput_timer_lines_give_batch_over_samples_per_second() -> None:
    run = read_log(DATA / "plan-dp8.json", DATA / "deepspeed.log")  # global batch 64
    assert run.kind == "deepspeed" and run.steps == 3
    # per step the slowest rank's: 64/64, 64/62, 64/66; the first logged step (64/50) left out
    assert run.step_time_s == pytest.approx(1.0)
    steps = deepspeed_step_times((DATA / "deepspeed.log").read_text(), 64)
    assert steps == [(10, pytest.approx(64 / 50)), (20, pytest.approx(1.0)), (30, pytest.approx(64 / 62)),
                     (40, pytest.approx(64 / 66))]


def test_deepspeed_pipeline_and_wall_clock_lines() -> None:
    assert read_log(DATA / "plan-dp8.json", DATA / "deepspeed-pipe.log").step_time_s == pytest.approx(0.501)
    wall = read_log(DATA / "plan-dp8.json", DATA / "deepspeed-wallclock.log")  # fwd + bwd + step, global timers
    assert wall.step_time_s == pytest.approx(0.800) and wall.steps == 3


def test_a_report_and_its_run_directory_read_the_same() -> None:
    by_dir, by_file = read_report(DATA / "run-dp8"), read_report(DATA / "run-dp8" / "report.json")
    assert by_dir == by_file
    assert by_dir.name == "run-dp8" and by_dir.step_time_s == 0.1234 and by_dir.steps == 19
    assert by_dir.plan.dp == 8 and by_dir.plan.framework == "deepspeed"


def test_the_report_carries_every_plan_input() -> None:
    data = _plan(*PLANS["tp4-pp4-2n"])
    inputs = plan_inputs(data)
    whole = plan_from_dict(data).to_json()
    assert plan_from_dict(inputs).to_json() == {k: whole[k] for k in PlanFile.model_fields}
    assert {"framework", "stage_blocks", "recompute", "sequence_parallel", "model", "hardware"} <= set(inputs)
    assert "step_time_s" not in inputs  # inputs only, not predictions


# -- the command line ------------------------------------------------------------------------------


def _invoke(*argv: str):
    # a wide terminal, so the table's headers are not wrapped (xdist workers have none: 80 columns)
    return CliRunner().invoke(main, list(argv), env={"COLUMNS": "200"})


def _write_reports(tmp_path: Path, true: Calibration, hardware: str = "dgx-a100-80g", plans: dict = PLANS,
                   **report) -> list[str]:
    """A run directory per plan with plan.json and a report.json whose step time is the model's under ``true``."""
    profile, spec = api.load_hardware(hardware), api.load_model(MODEL)
    out = []
    for name, (nodes, knobs) in plans.items():
        data = _plan(nodes, knobs, hardware)
        measured = predict(Run(name, plan_from_dict(data), spec, profile, 1.0), true)
        run_dir = tmp_path / name
        run_dir.mkdir(parents=True)
        (run_dir / "plan.json").write_text(json.dumps(data))
        (run_dir / "report.json").write_text(json.dumps(
            {"run_dir": str(run_dir), "local": False, "local_adaptation": None, "plan": plan_inputs(data),
             "measured": {"step_time_s": measured, "steps_measured": 9}} | report))
        out.append(str(run_dir))
    return out


def test_calibrate_writes_the_factors_and_estimate_then_predicts_the_measured_times(tmp_path: Path) -> None:
    dirs = _write_reports(tmp_path, Calibration(gemm=0.7, network=0.5))
    out = tmp_path / "calibration.yaml"
    result = _invoke("calibrate", *dirs, "--out", str(out))
    assert result.exit_code == 0, result.output
    words = result.output.split()  # rich may wrap the header "error before" (80 columns under xdist)
    assert "error" in words and "before" in words and "gemm" in result.output and str(out) in result.output
    saved = yaml.safe_load(out.read_text())
    assert saved["system"] == "dgx-a100-80g" and saved["calibration"]["fitted_on"] == list(PLANS)
    assert saved["calibration"]["gemm"] == pytest.approx(0.7, rel=0.02)
    assert [abs(r["error_after"]) < 0.01 for r in saved["runs"]] == [True] * len(PLANS)
    for run_dir, (nodes, knobs) in zip(dirs, PLANS.values()):
        measured = json.loads((Path(run_dir) / "report.json").read_text())["measured"]["step_time_s"]
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in knobs.items()]
        est = _invoke("estimate", "--model", MODEL, "--nodes", str(nodes), "--seq-len", "2048", *flags,
                      "--calibration", str(out), "--json")
        assert est.exit_code == 0, est.output
        assert json.loads(est.output)["step_time_s"] == pytest.approx(measured, rel=0.01)
    # generate --plan prices the plan file again under the calibration, and plan.json says so
    gen = _invoke("generate", "--plan", str(Path(dirs[1]) / "plan.json"), "--calibration", str(out),
                  "--out", str(tmp_path / "gen"))
    assert gen.exit_code == 0, gen.output
    plan = json.loads((tmp_path / "gen" / "plan.json").read_text())
    measured = json.loads((Path(dirs[1]) / "report.json").read_text())["measured"]["step_time_s"]
    assert plan["step_time_s"] == pytest.approx(measured, rel=0.01)
    assert plan["calibration"]["gemm"] == saved["calibration"]["gemm"]


def test_calibrate_json_keys_and_force(tmp_path: Path) -> None:
    plans = {"tp8-1n": PLANS["tp8-1n"]}
    dirs = _write_reports(tmp_path, Calibration(gemm=0.8), plans=plans)
    out = tmp_path / "cal.yaml"
    out.write_text("mine\n")
    refused = _invoke("calibrate", *dirs, "--out", str(out))
    assert refused.exit_code == 2 and "the file exists; pass --force" in refused.stderr
    assert out.read_text() == "mine\n"
    result = _invoke("calibrate", *dirs, "--out", str(out), "--force", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"system", "calibration", "identified", "runs", "out"}
    assert set(data["runs"][0]) == {"name", "kind", "source", "steps", "measured_s", "predicted_before_s",
                                    "predicted_after_s", "error_before", "error_after"}
    assert data["runs"][0]["kind"] == "report" and abs(data["runs"][0]["error_after"]) < 0.01
    assert list(tmp_path.glob(".cal.yaml.*")) == []  # no temporary left behind


def _error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    return line


def test_bad_runs_exit_2_with_one_message(tmp_path: Path) -> None:
    out = str(tmp_path / "cal.yaml")
    assert "no such file" in _error(_invoke("calibrate", str(tmp_path / "nope.json"), "--out", out))
    (tmp_path / "bad.json").write_text("{not json")
    assert "bad.json: not valid JSON" in _error(_invoke("calibrate", str(tmp_path / "bad.json"), "--out", out))
    report = json.loads((DATA / "run-dp8" / "report.json").read_text())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "report.json").write_text(json.dumps(
        report | {"measured": {"step_time_s": None, "steps_measured": 0}}))
    message = _error(_invoke("calibrate", str(tmp_path / "empty"), "--out", out))
    assert "empty/report.json: the run measured no steps" in message
    (tmp_path / "scaled").mkdir()
    (tmp_path / "scaled" / "report.json").write_text(json.dumps(report | {"local": True, "local_adaptation": {
        "scale": "tiny", "seq_len": 256, "planned_seq_len": 2048}}))
    message = _error(_invoke("calibrate", str(tmp_path / "scaled"), "--out", out))
    assert "a --local run of the model at scale 'tiny' with 256 tokens" in message and "run it unscaled" in message
    message = _error(_invoke("calibrate", "--log", str(DATA / "plan-dp8.json"), str(DATA / "no-iterations.log"),
                             "--out", out))
    assert "no-iterations.log: no iteration lines in the log" in message
    assert "no runs" not in _error(_invoke("calibrate", "--out", out))  # nothing given: says what to give
    a100 = _write_reports(tmp_path / "a", Calibration(), plans={"x": PLANS["tp8-1n"]})
    h100 = _write_reports(tmp_path / "h", Calibration(), "dgx-h100", plans={"y": PLANS["tp8-1n"]})
    message = _error(_invoke("calibrate", *a100, *h100, "--out", out))
    assert "runs on different systems: x on dgx-a100-80g, y on dgx-h100" in message
    assert not Path(out).exists()


@pytest.mark.parametrize("text, expected", [
    ("system: dgx-a100-80g\ncalibration: {gemm: [1\n", "malformed YAML"),
    ("system: dgx-a100-80g\ncalibration: {gemm: 0.7}\nfactors: 1\n", "unknown key(s) factors"),
    ("system: dgx-a100-80g\ncalibration: {gemm: 0.7, gpu: 2}\n", "calibration: unknown key(s) gpu"),
    ("system: dgx-a100-80g\ncalibration: {gemm: 1000}\n", "gemm: Input should be less than or equal to 100"),
    ("system: dgx-a100-80g\ncalibration: {overlap: 1.5}\n", "overlap: Input should be less than or equal to 1"),
    ("system: dgx-a100-80g\ncalibration: {network: '0.5'}\n", "network: Input should be a valid number"),
    ("calibration: {gemm: 0.7}\n", "needs system"),
    ("system: dgx-h100\ncalibration: {gemm: 0.7}\n",
     "fitted on system dgx-h100, but the plan is for dgx-a100-80g; calibrate on runs of dgx-a100-80g"),
])
def test_bad_calibration_files_exit_2_naming_the_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "cal.yaml"
    path.write_text(text)
    for argv in (["estimate", "--model", "gpt3-125m"], ["suggest", "--model", "gpt3-125m", "--top", "1"]):
        message = _error(_invoke(*argv, "--calibration", str(path)))
        assert f"--calibration {path}" in message and expected in message, message
    assert "no such file" in _error(_invoke("estimate", "--model", "gpt3-125m", "--calibration",
                                            str(tmp_path / "missing.yaml")))


def test_the_api_applies_a_calibration_file(tmp_path: Path) -> None:
    path = tmp_path / "cal.yaml"
    path.write_text("system: dgx-a100-80g\ncalibration: {gemm: 0.5, fitted_on: [a]}\nruns: []\n")
    profile = api.load_hardware("dgx-a100-80g", calibration=str(path))
    assert profile.calibration == Calibration(gemm=0.5, fitted_on=["a"])
    assert api.with_calibration("dgx-a100-80g", str(path)) == profile
    base = api.estimate("gpt3-125m", api.load_cluster(nodes=1)).step_time_s
    slow = api.estimate("gpt3-125m", api.load_cluster(nodes=1, calibration=str(path))).step_time_s
    assert slow > 1.5 * base
    with pytest.raises(UserError, match="calibration .*cal.yaml: fitted on system dgx-a100-80g, but the plan is for"):
        api.load_hardware("dgx-h100", calibration=str(path))


def test_a_report_moved_away_from_its_run_directory_still_calibrates(tmp_path: Path) -> None:
    (run_dir,) = _write_reports(tmp_path / "runs", Calibration(gemm=0.9), plans={"tp8-1n": PLANS["tp8-1n"]})
    moved = tmp_path / "elsewhere.json"
    shutil.copy(Path(run_dir) / "report.json", moved)
    shutil.rmtree(run_dir)
    run = read_report(moved)
    assert run.name == "elsewhere" and run.plan.tp == 8
    result = _invoke("calibrate", str(moved), "--out", str(tmp_path / "c.yaml"), "--json")
    assert result.exit_code == 0, result.output
    assert abs(json.loads(result.output)["runs"][0]["error_after"]) < 0.01


def test_an_unwritable_out_is_one_message_and_nothing_is_fitted(tmp_path: Path) -> None:
    message = _error(_invoke("calibrate", str(DATA / "run-dp8"), "--out", str(tmp_path / "missing" / "c.yaml")))
    assert "cannot write --out" in message and "does not exist" in message
