"""The run directory's container recipe (planner/emit/container.py, templates/Dockerfile.j2),
read by dockerfile-parse, and the SLURM script running its steps in the image (pyxis/enroot)."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner
from dockerfile_parse import DockerfileParser
from packaging.specifiers import SpecifierSet

from planner import __version__
from planner.cli import main
from planner.emit.container import DEEPSPEED_VERSION, MEGATRON_CORE_VERSION
from planner.emit.render import DEFAULT_IMAGE
from planner.emit.torchtitan_config import TORCHTITAN_VERSION
from tests.test_emit_scripts import run_with_stub


def _dockerfile(tmp_path: Path, framework: str, *extra: str) -> DockerfileParser:
    out = tmp_path / framework
    r = CliRunner().invoke(main, ["generate", "--model", "llama-3-8b", "--hardware", "dgx-h100", "--framework",
                                  framework, *extra, "--out", str(out)])
    assert r.exit_code == 0, r.output
    parser = DockerfileParser(str(out / "Dockerfile"))
    return parser


@pytest.mark.parametrize(("framework", "pins"), [
    ("deepspeed", [f"deepspeed=={DEEPSPEED_VERSION}"]),
    ("megatron", [f"megatron-core=={MEGATRON_CORE_VERSION}"]),
    ("torchtitan", [f"torchtitan=={TORCHTITAN_VERSION}"]),
])
def test_the_image_pins_the_runtime_the_plan_was_checked_for(tmp_path, framework, pins):
    extra = ("--zero", "3") if framework == "torchtitan" else ()
    df = _dockerfile(tmp_path, framework, *extra)
    assert df.baseimage == DEFAULT_IMAGE  # CUDA, torch, NCCL and TE pinned together by the NGC release
    commands = [i["instruction"] for i in df.structure if i["instruction"] != "COMMENT"]
    assert commands[:2] == ["ARG", "FROM"] and "RUN" in commands
    run = next(i["value"] for i in df.structure if i["instruction"] == "RUN")
    for pin in pins:
        assert f'"{pin}"' in run
    assert '"${DSPLAN_SPEC}"' in run and "torch.cuda.nccl.version()" in run
    assert df.args["DSPLAN_SPEC"] == f"dsplan=={__version__}"
    assert df.envs["DSPLAN_PYTHON"] == "python"


def test_the_pins_are_what_the_tests_run():
    # the DeepSpeed the project installs (pyproject's run extra), the torchtitan its config test loads
    assert SpecifierSet(">=0.19,<0.20").contains(DEEPSPEED_VERSION)
    assert version("torchtitan") == TORCHTITAN_VERSION


def test_slurm_runs_every_step_in_the_container_when_asked(tmp_path: Path, fake_bin: Path):
    run_dir = tmp_path / "run"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(run_dir),
           "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7",
           "DSPLAN_CONTAINER_IMAGE": "registry.example/dsplan/llama:1"}
    _, _, launches = run_with_stub(tmp_path, ("llama-3.1-8b", 2, dict(zero_stage=1)),
                                   ["bash", str(run_dir / "slurm.sbatch")], env=env)
    srun = next(e for e in launches if e["cmd"] == "srun")["argv"]
    assert "--container-image=registry.example/dsplan/llama:1" in srun
    assert f"--container-mounts={run_dir.resolve()}:{run_dir.resolve()}" in srun
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = {k: v for k, v in env.items() if k != "DSPLAN_CONTAINER_IMAGE"}
    _, _, launches = run_with_stub(plain_dir, ("llama-3.1-8b", 2, dict(zero_stage=1)),
                                   ["bash", str(plain_dir / "run" / "slurm.sbatch")],
                                   env={**plain, "SLURM_SUBMIT_DIR": str(plain_dir / "run")})
    assert not any(a.startswith("--container") for a in next(e for e in launches if e["cmd"] == "srun")["argv"])
