"""preflight.sh and preflight.json: the expectations dsplan prices at generate time, the
nccl-tests parser and comparisons on recorded outputs (tests/data/nccl_tests/README.md says
where their numbers come from), the GPU / NIC / GEMM checks, and `dsplan run --preflight` end to
end with fake nvidia-smi / all_reduce_perf / deepspeed on PATH (the real ones do not exist here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.cost.collectives import collective_time_for_size
from planner.emit.preflight import preflight_expectations
from planner.hardware.cluster import Cluster
from planner.hardware.load import load_profile
from planner.run.gemm_burn import gemm_checks
from planner.run.nccl_tests import NcclTestsOutputError, parse
from planner.run.preflight import check_gpus, check_nics, expected_busbw, nccl_checks, read_gpus
from planner.run.preflight import main as preflight_main
from tests.test_cli_run import generate as generate_run_dir
from tests.test_emit_ds_config import make_plan

DATA = Path(__file__).parent / "data" / "nccl_tests"
HEALTHY = DATA / "a100_8gpu_all_reduce_perf.txt"
# nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits on a DGX A100 80GB
# (81920 MiB per GPU: hardware_profiles/dgx-a100-80g.yaml)
A100_SMI = "".join(f"{i}, NVIDIA A100-SXM4-80GB, 81920\n" for i in range(8))


def expectations(profile: str = "dgx-a100-80g", nodes: int = 1):
    plan, _ = make_plan("gpt3-125m", nodes, hardware=profile, zero_stage=1)
    return preflight_expectations(plan, load_profile(profile), "test plan")


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def test_expectations_are_dsplans_own_prediction_for_the_node_and_the_job():
    exp = expectations(nodes=2)
    node, job = exp.groups
    assert (node.name, node.ranks, node.nodes, job.name, job.ranks, job.nodes) == ("node", 8, 1, "job", 16, 2)
    cluster = Cluster.build(load_profile("dgx-a100-80g"), 2)
    for group in (node, job):
        point = next(p for p in group.ops["all_reduce_perf"] if p.size_bytes == 2**30)
        want = collective_time_for_size(cluster, "allreduce", group.ranks, 2**30).busbw_GBps
        assert point.busbw_GBps == pytest.approx(want, abs=1e-3)
    assert node.ops["all_reduce_perf"][-1].busbw_GBps == pytest.approx(234.02, abs=0.01)  # ring/Simple, 1 GiB
    sizes = [p.size_bytes for p in node.ops["all_gather_perf"]]
    assert sizes[0] == 8 and sizes[-1] == 2**30 and len(sizes) == 28
    assert exp.gemm.target_TFLOPs == pytest.approx(312 * 0.869)
    assert (exp.nics, exp.rdma, exp.gpus_per_node, exp.gpu_memory_GiB) == (8, True, 8, 80)
    assert len(expectations().groups) == 1  # a single-node plan has no job group


def test_expected_busbw_interpolates_in_log_size():
    points = expectations().groups[0].ops["all_reduce_perf"]
    at = {p.size_bytes: p.busbw_GBps for p in points}
    assert expected_busbw(points, 2**20) == at[2**20]
    middle = expected_busbw(points, 3 * 2**19)  # between 1 and 2 MiB, log2 0.585 of the way
    assert middle == pytest.approx(at[2**20] + 0.585 * (at[2**21] - at[2**20]), rel=1e-3)
    assert expected_busbw(points, 2**31) is None


def test_parse_reads_every_column_of_nccl_tests_output():
    result = parse(HEALTHY.read_text())
    assert (result.test, len(result.rows), result.ranks, result.hosts) == ("all_reduce_perf", 20, 8, ("dgx-a100-01",))
    assert (result.avg_busbw_GBps, result.out_of_bounds) == (121.862, 0)
    row = next(r for r in result.rows if r.size_bytes == 2**30)
    assert (row.count, row.type, row.redop, row.root) == (2**28, "float", "sum", -1)
    assert (row.out_of_place.time_us, row.out_of_place.algbw_GBps, row.busbw_GBps, row.wrong) == (
        8204.02, 130.88, 229.04, 0)


def test_parse_reads_per_iteration_columns_and_na():
    header = "#       size  count  type  redop  root  time algbw busbw #wrong i_min i_max i_p99 i_cv%\n"
    row = ("  1048576  262144  float  sum  -1  101.9  10.29  18.00  N/A  99  110  109  2.1"
           "  102.0  10.28  17.99  N/A  99  111  109  2.0\n")
    result = parse(header + row + "# Avg bus bandwidth    : 18 \n")
    assert result.rows[0].in_place.busbw_GBps == 17.99 and result.rows[0].wrong is None


def test_a_healthy_a100_node_passes():
    checks = nccl_checks(expectations(), f"all_reduce_perf:node:{HEALTHY}")
    assert [c.status for c in checks] == ["PASS", "PASS", "PASS"]
    busbw, latency = checks[1].detail, checks[2].detail
    assert "11 sizes >= 85%" in busbw and "at 16 MiB busbw 106.2 GB/s is 88%" in busbw
    assert latency == "32 KiB all-reduce takes 43.8 us (limit 100 us)"


def test_low_bus_bandwidth_fails_naming_the_op_size_and_fix():
    """The A100 node's measured curve on a plan priced for H200 (NVLink4, NVLS): half the bandwidth."""
    checks = nccl_checks(expectations("hgx-h200"), f"all_reduce_perf:node:{HEALTHY}")
    bad = [c for c in checks if c.status == "FAIL"]
    assert [c.name for c in bad] == ["all_reduce_perf node (8 ranks) busbw"]
    assert "at 1 MiB busbw 18.0 GB/s is 44% of the predicted 41.0 GB/s" in bad[0].detail
    assert "11 of 11 sizes below 85%" in bad[0].detail
    assert "NCCL_IB_HCA" in bad[0].fix and "nvlink" in bad[0].fix and "CLOCK" in bad[0].fix
    assert "fix: check the NCCL settings" in bad[0].line()


def test_wrong_results_fail():
    checks = nccl_checks(expectations(), f"all_reduce_perf:node:{DATA / 'a100_8gpu_all_reduce_perf_wrong.txt'}")
    (bad,) = [c for c in checks if c.status == "FAIL"]
    assert bad.name == "all_reduce_perf node (8 ranks) errors"
    assert "256 MiB: 8192, 512 MiB: 8192" in bad.detail and "xid" in bad.fix


@pytest.mark.parametrize("name, words", [
    ("truncated", "truncated: it ends after the 268435456-byte row without the 'Avg bus bandwidth' line"),
    ("garbled", "line 29 is garbled (7 columns, expected 13)"),
])
def test_truncated_or_garbled_output_is_reported(name, words):
    path = DATA / f"a100_8gpu_all_reduce_perf_{name}.txt"
    with pytest.raises(NcclTestsOutputError, match="all_reduce_perf"):
        parse(path.read_text(), "all_reduce_perf output")
    (check,) = nccl_checks(expectations(), f"all_reduce_perf:node:{path}")
    assert check.status == "FAIL" and words in check.detail and "-g 8" in check.fix
    assert "no result rows" in str(pytest.raises(NcclTestsOutputError, parse, "# nThread 1\n").value)


def test_a_run_over_fewer_gpus_fails():
    checks = nccl_checks(expectations("dgx-a100-80g", 2), f"all_reduce_perf:job:{HEALTHY}")
    assert statuses(checks)["all_reduce_perf job (16 ranks) ranks"] == "FAIL"


def test_gpu_count_and_memory():
    exp = expectations()
    assert check_gpus(exp, read_gpus(A100_SMI), local=False).status == "PASS"
    assert check_gpus(exp, read_gpus(A100_SMI)[:7], local=False).detail.startswith("nvidia-smi lists 7 GPU(s)")
    mig = check_gpus(exp, read_gpus("0, NVIDIA A100-SXM4-80GB MIG 3g.40gb, 40192\n" * 8), local=False)
    assert mig.status == "FAIL" and "40192 MiB" in mig.detail and "MIG" in mig.fix
    assert check_gpus(exp, None, local=False).status == "FAIL"
    assert check_gpus(exp, None, local=True).status == "SKIP"
    assert check_gpus(expectations("mi300x"), None, local=False).status == "SKIP"


def test_nics_are_counted_on_multi_node_rdma_plans():
    exp = expectations(nodes=2)
    assert check_nics(exp, 8, local=False).status == "PASS"
    short = check_nics(exp, 7, local=False)
    assert short.status == "FAIL" and "7 RDMA device(s); the plan expects 8" in short.detail
    assert check_nics(exp, None, local=False).status == "FAIL"
    assert check_nics(expectations(), 0, local=False).status == "SKIP"  # one node: no network


def test_gemm_without_a_gpu():
    """This machine has no GPU: skipped, unless nvidia-smi answers and the plan cannot run."""
    exp = expectations()
    assert statuses(gemm_checks(exp, None, local=False))["gemm"] == "SKIP"
    assert gemm_checks(exp, None, local=False)[-1].detail == "skipped: no GPU"
    assert statuses(gemm_checks(exp, [], local=False))["gemm"] == "FAIL"  # nvidia-smi shows none
    listed = gemm_checks(exp, read_gpus(A100_SMI), local=False)[-1]
    assert listed.status == "FAIL" and "torch sees none" in listed.detail
    assert statuses(gemm_checks(exp, read_gpus(A100_SMI), local=True))["gemm"] == "SKIP"


def test_preflight_main_exit_status(tmp_path, capsys):
    spec = tmp_path / "preflight.json"
    spec.write_text(json.dumps(expectations().model_dump(mode="json")))
    smi = tmp_path / "gpus.csv"
    smi.write_text(A100_SMI)
    assert preflight_main(["--expect", str(spec), "--gpus", str(smi), "--nccl", f"all_reduce_perf:node:{HEALTHY}"]) == 0
    assert capsys.readouterr().out.endswith("preflight: all checks passed\n")
    assert preflight_main(["--expect", str(spec), "--nccl", f"all_reduce_perf:node:{HEALTHY}"]) == 1
    assert "preflight: FAILED: gpus" in capsys.readouterr().out
    spec.write_text('{"version": 1}')
    assert preflight_main(["--expect", str(spec)]) == 2
    assert "regenerate the run directory" in capsys.readouterr().err


# -- preflight.sh and dsplan run --preflight, with fake tools on PATH ---------------------------

def fake_tools(bin_dir: Path, nccl_output: Path, gpus: str = A100_SMI) -> None:
    smi = (f'case "$*" in\n  *driver_version*) echo 535.104.05 ;;\n  *query-gpu*) cat <<\'EOF\'\n{gpus}EOF\n    ;;\n'
           '  *) echo "| NVIDIA-SMI 535.104.05   Driver Version: 535.104.05   CUDA Version: 12.2     |" ;;\nesac\n')
    tools = {"nvidia-smi": smi, "all_reduce_perf": f"cat {nccl_output}\n"}
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}")
        (bin_dir / name).chmod(0o755)


@pytest.fixture(scope="module")
def a100_run_dir(tmp_path_factory) -> Path:
    return generate_run_dir(tmp_path_factory.mktemp("pf"), "a100", gpus_per_node=8)


def test_preflight_sh_counts_nics_from_sysfs(tmp_path, fake_bin):
    run_dir = generate_run_dir(tmp_path, "two", nodes=2, gpus_per_node=8)
    ib = tmp_path / "infiniband"
    for i in range(7):
        (ib / f"mlx5_{i}").mkdir(parents=True)
    fake_tools(fake_bin, HEALTHY)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "DSPLAN_PREFLIGHT_IB_DIR": str(ib),
           "DSPLAN_PREFLIGHT_SKIP": "gemm"}
    proc = subprocess.run([str(run_dir / "preflight.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL nics: 7 RDMA device(s); the plan expects 8 compute NICs" in proc.stdout
    assert "PASS all_reduce_perf node (8 ranks) busbw" in proc.stdout
    assert "SKIP all_reduce_perf job: not run across nodes (set DSPLAN_PREFLIGHT_ACROSS=mpirun or srun)" in proc.stdout
    assert "SKIP all_gather_perf: skipped: not installed" in proc.stdout


def test_dsplan_run_preflight_passes_then_trains(a100_run_dir, tmp_path, fake_bin):
    fake_tools(fake_bin, HEALTHY)
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "fake.jsonl"),
           "DSPLAN_PREFLIGHT_SKIP": "gemm"}
    result = CliRunner().invoke(main, ["run", str(a100_run_dir), "--preflight", "--grace", "0"], env=env)
    assert "PASS gpus: 8 x NVIDIA A100-SXM4-80GB, 81920 MiB each" in result.output, result.output
    assert "PASS all_reduce_perf node (8 ranks) latency" in result.output
    assert "preflight: all checks passed" in result.output
    # training started after it: the fake deepspeed ran (and exited at once, so the run itself fails)
    (record,) = [json.loads(line) for line in (tmp_path / "fake.jsonl").read_text().splitlines()]
    assert record["cmd"] == "deepspeed" and result.exit_code == 1


def test_dsplan_run_preflight_failure_stops_before_training(a100_run_dir, tmp_path, fake_bin):
    fake_tools(fake_bin, DATA / "a100_8gpu_all_reduce_perf_wrong.txt")
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "fake.jsonl"),
           "DSPLAN_PREFLIGHT_SKIP": "gemm"}
    result = CliRunner().invoke(main, ["run", str(a100_run_dir), "--preflight"], env=env)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "error: preflight failed on this node, training not started: FAIL all_reduce_perf node (8 ranks) " \
           "errors: wrong results (256 MiB: 8192" in " ".join(result.output.split())
    assert not (tmp_path / "fake.jsonl").exists()


def test_local_run_without_preflight_is_unchanged(tmp_path_factory):
    """--local on this CPU-only machine: no preflight line, no DSPLAN_PREFLIGHT in any command."""
    run_dir = generate_run_dir(tmp_path_factory.mktemp("cpu"), "cpu")
    plain = CliRunner().invoke(main, ["run", str(run_dir), "--local", "--dry-run"])
    assert plain.exit_code == 0 and "preflight.sh" not in plain.output and "DSPLAN_PREFLIGHT" not in plain.output
    checked = CliRunner().invoke(main, ["run", str(run_dir), "--local", "--dry-run", "--preflight"])
    lines = checked.output.splitlines()
    assert "# --preflight: would first run ./preflight.sh on this node" in lines
    same = re.compile(r"(DSPLAN_JOB_ID|MASTER_PORT)=\w+")
    assert [same.sub("", line) for line in lines if "--preflight" not in line] == [
        same.sub("", line) for line in plain.output.splitlines()]


def test_slurm_preflight_runs_on_every_node_through_sbatch(a100_run_dir):
    from planner.run.job import build_job

    job = build_job(a100_run_dir, launcher="slurm", preflight=True)
    assert job.commands()[0].env["DSPLAN_PREFLIGHT"] == "1"
    assert "DSPLAN_PREFLIGHT" not in build_job(a100_run_dir, launcher="slurm").commands()[0].env
    sbatch = (a100_run_dir / "slurm.sbatch").read_text()
    assert ('srun "${CONTAINER[@]}" --nodes="$SLURM_NNODES" --ntasks-per-node=1 --label "$RUN_DIR/preflight.sh"'
            in sbatch)
