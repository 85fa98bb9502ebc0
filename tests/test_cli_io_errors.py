"""Bad input around files and streams: unwritable output paths, a full or closed stdout,
non-finite hardware numbers, import warnings, and --rank with --plan.

Each failure must be one line naming the option and the fix, exit status 2, no traceback, and
(for ``generate``) nothing written. The paths used fail even for root: /proc and /sys refuse new
entries, and nothing can be created under a regular file.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import main
from planner.resources import hardware_profiles_dir

HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"

needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir() or not Path("/sys/kernel").is_dir(),
                                reason="needs Linux /proc and /sys")
needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def run_dsplan(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter (real stdout/stderr, real warnings set-up)."""
    return subprocess.run([sys.executable, "-m", "planner", *args], text=True, **kwargs)


def assert_one_line_error(result, *needles: str) -> str:
    """Exit 2, no traceback, one ``error:`` line on stderr holding every needle; that line."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(directory: Path) -> dict[str, bytes] | None:
    if not directory.exists():
        return None
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    result = invoke("estimate", "--model", "gpt3-125m", "--nodes", "1", "--json")
    assert result.exit_code == 0, result.output
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(result.stdout)
    return path


# --- A: unwritable output paths ---------------------------------------------------------------


@needs_proc
@pytest.mark.parametrize("out, reason", [("/proc/dsplan-x", "No such file or directory"),
                                         ("/sys/dsplan-x", "not permitted")])
def test_generate_into_proc_or_sys_names_out(plan_file: Path, out: str, reason: str):
    assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--out", out),
                          f"cannot write --out {out}", reason, "choose a writable directory")
    assert not Path(out).exists()


def test_generate_under_a_regular_file_names_out_and_the_file(plan_file: Path, tmp_path: Path):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out in (afile / "sub", afile / "sub" / "deeper"):
        assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--out", str(out)),
                              f"cannot write --out {out}", f"{afile} is not a directory")
    assert afile.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_generate_search_path_fails_before_the_search(tmp_path: Path):
    """--out under a file is refused while parsing, so the (slow) search never runs."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert_one_line_error(invoke("generate", "--model", "vl2", "--nodes", "8", "--out", str(afile / "run")),
                          "--out", "is not a directory")


def _fail_on_call(monkeypatch, n: int, code: int = errno.ENOSPC) -> None:
    """Make the n-th staged file of write_run_dir fail, as a full disk would."""
    from planner.emit import write

    real = write._stage
    calls = {"n": 0}

    def stage(path, content, executable):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(code, os.strerror(code), str(path.parent / f".{path.name}.xxxx.tmp"))
        return real(path, content, executable)

    monkeypatch.setattr(write, "_stage", stage)


def test_generate_failing_midway_leaves_no_directory(plan_file: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "new" / "run"
    _fail_on_call(monkeypatch, 4)
    assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--out", str(out)),
                          f"cannot write --out {out}", "No space left on device", "free some space")
    assert not (tmp_path / "new").exists()  # the directories it created are gone too
    assert list(tmp_path.iterdir()) == []


def test_generate_failing_midway_leaves_an_existing_run_unchanged(plan_file: Path, tmp_path: Path, monkeypatch):
    out = tmp_path / "run"
    assert invoke("generate", "--plan", str(plan_file), "--out", str(out)).exit_code == 0
    before = snapshot(out)
    _fail_on_call(monkeypatch, 2, errno.EACCES)
    assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--out", str(out), "--master-port", "29600"),
                          f"cannot write --out {out}", "Permission denied")
    assert snapshot(out) == before  # no temporary file left behind either
    monkeypatch.undo()
    assert invoke("generate", "--plan", str(plan_file), "--out", str(out), "--master-port", "29600").exit_code == 0
    assert snapshot(out) != before


@needs_proc
@pytest.mark.parametrize("flag", ["--draw", "--dot"])
def test_topo_into_proc(flag: str):
    if flag == "--draw":
        pytest.importorskip("matplotlib")
    name = "/proc/dsplan-x" + (".png" if flag == "--draw" else ".dot")
    assert_one_line_error(invoke("topo", "--nodes", "2", flag, name), f"cannot write {flag} {name}",
                          "choose a writable directory")


@pytest.mark.parametrize("flag", ["--draw", "--dot"])
def test_topo_into_a_missing_directory_or_a_file(flag: str, tmp_path: Path):
    ext = ".png" if flag == "--draw" else ".dot"
    missing = tmp_path / "nonexistent" / "dir" / f"x{ext}"
    assert_one_line_error(invoke("topo", "--nodes", "2", flag, str(missing)),
                          f"cannot write {flag} {missing}", f"directory {missing.parent} does not exist")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert_one_line_error(invoke("topo", "--nodes", "2", flag, str(afile / f"x{ext}")),
                          f"cannot write {flag} {afile / f'x{ext}'}", f"{afile} is not a directory")
    assert_one_line_error(invoke("topo", "--nodes", "2", flag, str(tmp_path)), f"cannot write {flag} {tmp_path}",
                          "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@needs_proc
def test_plot_into_proc():
    pytest.importorskip("matplotlib")
    assert_one_line_error(invoke("plot", "pareto", "--model", "gpt3-125m", "--nodes", "1",
                                 "--out", "/proc/dsplan-x.png"),
                          "cannot write --out /proc/dsplan-x.png", "choose a writable directory")


def test_plot_into_a_missing_directory(tmp_path: Path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "no" / "x.png"
    assert_one_line_error(invoke("plot", "pareto", "--model", "gpt3-125m", "--nodes", "1", "--out", str(out)),
                          f"cannot write --out {out}", "does not exist")


@needs_dev_full
@pytest.mark.parametrize("args", [("models",), ("estimate", "--model", "gpt3-1.3b", "--nodes", "1", "--json"),
                                  ("hardware",), ("--help",)])
def test_full_stdout_is_one_line_and_status_2(args: tuple[str, ...]):
    with open("/dev/full", "w") as full:
        proc = run_dsplan(*args, stdout=full, stderr=subprocess.PIPE)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: cannot write to standard output: No space left on device "
                     "(free some space, or send the output elsewhere)"], proc.stderr


@pytest.mark.parametrize("args", [("models",), ("estimate", "--model", "gpt3-1.3b", "--nodes", "1", "--json"),
                                  ("estimate", "--model", "gpt3-1.3b", "--nodes", "1"),
                                  ("suggest", "--model", "gpt3-1.3b", "--nodes", "1"),
                                  ("suggest", "--model", "gpt3-1.3b", "--nodes", "1", "--json"), ("--help",)])
def test_closed_stdout_exits_quietly_with_status_0(args: tuple[str, ...]):
    """The reader took what it wanted (`dsplan ... | head`): no message, and status 0, so a
    pipeline under `set -o pipefail` does not fail for it. rich's, click's and print's writes alike."""
    proc = subprocess.Popen([sys.executable, "-m", "planner", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()  # the reader is gone before the first write: `dsplan ... | head -0`
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == ""


def test_suggest_into_head_takes_the_first_line_and_exits_0():
    """`dsplan suggest | head -1`, in a shell with pipefail: the first line, status 0 for both
    (the output outgrows the pipe, so dsplan writes after head has left)."""
    script = (f"set -o pipefail; {shlex.quote(sys.executable)} -m planner suggest --model gpt3-1.3b --nodes 1 "
              "--top 1000 | head -1")  # 400 KB: more than the pipe holds
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpt3-1.3b on 1 x 8 dgx-a100-80g") and proc.stdout.count("\n") == 1
    assert proc.stderr == ""


def test_unrelated_os_errors_are_not_blamed_on_an_output_option(tmp_path: Path, monkeypatch):
    """An OSError on some other path is a bug: it keeps its traceback, and --out is not named."""
    from planner.emit import write

    def boom(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/somewhere/else")

    monkeypatch.setattr(write, "write_run_dir", boom)
    result = invoke("generate", "--model", "gpt3-125m", "--nodes", "1", "--out", str(tmp_path / "run"))
    assert isinstance(result.exception, PermissionError)
    assert "--out" not in result.output


# --- B: non-finite numbers in a hardware profile ----------------------------------------------


def _broken_profile(tmp_path: Path, old: str, new: str) -> Path:
    text = (hardware_profiles_dir() / "dgx-a100-80g.yaml").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "broken.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, field", [
    ("    bf16: 312\n", "    bf16: .inf\n", "gpu.peak_TFLOPs.bf16"),
    ("  hbm_GBps: 2039\n", "  hbm_GBps: .inf\n", "gpu.hbm_GBps"),
    ("  tdp_W: 400\n", "  tdp_W: .nan\n", "gpu.tdp_W"),
    ("    speed_gbit: 200 ", "    speed_gbit: .inf ", "node.nics.speed_gbit"),
    ("  oversubscription: 1.0 ", "  oversubscription: .inf ", "fabric.oversubscription"),
])
def test_non_finite_hardware_numbers_are_refused_at_load(tmp_path: Path, old: str, new: str, field: str):
    path = _broken_profile(tmp_path, old, new)
    for args in (("hardware", "show", str(path)),
                 ("estimate", "--model", "gpt3-125m", "--nodes", "1", "--hardware", str(path)),
                 ("suggest", "--model", "gpt3-125m", "--nodes", "1", "--hardware", str(path))):
        assert_one_line_error(invoke(*args), str(path), field, "finite number", "hardware_profiles/README.md")


# --- C: dsplan's warnings are one clean line --------------------------------------------------


@pytest.mark.parametrize("command", [("estimate", "--nodes", "1", "--json"), ("models", "show")])
def test_import_warning_is_one_clean_line(command: tuple[str, ...]):
    config = str(HF_CONFIGS / "unknown_type.json")
    args = (*command[:1], "--model", config, *command[1:]) if command[0] == "estimate" else (*command, config, "--json")
    proc = run_dsplan(*args, capture_output=True, env={**os.environ, "COLUMNS": "60"})
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("warning: ") and "fancy_llm" in lines[0], lines[0]
    assert "HFImportWarning" not in proc.stderr and ".py:" not in proc.stderr


def test_other_warnings_keep_pythons_format():
    """Only dsplan's own warning classes get the short form; others keep file:line: Category."""
    code = "\n".join([
        "import warnings",
        "from planner.cli import main",
        "@main.command('warn')",
        "def warn():",
        "    warnings.warn('third party', UserWarning)",
        "main(['warn'])",
    ])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning: third party" in proc.stderr and not proc.stderr.startswith("warning:")


# --- D: --rank with --plan --------------------------------------------------------------------


@pytest.mark.parametrize("rank", ["3", "1"])
def test_rank_with_plan_is_refused(plan_file: Path, tmp_path: Path, rank: str):
    out = tmp_path / "run"
    assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--rank", rank, "--out", str(out)),
                          "--plan", "drop --rank")
    assert not out.exists()


def test_rank_without_plan_still_defaults_to_the_best(tmp_path: Path):
    out = tmp_path / "run"
    result = invoke("generate", "--model", "gpt3-125m", "--nodes", "1", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert_one_line_error(invoke("generate", "--model", "gpt3-125m", "--nodes", "1", "--rank", "0", "--out", str(out)),
                          "--rank 0")


@pytest.mark.parametrize(("args", "needle"), [
    (["plot", "pareto", "--model", "gpt3-125m", "--out", "p.txt"],
     "--out p.txt: dsplan writes PNG here; name the file *.png"),
    (["topo", "--draw", "t.txt"], "--draw t.txt: dsplan writes PNG here; name the file *.png"),
    (["topo", "--dot", "t.png"], "--dot t.png: dsplan writes DOT here; name the file *.dot"),
])
def test_an_output_named_for_another_format_is_refused(args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke(*args), needle)
    assert list(tmp_path.iterdir()) == []


def test_topo_bytes_alone_predicts_an_all_reduce():
    r = invoke("topo", "--nodes", "2", "--bytes", "4GiB", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert (data["op"], data["bytes"], data["group_size"]) == ("allreduce", 4 * 2**30, 8)


def test_generate_never_reads_a_link_where_it_writes(plan_file: Path, tmp_path: Path):
    """A run-directory file that is a link to a device (/dev/zero would be read forever) is
    refused, not hashed."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "ds_config.json").symlink_to("/dev/zero")
    assert_one_line_error(invoke("generate", "--plan", str(plan_file), "--out", str(out)),
                          "ds_config.json is a link or special file")
    assert sorted(p.name for p in out.iterdir()) == ["ds_config.json"]
