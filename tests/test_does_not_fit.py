"""A plan that does not fit in memory is unmistakable: a warning line on stderr from every command
that carries it, exit status 3 from ``estimate`` (0 with ``--allow-oom``), and a refusal (exit 2)
from ``generate --plan`` and ``run`` unless ``--allow-oom``. The search never offers one."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main

# The plan: llama-3.1-8b on two GPUs without ZeRO sharding needs 139 GiB of 80 per GPU.
BIG = ["--model", "llama-3.1-8b", "--nodes", "1", "--gpus-per-node", "2"]
BIG_WARNING = "warning: plan does not fit: pipeline rank 0 needs 139.0 GiB of 80.0 GiB\n"


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env)


@pytest.fixture()
def big_plan(tmp_path: Path) -> Path:
    result = invoke("estimate", *BIG, "--json")
    assert result.exit_code == 3 and result.stderr == BIG_WARNING, result.output
    path = tmp_path / "p.json"
    path.write_text(result.stdout)
    assert json.loads(result.stdout)["fits"] is False  # the JSON is written all the same
    return path


def test_estimate_exits_3_with_a_warning_unless_allow_oom():
    args = ["estimate", "--model", "llama-3-8b", "--tp", "2", "--micro-batch", "2", "--global-batch", "512"]
    result = invoke(*args)
    assert result.exit_code == 3, result.output
    assert result.stderr == "warning: plan does not fit: pipeline rank 0 needs 91.1 GiB of 80.0 GiB\n"
    assert "does not fit" in result.stdout and "tokens/s" in result.stdout  # priced and printed all the same
    allowed = invoke(*args, "--allow-oom")
    assert allowed.exit_code == 0 and allowed.stderr == result.stderr
    fits = invoke(*args[:-4], "--micro-batch", "1", "--global-batch", "512")
    assert fits.exit_code == 0 and fits.stderr == "" and "; fits" in " ".join(fits.stdout.split())  # any width


def test_the_first_example_of_estimate_help_fits():
    text = invoke("estimate", "--help").stdout
    first = next(line.strip() for line in text.splitlines() if line.strip().startswith("dsplan estimate"))
    result = invoke(*shlex.split(first)[1:])
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert "; fits" in " ".join(result.stdout.split())  # the line may wrap at the console width


def test_generates_help_example_writes_a_plan_file_that_fits():
    lines = [line.strip() for line in invoke("generate", "--help").stdout.splitlines()]
    estimates = [line.split(" > ")[0] for line in lines if line.startswith("dsplan estimate")]
    assert estimates
    for line in estimates:
        result = invoke(*shlex.split(line)[1:])
        assert result.exit_code == 0 and result.stderr == "", (line, result.output)


def test_generate_refuses_a_plan_that_does_not_fit_unless_allow_oom(big_plan: Path, tmp_path: Path):
    out = tmp_path / "run"
    refused = invoke("generate", "--plan", str(big_plan), "--out", str(out))
    assert refused.exit_code == 2, refused.output
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(f"error: --plan {big_plan}: the plan does not "
                                                                         "fit: pipeline rank 0 needs 139.0 GiB")
    assert "--allow-oom" in refused.stderr and not out.exists()
    allowed = invoke("generate", "--plan", str(big_plan), "--out", str(out), "--allow-oom")
    assert allowed.exit_code == 0, allowed.output
    assert allowed.stderr == BIG_WARNING
    assert "| fits | NO" in (out / "README.md").read_text()
    as_json = invoke("generate", "--plan", str(big_plan), "--out", str(out), "--allow-oom", "--json")
    assert as_json.exit_code == 0 and as_json.stderr == BIG_WARNING
    assert json.loads(as_json.stdout)["warnings"][0] == BIG_WARNING[len("warning: "):].strip()


def test_run_refuses_it_unless_allow_oom_and_dry_run_warns(big_plan: Path, tmp_path: Path, fake_bin: Path):
    entry = tmp_path / "train.py"
    entry.write_text("print('trained')\n")
    out = tmp_path / "run"
    made = invoke("generate", "--plan", str(big_plan), "--out", str(out), "--allow-oom", "--entry", str(entry))
    assert made.exit_code == 0, made.output
    refused = invoke("run", str(out))
    assert refused.exit_code == 2, refused.output
    assert refused.stderr.startswith(f"error: {out.resolve()}/plan.json: the plan does not fit: pipeline rank 0 "
                                     "needs 139.0 GiB of 80.0 GiB") and "--allow-oom" in refused.stderr
    assert not (out / ".dsplan-run").exists() and not (out / "report.json").exists()
    dry = invoke("run", str(out), "--dry-run")
    assert dry.exit_code == 0 and dry.stderr == BIG_WARNING
    # forced: the job runs (the fake launcher runs the entry), with the warning on stderr
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log")}
    forced = subprocess.run([sys.executable, "-m", "planner", "run", str(out), "--allow-oom", "--grace", "1"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert forced.stderr.startswith(BIG_WARNING) and "trained" in forced.stdout
    assert json.loads((out / "report.json").read_text())["status"] == "completed"


def test_the_search_offers_only_plans_that_fit(tmp_path: Path):
    """Most layouts of llama-3.1-8b on two GPUs run out of memory; suggest ranks only the others,
    generate --rank K takes the K-th of them, and when nothing fits the closest plan is an
    error's detail, never a plan."""
    ranked = invoke("suggest", *BIG, "--top", "40", "--json")
    assert ranked.exit_code == 0, ranked.output
    data = json.loads(ranked.stdout)
    assert data["rejected"]["out_of_memory"] > 0 and len(data["plans"]) == 40
    assert all(p["fits"] and p["memory"]["peak_bytes"] <= p["memory"]["capacity_bytes"] for p in data["plans"])
    result = invoke("generate", *BIG, "--rank", "3", "--out", str(tmp_path / "r3"), "--json")
    assert result.exit_code == 0 and result.stderr == "", result.output
    assert json.loads(result.stdout)["plan"]["fits"] is True
    nothing = invoke("suggest", "--model", "llama-3.1-405b", "--nodes", "1", "--json")
    assert nothing.exit_code == 2 and json.loads(nothing.stdout)["plans"] == []
    assert re.search(r"^error: no plan fits", nothing.stderr)


def test_the_fallback_hint_names_only_what_the_closest_plan_has_not_tried():
    """When no relaxed search fits either, the hint lists the generic memory savers less the ones
    the closest plan already takes: DeepSeek-V3 on 4 DGX H100, everything pinned, already
    offloading, recomputing in full at micro-batch 1 (Megatron-FSDP needs --pp 1)."""
    from planner import api
    from planner.errors import UserError

    with pytest.raises(UserError) as err:
        api.suggest("deepseek-v3", api.load_cluster("dgx-h100", 4), global_batch=256, seq_len=4096,
                    framework="megatron", tp=1, pp=2, virtual_stages=2, ep=8, zero=1, micro_batch=1, recompute="full")
    text = str(err.value)
    assert "recompute-full" in text and "offload-optimizer" in text and "mb1x16" in text  # the closest plan
    assert text.endswith("try more nodes or zero 3 pp 1."), text  # the API names parameters, the CLI flags
