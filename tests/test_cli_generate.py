"""``dsplan generate`` end to end: the run directory, regeneration rules, and bad input (exit 2,
one message, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.emit.write import MANIFEST
from tests.test_emit_ds_config import make_plan

RUN_FILES = {
    "README.md", "ds_config.json", "entry.sh", "hostfile", "k8s-job.yaml", "launch_deepspeed.sh", "launch_torchrun.sh",
    "megatron_args.sh", "nccl.env", "plan.json", "slurm.sbatch", "preflight.sh", "preflight.json", "Dockerfile",
    "prometheus-rules.yaml", "grafana-dashboard.json",
}


def write_plan(tmp_path: Path, model: str, nodes: int, name: str = "plan.json", **overrides) -> Path:
    plan, _ = make_plan(model, nodes, **overrides)
    data = {**plan.to_json(), "fits": True, "step_time_s": 1.25, "tokens_per_s": 2.1e5, "mfu": 0.41,
            "memory": {"peak_bytes": 61.5 * 2**30}}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def snapshot(directory: Path) -> dict[str, bytes]:
    if not directory.exists():
        return {}
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def assert_user_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_generate_from_a_plan_file_writes_the_run_directory(tmp_path: Path):
    plan_path = write_plan(tmp_path, "mixtral-8x7b", 2, zero_stage=2, ep=8, grad_accum=4)
    out = tmp_path / "run"
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out), "--hosts", "gpu-1,gpu-2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report["files"]) == RUN_FILES | {"moe.json"}
    assert set(report["written"]) == set(report["files"]) and report["unchanged"] == []
    assert report["warnings"] == []  # the reference trainer runs this plan
    assert {p.name for p in out.iterdir()} == RUN_FILES | {"moe.json", MANIFEST}
    plan = json.loads(plan_path.read_text())
    assert json.loads((out / "plan.json").read_text()) == plan  # predictions included
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == plan["global_batch"] == plan["micro_batch"] * plan["grad_accum"] * plan["dp"]
    assert json.loads((out / "moe.json").read_text())["ep_size"] == 8
    assert (out / "hostfile").read_text() == "gpu-1 slots=8\ngpu-2 slots=8\n"
    readme = (out / "README.md").read_text()
    assert "DP 16 x TP 1 x PP 1, EP 8" in readme and "61.5 GiB" in readme and "41.0%" in readme
    assert "NODE_RANK=<i> ./launch_deepspeed.sh node" in readme
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == set(report["files"])


def test_a_hardware_profile_file_is_named_in_the_run_directorys_plan(tmp_path: Path, monkeypatch):
    """estimate --hardware FILE records the profile's name; generate --hardware FILE records the
    file itself, so that `dsplan run` and `dsplan calibrate` price the run with it again."""
    import yaml as pyyaml

    from planner.hardware.load import load_profile

    yaml = tmp_path / "profiles" / "my-node.yaml"
    yaml.parent.mkdir()
    yaml.write_text(pyyaml.safe_dump({**load_profile("dgx-a100-80g").model_dump(mode="json"), "name": "my-node"}))
    est = invoke("estimate", "--model", "gpt3-125m", "--hardware", str(yaml), "--tp", "1", "--pp", "1", "--json")
    assert est.exit_code == 0, est.output
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(est.stdout)
    assert json.loads(est.stdout)["hardware"] == "my-node"  # a name no loader can find by itself
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # a relative path is recorded resolved
    made = invoke("generate", "--plan", "plan.json", "--hardware", "profiles/my-node.yaml", "--out", str(out))
    assert made.exit_code == 0, made.output
    recorded = json.loads((out / "plan.json").read_text())["hardware"]
    assert recorded == str(yaml.resolve())
    assert load_profile(recorded).name == "my-node"


def test_generate_without_a_plan_takes_the_searchs_plan_for_the_pinned_degrees(tmp_path: Path):
    out = tmp_path / "run"
    result = invoke("generate", "--model", "llama-3.1-8b", "--nodes", "2", "--tp", "2", "--pp", "1", "--zero", "1",
                    "--micro-batch", "1", "--global-batch", "64", "--framework", "deepspeed", "--recompute", "none",
                    "--offload", "none", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["dp"], plan["tp"], plan["pp"], plan["grad_accum"]) == (8, 2, 1, 8)
    assert json.loads((out / "ds_config.json").read_text())["tensor_parallel"] == {"autotp_size": 2}
    # and its predictions are estimate's for the same plan
    est = invoke("estimate", "--model", "llama-3.1-8b", "--nodes", "2", "--tp", "2", "--zero", "1",
                 "--micro-batch", "1", "--global-batch", "64", "--framework", "deepspeed", "--json")
    assert est.exit_code == 0, est.output
    est = json.loads(est.output)
    assert plan["step_time_s"] == pytest.approx(est["step_time_s"], rel=1e-9)
    assert plan["memory"]["peak_bytes"] == pytest.approx(est["memory"]["peak_bytes"], rel=1e-9)
    assert plan["tokens_per_s"] == pytest.approx(est["tokens_per_s"], rel=1e-9)


def test_generate_rank_k_is_the_kth_plan_of_suggest(tmp_path: Path):
    flags = ["--model", "llama-3.1-8b", "--nodes", "1", "--framework", "deepspeed", "--global-batch", "64"]
    ranked = invoke("suggest", *flags, "--top", "3", "--json")
    assert ranked.exit_code == 0, ranked.output
    second = json.loads(ranked.output)["plans"][1]
    out = tmp_path / "run"
    result = invoke("generate", *flags, "--rank", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    keys = ("dp", "tp", "pp", "ep", "zero_stage", "offload", "micro_batch", "grad_accum", "recompute", "framework")
    assert {k: plan[k] for k in keys} == {k: second[k] for k in keys}
    assert plan["step_time_s"] == pytest.approx(second["step_time_s"])


def test_readme_carries_the_searchs_why_and_the_batch_notes(tmp_path: Path):
    """The run directory's README says why the search picked the plan (or where it ranks) and
    repeats the planner's batch notes, so whoever launches the job sees them. (With an entry of
    the user's, generate searches what suggest does; the reference trainer's search is narrower:
    tests/test_generate_trainer_plans.py.)"""
    flags = ["--model", "llama-3.1-8b", "--nodes", "1024", "--global-batch", "512"]
    best = invoke("suggest", *flags, "--top", "2", "--json")
    assert best.exit_code == 0, best.output
    data = json.loads(best.output)
    out = tmp_path / "run"
    (tmp_path / "pretrain_gpt.py").write_text("print('hi')\n")
    flags += ["--entry", str(tmp_path / "pretrain_gpt.py")]
    result = invoke("generate", *flags, "--out", str(out))
    assert result.exit_code == 0, result.output
    readme = (out / "README.md").read_text()
    assert "## Notes from the planner" in readme
    assert f"- Why this plan: {data['plans'][0]['why']}" in readme and " beats " in data["plans"][0]["why"]
    assert data["notes"] and all(f"- {note}" in readme for note in data["notes"])
    second = tmp_path / "second"
    assert invoke("generate", *flags, "--rank", "2", "--out", str(second)).exit_code == 0
    assert f"- Ranked #2 by the search, below #1: {data['plans'][1]['why']}" in (second / "README.md").read_text()
    # A plan file without predictions (hand-written) gets no notes section at all.
    plain = tmp_path / "plain"
    assert invoke("generate", "--plan", str(write_plan(tmp_path, "llama-3.1-8b", 1)),
                  "--out", str(plain)).exit_code == 0
    assert "Notes from the planner" not in (plain / "README.md").read_text()


def test_regeneration_protects_user_edits_and_force_replaces_them(tmp_path: Path):
    plan_path = write_plan(tmp_path, "llama-3.1-8b", 1, zero_stage=1)
    out = tmp_path / "run"
    assert invoke("generate", "--plan", str(plan_path), "--out", str(out)).exit_code == 0
    first = snapshot(out)

    again = invoke("generate", "--plan", str(plan_path), "--out", str(out), "--json")
    assert again.exit_code == 0 and json.loads(again.output)["written"] == []
    assert snapshot(out) == first

    (out / "ds_config.json").write_text('{"edited": true}\n')
    (out / "hostfile").write_text("mynode slots=8\n")
    edited = snapshot(out)
    refused = invoke("generate", "--plan", str(plan_path), "--out", str(out))
    assert_user_error(refused, "ds_config.json", "hostfile", "--force")
    assert snapshot(out) == edited  # nothing written, not even the manifest

    forced = invoke("generate", "--plan", str(plan_path), "--out", str(out), "--force", "--json")
    assert forced.exit_code == 0, forced.output
    assert set(json.loads(forced.output)["replaced_edits"]) == {"ds_config.json", "hostfile"}
    assert snapshot(out) == first


def test_regeneration_with_another_plan_updates_untouched_files_and_drops_stale_ones(tmp_path: Path):
    out = tmp_path / "run"
    moe = write_plan(tmp_path, "mixtral-8x7b", 1, name="moe.json", zero_stage=1, ep=8)
    dense = write_plan(tmp_path, "llama-3.1-8b", 1, name="dense.json", zero_stage=2)
    assert invoke("generate", "--plan", str(moe), "--out", str(out)).exit_code == 0
    assert (out / "moe.json").exists()
    result = invoke("generate", "--plan", str(dense), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["removed"] == ["moe.json"] and not (out / "moe.json").exists()
    assert "ds_config.json" in report["written"] and "hostfile" in report["unchanged"]
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2


def test_files_not_written_by_dsplan_are_not_overwritten(tmp_path: Path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    plan_path = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out))
    assert_user_error(result, "README.md")
    assert snapshot(out) == {"README.md": b"my notes\n"}


def test_arguments_after_double_dash_survive_the_round_trip(tmp_path: Path):
    stub = tmp_path / "train.py"
    stub.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    plan_path = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    out = tmp_path / "run"
    args = ["--msg", "hello world", "it's", 'a "quoted" word', "$(touch /tmp/pwned)", "--"]
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out), "--entry", str(stub), "--", *args)
    assert result.exit_code == 0, result.output
    proc = subprocess.run(["bash", str(out / "entry.sh")], capture_output=True, text=True, check=True,
                          env={**os.environ, "DSPLAN_PYTHON": sys.executable})
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == ["--deepspeed", "--deepspeed_config", str(out.resolve() / "ds_config.json"), *args]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--hosts", "node1;rm -rf /,node2"], ["'node1;rm -rf /' is not a valid host name"]),
        (["--hosts", "node1"], ["needs 2 nodes but only 1 host"]),
        (["--hosts", "a,a"], ["listed twice"]),
        (["--hosts", "a,b", "--hostfile", "x"], ["--hosts and --hostfile"]),
        (["--entry", "missing_train.py"], ["--entry missing_train.py: no such file"]),
        (["--model", "llama-3.1-70b"], ["made for model llama-3.1-8b, not llama-3.1-70b"]),
        (["--tp", "2"], ["--plan fixes every degree", "--tp"]),
        (["--nodes", "4"], ["the plan is for 2 node(s)"]),
        (["--ib-hca", "mlx5_0;reboot"], ["--ib-hca"]),
        (["--k8s-pvc", "Bad_Name"], ["--k8s-pvc"]),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, extra: list[str], needles: list[str]):
    plan_path = write_plan(tmp_path, "llama-3.1-8b", 2, zero_stage=1)
    out = tmp_path / "run"
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out), *extra)
    assert_user_error(result, *needles)
    assert not out.exists()


def test_bad_hostfiles_exit_2(tmp_path: Path):
    plan_path = write_plan(tmp_path, "llama-3.1-8b", 2, zero_stage=1)
    out = tmp_path / "run"
    cases = {
        "empty": ("# only a comment\n\n", "lists no hosts"),
        "short": ("n1 slots=8\n", "needs 2 nodes but only 1 host"),
        "slots": ("n1 slots=4\nn2 slots=4\n", "has slots=4 but the plan runs 8 GPUs per node"),
        "syntax": ("n1 cpus=8\n", "line 1: expected 'host slots=N'"),
        "inject": ("n1 slots=8\n$(reboot) slots=8\n", "line 2: '$(reboot)' is not a valid host name"),
    }
    for name, (text, needle) in cases.items():
        hostfile = tmp_path / f"{name}.hosts"
        hostfile.write_text(text)
        assert_user_error(invoke("generate", "--plan", str(plan_path), "--out", str(out), "--hostfile", str(hostfile)),
                          needle)
        assert not out.exists()
    assert_user_error(invoke("generate", "--plan", str(plan_path), "--out", str(out),
                             "--hostfile", str(tmp_path / "nope")),
                      "no such file")
    ok = tmp_path / "ok.hosts"
    ok.write_text("# cluster\n10.0.0.1 slots=8\n10.0.0.2 slots=8  # second\nspare-node slots=8\n")
    result = invoke("generate", "--plan", str(plan_path), "--out", str(out), "--hostfile", str(ok))
    assert result.exit_code == 0, result.output
    assert (out / "hostfile").read_text() == "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"


def test_bad_plan_files_exit_2(tmp_path: Path):
    out = tmp_path / "run"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert_user_error(invoke("generate", "--plan", str(broken), "--out", str(out)), "not valid JSON")
    assert_user_error(invoke("generate", "--plan", str(tmp_path / "absent.json"), "--out", str(out)), "no such file")
    plan_path = write_plan(tmp_path, "llama-3.1-8b", 1, zero_stage=1)
    data = json.loads(plan_path.read_text())
    for change, needle in (
        ({"global_batch": data["global_batch"] + 1}, "global_batch"),
        ({"tp": 3, "dp": 1, "nodes": 1, "gpus_per_node": 3, "global_batch": data["micro_batch"] * data["grad_accum"]},
         "does not divide"),
        ({"model": "no-such-model"}, "no-such-model"),
        ({"pp": 2, "dp": 4, "global_batch": data["micro_batch"] * data["grad_accum"] * 4}, "stage_blocks"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**data, **change}))
        assert_user_error(invoke("generate", "--plan", str(bad), "--out", str(out)), needle)
        assert not out.exists()


def test_out_path_that_is_a_file_or_entry_that_is_a_directory(tmp_path: Path):
    plan_path = write_plan(tmp_path, "gpt3-125m", 1, zero_stage=1)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_user_error(invoke("generate", "--plan", str(plan_path), "--out", str(afile)), "not a directory")
    assert_user_error(invoke("generate", "--plan", str(plan_path), "--out", str(tmp_path / "run"),
                             "--entry", str(tmp_path)),
                      "not a file")
    assert_user_error(invoke("generate", "--out", str(tmp_path / "run")), "--model: required unless --plan")


def test_help_has_an_example():
    result = invoke("generate", "--help")
    assert result.exit_code == 0
    assert "dsplan generate --model vl2 --nodes 8" in result.output and "--plan" in result.output


def test_generate_summary_names_the_framework_and_virtual_stages(tmp_path: Path):
    plan = write_plan(tmp_path, "llama-3.1-8b", 2, framework="megatron", zero_stage=1, pp=4, virtual_stages=3,
                      grad_accum=4)
    out = tmp_path / "run"
    result = invoke("generate", "--plan", str(plan), "--out", str(out))
    assert result.exit_code == 0, result.output
    # rich wraps at the terminal's width (80 columns under pytest-xdist): compare words, not lines
    assert ("plan: megatron, DP 4 x TP 1 x PP 4 (3 virtual stages per rank), ZeRO-1, micro-batch 1 x 4 = 16"
            in " ".join(result.output.split()))
    assert "--pipeline-model-parallel-layout" in (out / "megatron_args.sh").read_text()
    # 6 micro-batches on pp 4: the summary and megatron_args.sh name the micro-batch group it runs with
    plan = write_plan(tmp_path, "llama-3.1-8b", 2, framework="megatron", zero_stage=1, pp=4, virtual_stages=3,
                      grad_accum=6)
    result = invoke("generate", "--plan", str(plan), "--out", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert "PP 4 (3 virtual stages per rank, micro-batch group 6), ZeRO-1, micro-batch 1 x 6 = 24" in " ".join(
        result.output.split())
    assert "--microbatch-group-size-per-virtual-pipeline-stage 6" in (out / "megatron_args.sh").read_text()
