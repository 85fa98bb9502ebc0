"""prometheus-rules.yaml and grafana-dashboard.json of a generated run directory, judged by their
consumers: Prometheus's promtool (`check rules`, and `test rules` unit tests that put each alert's
series just past its threshold and exactly at it) and Grafana's dashboard model
(grafana-foundation-sdk, generated from Grafana's own schema)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from planner.emit.monitoring import AlertThresholds
from tests.promtool import PromtoolUnavailable, ensure_promtool
from tests.test_cli_generate import invoke, write_plan

RUN = "run"  # the run directory's name, and so the rules' `run` label


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated run directory whose plan predicts 1.25 s a step (tests/test_cli_generate.py write_plan)."""
    tmp = tmp_path_factory.mktemp("monitoring")
    plan = write_plan(tmp, "llama-3-8b", 1)  # its profile, dgx-a100-80g: tdp_W 400
    result = invoke("generate", "--plan", str(plan), "--out", str(tmp / RUN))
    assert result.exit_code == 0, result.output
    return tmp / RUN


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        return ensure_promtool()
    except PromtoolUnavailable as e:
        pytest.fail(f"promtool is needed to check prometheus-rules.yaml and could not be fetched:\n{e}")


def _rules(run_dir: Path) -> dict[str, dict]:
    data = yaml.safe_load((run_dir / "prometheus-rules.yaml").read_text())
    return {r["alert"]: r for r in data["groups"][0]["rules"]}


def test_promtool_accepts_the_rules(run_dir: Path, promtool: Path):
    r = subprocess.run([str(promtool), "check", "rules", str(run_dir / "prometheus-rules.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout


def test_rules_carry_the_thresholds_and_the_predicted_step_time(run_dir: Path):
    rules, t = _rules(run_dir), AlertThresholds()
    assert rules["DsplanGpuUtilisationLow"]["expr"] == "DCGM_FI_DEV_GPU_UTIL < 70"
    assert rules["DsplanGpuUtilisationLow"]["for"] == "5m"
    assert rules["DsplanGpuMemoryHigh"]["for"] == "1m"
    assert rules["DsplanStepTimeRegression"]["expr"] == "dsplan_step_time_seconds > 1.25 * 1.25"
    assert rules["DsplanStepTimeRegression"]["for"] == t.step_time_for == "10m"
    assert all(r["labels"]["run"] == RUN and r["annotations"]["action"] for r in rules.values())


# (alert, its series: (series, values), eval time, labels of the series that must fire, summary)
# Each case has a series just past the threshold, which fires, and one exactly at it, which must not.
CASES = [
    ("DsplanGpuUtilisationLow",
     [('DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n1"}', "69x10"),
      ('DCGM_FI_DEV_GPU_UTIL{gpu="1",Hostname="n1"}', "70x10")],
     "6m", {"gpu": "0", "Hostname": "n1"}, "GPU 0 on n1 is 69% busy (below 70% for 5m)"),
    ("DsplanGpuMemoryHigh",
     [('DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n1"}', "91x5"), ('DCGM_FI_DEV_FB_FREE{gpu="0",Hostname="n1"}', "9x5"),
      ('DCGM_FI_DEV_FB_USED{gpu="1",Hostname="n1"}', "90x5"), ('DCGM_FI_DEV_FB_FREE{gpu="1",Hostname="n1"}', "10x5")],
     "2m", {"gpu": "0", "Hostname": "n1"}, "GPU 0 on n1 uses 91% of its memory (above 0.9 for 1m)"),
    ("DsplanCommunicationShareHigh",
     [('dsplan_comm_share{rank="0"}', "0.16x10"), ('dsplan_comm_share{rank="1"}', "0.15x10")],
     "6m", {"rank": "0"}, "Rank 0 spends 16% of each step communicating (above 0.15 for 5m)"),
    ("DsplanTcpRetransmissions",
     [('node_netstat_Tcp_RetransSegs{instance="n1"}', "0+4x15"),
      ('node_netstat_Tcp_RetransSegs{instance="n2"}', "0+3x15")],
     "11m", {"instance": "n1"}, "n1 retransmits 4 TCP segments a minute (above 3 for 5m)"),
    ("DsplanInfinibandLinkDown",
     [('node_infiniband_link_downed_total{instance="n1",device="mlx5_0",port="1"}', "0 0 1 1 1"),
      ('node_infiniband_link_downed_total{instance="n1",device="mlx5_1",port="1"}', "0x4")],
     "3m", {"instance": "n1", "device": "mlx5_0", "port": "1"}, "InfiniBand port mlx5_0/1 on n1 went down"),
    ("DsplanGpuTemperatureHigh",
     [('DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="n1"}', "86x5"), ('DCGM_FI_DEV_GPU_TEMP{gpu="1",Hostname="n1"}', "85x5")],
     "3m", {"gpu": "0", "Hostname": "n1"}, "GPU 0 on n1 is at 86 C (above 85 C for 2m)"),
    ("DsplanStepTimeRegression",
     [('dsplan_step_time_seconds{rank="0"}', "1.5626x15"), ('dsplan_step_time_seconds{rank="1"}', "1.5625x15")],
     "11m", {"rank": "0"}, "Rank 0 steps take 1.5626 s, above 1.25 x the predicted 1.25 s for 10m"),
]


def _promtool_test(run_dir: Path, promtool: Path, alert: str, series: list[tuple[str, str]], at: str,
                   fire_labels: list[dict[str, str]], summaries: list[str]) -> subprocess.CompletedProcess:
    """Run one `promtool test rules` case: ``alert`` at ``at`` fires exactly for ``fire_labels``."""
    rule = _rules(run_dir)[alert]
    exp = [{"exp_labels": {**rule["labels"], **labels}, "exp_annotations": {"summary": s, **{
        k: v for k, v in rule["annotations"].items() if k != "summary"}}} for labels, s in zip(fire_labels, summaries)]
    test = {"rule_files": [str(run_dir / "prometheus-rules.yaml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                       "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": exp}]}]}
    path = run_dir.parent / f"test-{alert}.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run([str(promtool), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("alert, series, at, labels, summary", CASES, ids=[c[0] for c in CASES])
def test_alert_fires_past_its_threshold_and_not_at_it(run_dir, promtool, alert, series, at, labels, summary):
    r = _promtool_test(run_dir, promtool, alert, series, at, [labels], [summary])
    assert r.returncode == 0, r.stdout + r.stderr
    # the same series without the one past the threshold: promtool must see the alert missing
    quiet = [s for s in series if not all(f'{k}="{v}"' in s[0] for k, v in labels.items())]
    r = _promtool_test(run_dir, promtool, alert, quiet, at, [], [])
    assert r.returncode == 0, r.stdout + r.stderr


def test_power_alert_reads_the_cap_or_falls_back_to_the_profiles_tdp(run_dir, promtool):
    series = [('DCGM_FI_DEV_POWER_USAGE{gpu="0",Hostname="n1"}', "451x10"),
              ('DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0",Hostname="n1"}', "500x10"),  # 0.9 x 500 = 450: fires
              ('DCGM_FI_DEV_POWER_USAGE{gpu="1",Hostname="n1"}', "450x10"),
              ('DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="1",Hostname="n1"}', "500x10"),  # at 450: quiet
              ('DCGM_FI_DEV_POWER_USAGE{gpu="2",Hostname="n1"}', "361x10"),  # no cap exported: 0.9 x 400 W TDP
              ('DCGM_FI_DEV_POWER_USAGE{gpu="3",Hostname="n1"}', "360x10")]
    assert json.loads((run_dir / "plan.json").read_text())["hardware"] == "dgx-a100-80g"  # an A100: 400 W
    end = "of its power cap (DCGM_FI_DEV_POWER_MGMT_LIMIT, else the profile's 400.0 W TDP) for 5m"
    r = _promtool_test(run_dir, promtool, "DsplanGpuPowerNearCap", series, "6m",
                       [{"gpu": "0", "Hostname": "n1"},
                        {"gpu": "2", "Hostname": "n1"}],
                       [f"GPU 0 on n1 draws 451 W, above 0.9 {end}", f"GPU 2 on n1 draws 361 W, above 0.9 {end}"])
    assert r.returncode == 0, r.stdout + r.stderr


def _lost(mine: object, theirs: object, path: str = "") -> list[str]:
    """Every key or value of ``mine`` that ``theirs`` does not carry the same."""
    if isinstance(mine, dict):
        if not isinstance(theirs, dict):
            return [path or "/"]
        return [p for k, v in mine.items() for p in
                ([f"{path}/{k}"] if k not in theirs else _lost(v, theirs[k], f"{path}/{k}"))]
    if isinstance(mine, list):
        if not isinstance(theirs, list) or len(mine) != len(theirs):
            return [path]
        return [p for i, (a, b) in enumerate(zip(mine, theirs)) for p in _lost(a, b, f"{path}[{i}]")]
    return [] if mine == theirs else [f"{path}: {mine!r} != {theirs!r}"]


def _through_grafanas_model(board: dict) -> dict:
    """The dashboard read into grafana-foundation-sdk's Dashboard (with the panel and Prometheus query
    models registered) and written back: a key the model does not know is dropped on the way."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    return json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))


def test_dashboard_survives_grafanas_dashboard_model(run_dir: Path):
    board = json.loads((run_dir / "grafana-dashboard.json").read_text())
    assert _lost(board, _through_grafanas_model(board)) == []
    # the check sees a key Grafana does not have, in a panel's options and in a query
    board["panels"][0]["options"]["legend"]["placement"] = "bottom"
    board["panels"][0]["options"]["legnd"] = {}
    board["panels"][0]["targets"][0]["expresion"] = "up"
    assert sorted(_lost(board, _through_grafanas_model(board))) == ["/panels[0]/options/legnd",
                                                                     "/panels[0]/targets[0]/expresion"]


def test_dashboard_has_the_thresholds_as_variables_and_the_predicted_baseline(run_dir: Path):
    board = json.loads((run_dir / "grafana-dashboard.json").read_text())
    consts = {v["name"]: v["query"] for v in board["templating"]["list"] if v["type"] == "constant"}
    assert consts == {"gpu_util_below_pct": "70", "gpu_memory_above_frac": "0.9", "comm_share_above": "0.15",
                      "retransmits_per_min_above": "3", "gpu_temp_above_c": "85", "power_above_frac": "0.9",
                      "step_time_factor": "1.25", "predicted_step_time_s": "1.25"}
    panels = {p["title"]: p for p in board["panels"]}
    assert len(panels) == 8 and {p["type"] for p in panels.values()} == {"timeseries"}
    step = panels["Step time"]
    assert [t["expr"] for t in step["targets"]] == ["dsplan_step_time_seconds", "vector($predicted_step_time_s)"]
    # the red line sits where the regression alert fires: 1.25 x the predicted 1.25 s
    assert step["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == pytest.approx(1.5625)
    exprs = {t["expr"] for p in panels.values() for t in p["targets"]}
    rules = " ".join(r["expr"] for r in _rules(run_dir).values())
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
                   "node_netstat_Tcp_RetransSegs", "dsplan_comm_share", "dsplan_step_time_seconds"):
        assert any(metric in e for e in exprs) and metric in rules, metric


def test_a_plan_without_a_prediction_has_no_regression_alert_nor_baseline(tmp_path: Path, promtool: Path):
    from tests.test_emit_ds_config import make_plan

    plan, _ = make_plan("llama-3-8b", 1)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
    result = invoke("generate", "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / RUN))
    assert result.exit_code == 0, result.output
    assert "DsplanStepTimeRegression" not in _rules(tmp_path / RUN)
    board = json.loads((tmp_path / RUN / "grafana-dashboard.json").read_text())
    assert "predicted_step_time_s" not in {v["name"] for v in board["templating"]["list"]}
    r = subprocess.run([str(promtool), "check", "rules", str(tmp_path / RUN / "prometheus-rules.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 7 rules found" in r.stdout, r.stdout + r.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$ARGV_LOG"
"""


@pytest.mark.parametrize("port, expected", [("9500", ["--metrics-port", "9500"]), (None, [])])
def test_entry_sh_passes_dsplan_metrics_port_to_the_trainer(run_dir: Path, tmp_path: Path, port, expected):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "DSPLAN_PYTHON": str(fake), "ARGV_LOG": str(tmp_path / "argv")}
    if port:
        env["DSPLAN_METRICS_PORT"] = port
    r = subprocess.run(["bash", str(run_dir / "entry.sh"), "--local_rank=0"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[:3] == ["-u", "-m", "planner.run.trainer"] and argv[-1] == "--local_rank=0"
    at = argv.index("--metrics-port") if "--metrics-port" in argv else None
    assert (argv[at:at + 2] if at is not None else []) == expected
