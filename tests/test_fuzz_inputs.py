"""Fuzzed bad input: every command's flags, a config.json and a hardware YAML, each mutated.

Whatever the input, dsplan answers with exit status 2 and one message (or 0 where the input
is in fact valid), never a traceback, and within a time limit. The seeds (``@example``) are the
cases that once hung or crashed (issue #28): a divisor loop over ``--global-batch 2**62``, a
graph of 2**64 NICs, int64 codes overflowing at 2**48, RecursionErrors of files nested 1,000
deep, Python's 4,300-digit limit, file names too long for the file system, and numbers past
any cluster (planner/limits.py). ``run`` is only given a run directory that does not exist, so
no value can start a job.

The runs are deterministic and short (CI); ``DSPLAN_FUZZ_EXAMPLES=2000`` fuzzes longer, with
fresh random draws.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager
from itertools import count
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from planner.cli import COMMAND_MODULES, _load, main
from planner.model.catalog import PRESETS_DIR
from planner.resources import hardware_profiles_dir

CALL_LIMIT_S = 10.0  # one command, whatever its input: the slowest valid case here takes ~1 s
HANG_S = 30  # a call still running then has hung: fail it instead of the suite

_EXAMPLES = int(os.environ.get("DSPLAN_FUZZ_EXAMPLES", "0"))


def _settings(examples: int):
    return settings(max_examples=_EXAMPLES or examples, deadline=None, database=None, derandomize=not _EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- invoking the CLI ----------------------------------------------------------------------------

_fresh = count()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@contextmanager
def _hang_guard(argv: list[str]):
    def hung(signum, frame):
        raise AssertionError(f"dsplan {_shown(argv)} still running after {HANG_S} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _shown(argv: list[str]) -> str:
    return " ".join(a if len(a) <= 40 else f"{a[:20]}...({len(a)} chars)" for a in argv)


def invoke(argv: list[str]) -> click.testing.Result:
    """Run ``dsplan argv`` in-process; assert exit 0 or 2 (estimate: or 3), no traceback, in time, one message."""
    started = time.perf_counter()
    with _hang_guard(argv):
        result = CliRunner().invoke(main, argv)
    elapsed = time.perf_counter() - started
    shown = _shown(argv)
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"dsplan {shown}: {result.exception!r}\n{result.output[-2000:]}"
    assert "Traceback" not in result.output, f"dsplan {shown}:\n{result.output[-2000:]}"
    # 3: estimate's "does not fit" (docs/planning.md, exit codes), a valid plan that needs more memory.
    allowed = (0, 2, 3) if argv[:1] == ["estimate"] else (0, 2)
    assert result.exit_code in allowed, f"dsplan {shown}: exit {result.exit_code}\n{result.output[-2000:]}"
    assert elapsed < CALL_LIMIT_S, f"dsplan {shown} took {elapsed:.1f} s"
    if result.exit_code == 2:
        errors = [line for line in result.stderr.splitlines() if line.lower().startswith("error:")]
        assert len(errors) == 1, f"dsplan {shown}: want one error line, got:\n{result.stderr[-2000:]}"
    return result


# -- every command's flags -------------------------------------------------------------------------

for _name in COMMAND_MODULES:
    _load(_name)

NO_RUN_DIR = "/nonexistent/dsplan-fuzz/run"  # `run` never finds a job to start
# A valid call of each command; fuzzing changes one option of it. {out} is a fresh path.
BASES: dict[tuple[str, ...], list[str]] = {
    ("models",): [],
    ("models", "show"): ["gpt3-125m"],
    ("hardware",): [],
    ("hardware", "show"): ["dgx-a100-80g"],
    ("topo",): [],
    ("estimate",): ["--model", "gpt3-125m"],
    ("suggest",): ["--model", "gpt3-125m"],
    ("generate",): ["--model", "gpt3-125m", "--out", "{out}"],
    ("plot",): ["pareto", "--model", "gpt3-125m", "--out", "{out}.png"],
    ("run",): [NO_RUN_DIR],
    # --device cuda on a machine without one stops before measuring (a real profile takes a minute)
    ("profile",): ["--model", "gpt3-125m", "--device", "cuda", "--out", "{out}.json"],
    ("calibrate",): [str(Path(__file__).parent / "data" / "calibrate" / "run-dp8"), "--out", "{out}.yaml"],
}
# Outputs (their own tests: tests/test_cli_io_errors.py) and `run`'s directory are not fuzzed.
SKIPPED = {"--out", "--draw", "--dot", "run_dir", "entry_args"}


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in sorted(group.commands.items()):
        yield path + (name,), command
        if isinstance(command, click.Group):
            yield from _commands(command, path + (name,))


COMMANDS = dict(_commands(main))


def _inputs(command: click.Command) -> list[str]:
    """The options (by flag) and arguments (by name) of a command that take a value."""
    out = []
    for param in command.params:
        if isinstance(param, click.Option) and not param.is_flag:
            out.append(param.opts[0])
        elif isinstance(param, click.Argument):
            out.append(param.name)
    return [name for name in out if name not in SKIPPED]


INPUTS = [(path, name) for path, command in COMMANDS.items() for name in _inputs(command)]


def test_every_command_and_input_is_fuzzed() -> None:
    assert set(BASES) == set(COMMANDS), "give each command a valid call in BASES"
    fuzzed = {name for _, name in INPUTS}
    assert {"--global-batch", "--nodes", "--tp", "--model", "--hardware", "--hang-timeout", "--grace", "--bytes",
            "--top", "model", "name_or_path"} <= fuzzed


def _argv(path: tuple[str, ...], name: str, value: str, work: Path) -> list[str]:
    out = str(work / f"out{next(_fresh)}")
    base = [a.replace("{out}", out) for a in BASES[path]]
    if not name.startswith("--"):  # the command's one argument
        return [*path, value, *base[1:]] if base and not base[0].startswith("--") else [*path, value, *base]
    if name in base:
        i = base.index(name)
        return [*path, *base[:i + 1], value, *base[i + 2:]]
    return [*path, *base, name, value]


HUGE = ["1" + "0" * 310, "1" + "0" * 400, "7" * 5000, str(2**62), str(2**48), str(2**50), str(2**64), "9" * 4301]
SPECIAL = ["nan", "inf", "-inf", "", " ", "-1", "0", "1e30", "1.5", "0x10", ",", "1,", "1,,2", "-", "\x00",
           "a" * 5000, f"2,{2**40}", "٣", "../" * 2000 + "x.json", "x" * 300 + ".yaml", "none,bogus"]
VALUES = st.one_of(
    st.sampled_from(HUGE + SPECIAL),
    st.integers(min_value=2**24, max_value=2**90).map(str),
    st.integers(min_value=-2**70, max_value=0).map(str),
    st.integers(min_value=1, max_value=64).map(str),  # mostly valid: must still answer in time
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30),
)


@_settings(150)
@given(case=st.sampled_from(INPUTS), value=VALUES)
@example(case=(("suggest",), "--global-batch"), value=str(2**62))  # the O(sqrt n) divisor loop: hours
@example(case=(("suggest",), "--global-batch"), value=str(2**48))  # IndexError (int64 key codes overflowed)
@example(case=(("suggest",), "--global-batch"), value=str(2**50))  # KeyError in search/bounds.py
@example(case=(("suggest",), "--global-batch"), value="1" + "0" * 310)  # OverflowError
@example(case=(("suggest",), "--model"), value="a" * 5000)  # OSError: file name too long
@example(case=(("suggest",), "--hardware"), value="a" * 5000)
@example(case=(("topo",), "--nodes"), value="1" + "0" * 400)  # OverflowError
@example(case=(("topo",), "--nodes"), value="1" + "0" * 300)  # printed the GPU count
@example(case=(("estimate",), "--nodes"), value=str(2**40))  # printed 1.1e18 tokens/s
@example(case=(("run",), "--hang-timeout"), value="nan")  # accepted
@example(case=(("run",), "--grace"), value="inf")  # accepted
@example(case=(("topo",), "--bytes"), value="7" * 400)  # OverflowError: float infinity
@example(case=(("suggest",), "--top"), value=str(2**62))  # evaluated every candidate in full
@example(case=(("generate",), "--entry"), value="a" * 5000)
def test_flag_values(case: tuple[tuple[str, ...], str], value: str, work: Path) -> None:
    path, name = case
    argv = _argv(path, name, value, work)
    result = invoke(argv)
    if result.exit_code == 2 and value in HUGE and name.startswith("--") and path != ("run",):
        # the message names the flag, or what it sets ("unknown model"; run's missing directory comes first)
        assert name in result.stderr or name[2:].split("-")[0] in result.stderr.lower(), result.stderr


def test_the_seeds_read_as_the_issue_wants(work: Path) -> None:
    """The messages name the input and the largest value it may take."""
    r = invoke(["suggest", "--model", "gpt3-125m", "--global-batch", str(2**62)])
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: --global-batch: 2**62 is above the largest supported 16,777,216 samples "
                                "(a thousand times the largest published batches); give at most 16,777,216")
    r = invoke(["estimate", "--model", "gpt3-125m", "--nodes", str(2**40)])
    assert r.exit_code == 2 and "--nodes: 1,099,511,627,776 is above the largest supported 1,048,576 nodes" in r.stderr
    r = invoke(["estimate", "--model", "gpt3-125m", "--nodes", str(2**17 + 1)])  # x 8 GPUs: over 2**20
    assert r.exit_code == 2 and "--nodes 131,073 x 8 GPUs per node = 1,048,584 GPUs is above" in r.stderr
    assert "give at most 131,072 nodes of dgx-a100-80g" in r.stderr
    r = invoke(["topo", "--nodes", "1" + "0" * 400])
    assert r.exit_code == 2 and "--nodes: a 401-digit number is above" in r.stderr
    r = invoke(["suggest", "--model", "gpt3-125m", "--tp", "7" * 5000])
    assert r.exit_code == 2 and "--tp: a 5,000-digit number is above the largest supported 1,048,576" in r.stderr
    r = invoke(["run", NO_RUN_DIR, "--hang-timeout", "nan"])
    assert r.exit_code == 2 and "'nan' is not a number of seconds from 1 to 604,800" in r.stderr
    r = invoke(["run", NO_RUN_DIR, "--grace", "inf"])
    assert r.exit_code == 2 and "'inf' is not a number of seconds from 0 to 3,600" in r.stderr
    r = invoke(["suggest", "--model", "a" * 5000])
    assert r.exit_code == 2 and "unknown model 'aaaa" in r.stderr and "(5,000 characters)" in r.stderr
    r = invoke(["estimate", "--model", "gpt3-125m", "--hardware", "a" * 5000])
    assert r.exit_code == 2 and "unknown hardware profile 'aaaa" in r.stderr
    r = invoke(["suggest", "--model", "gpt3-125m", "--seq-len", str(2**20), "--global-batch", str(2**13)])
    assert r.exit_code == 2 and "= 8,589,934,592 tokens per step is above the largest supported" in r.stderr


# -- config.json and hardware YAML -----------------------------------------------------------------

DEEP = 1000
BIG_DIGITS = "7" * 5000


def _leaves(data, path=()):
    """The paths of every value in nested dicts and lists."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield path + (key,)
            yield from _leaves(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield path + (i,)
            yield from _leaves(value, path + (i,))


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


def _deep(levels: int):
    out: dict = {}
    for _ in range(levels - 1):
        out = {"a": out}
    return out


# A mutated value: "<DIGITS>" and "<DEEP>" are written into the text (json and yaml cannot write them).
BAD_FIELD_VALUES = st.one_of(
    st.sampled_from([0, -1, 1e30, -1e30, float("nan"), float("inf"), 2**64, 2**62, 10**30, 1e308, 0.5, True, None,
                     "", "x" * 5000, [], {}, [[[[]]]], "<DIGITS>", "<DEEP>", 18446744073709551616]),
    st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10, alphabet=st.characters(exclude_categories=("Cs",))),
)

CONFIGS = {name: json.loads((PRESETS_DIR / f"{name}.json").read_text())["config"]
           for name in ("gpt3-125m", "deepseek-v2-lite", "qwen2-vl-7b", "mixtral-8x7b")}
CONFIG_PATHS = [(name, path) for name, config in CONFIGS.items() for path in _leaves(config)]


def _config_text(name: str, path: tuple, value) -> str:
    config = json.loads(json.dumps(CONFIGS[name]))
    _set(config, path, "<VALUE>" if value in ("<DIGITS>", "<DEEP>") else value)
    text = json.dumps(config)
    if value == "<DIGITS>":
        return text.replace('"<VALUE>"', BIG_DIGITS)
    if value == "<DEEP>":
        return text.replace('"<VALUE>"', '{"a": ' * DEEP + "1" + "}" * DEEP)
    return text


@_settings(60)
@given(case=st.sampled_from(CONFIG_PATHS), value=BAD_FIELD_VALUES)
@example(case=("gpt3-125m", ("n_embd",)), value=1e30)  # priced a plan at 5.6e29 GiB
@example(case=("gpt3-125m", ("n_embd",)), value="<DIGITS>")  # ValueError: Python's 4,300-digit limit
@example(case=("gpt3-125m", ("n_head",)), value="<DEEP>")  # RecursionError
@example(case=("gpt3-125m", ("n_layer",)), value=10**30)
@example(case=("deepseek-v2-lite", ("n_routed_experts",)), value=2**62)
@example(case=("qwen2-vl-7b", ("vision_config", "spatial_patch_size")), value=float("nan"))
def test_config_json_fields(case: tuple[str, tuple], value, work: Path) -> None:
    name, path = case
    file = work / f"config{next(_fresh)}.json"
    file.write_text(_config_text(name, path, value))
    invoke(["estimate", "--model", str(file)])


def test_a_config_nested_deep_or_with_huge_numbers_names_the_file(work: Path) -> None:
    file = work / "deep.json"
    file.write_text(_config_text("gpt3-125m", ("rope_scaling",), "<DEEP>"))
    r = invoke(["models", "show", str(file)])
    assert r.exit_code == 2 and f"{file}: nested too deeply to read" in r.stderr
    file.write_text(json.dumps({**CONFIGS["gpt3-125m"], "rope_scaling": _deep(100)}))
    r = invoke(["models", "show", str(file)])
    assert r.exit_code == 2 and f"{file}: nested more than 64 levels deep" in r.stderr
    file.write_text(_config_text("gpt3-125m", ("n_embd",), "<DIGITS>"))
    r = invoke(["models", "show", str(file)])
    assert r.exit_code == 2 and f"{file}: a number at line 1 has 5,000 digits" in r.stderr
    file.write_text(json.dumps({**CONFIGS["gpt3-125m"], "n_embd": 1e30}))
    r = invoke(["estimate", "--model", str(file)])
    assert r.exit_code == 2 and "field 'n_embd' must be at most 131,072" in r.stderr


PROFILE = yaml.safe_load((hardware_profiles_dir() / "dgx-a100-80g.yaml").read_text())
PROFILE_PATHS = list(_leaves(PROFILE))


def _profile_text(path: tuple, value) -> str:
    profile = json.loads(json.dumps(PROFILE))
    _set(profile, path, "<VALUE>" if value in ("<DIGITS>", "<DEEP>") else value)
    text = yaml.safe_dump(profile)
    if value == "<DIGITS>":
        return text.replace("<VALUE>", BIG_DIGITS)
    if value == "<DEEP>":
        return text.replace("<VALUE>", "[" * DEEP + "]" * DEEP)
    return text


@_settings(60)
@given(path=st.sampled_from(PROFILE_PATHS), value=BAD_FIELD_VALUES)
@example(path=("node", "nics", "count"), value=18446744073709551616)  # built a graph for ever
@example(path=("node", "gpus"), value="<DEEP>")  # RecursionError
@example(path=("gpu", "memory_GiB"), value="<DIGITS>")  # ValueError: Python's 4,300-digit limit
@example(path=("fabric", "switch_radix"), value=10**30)
@example(path=("node", "intra", "bw_GBps"), value=1e308)
def test_hardware_yaml_fields(path: tuple, value, work: Path) -> None:
    file = work / f"profile{next(_fresh)}.yaml"
    file.write_text(_profile_text(path, value))
    invoke(["estimate", "--model", "gpt3-125m", "--hardware", str(file), "--nodes", "2"])


def test_a_profile_with_2_to_the_64_nics_or_nested_deep_names_the_file(work: Path) -> None:
    file = work / "nics.yaml"
    file.write_text(_profile_text(("node", "nics", "count"), 2**64))
    for argv in (["hardware", "show", str(file)], ["topo", "--hardware", str(file)]):
        r = invoke(argv)
        assert r.exit_code == 2 and f"{file}: invalid field(s): node.nics.count: Input should be less than or " \
                                    "equal to 1152" in r.stderr
        assert "the bound is two NICs per GPU of the largest node" in r.stderr
    file.write_text(_profile_text(("description",), "<DEEP>"))
    r = invoke(["hardware", "show", str(file)])
    assert r.exit_code == 2 and f"{file}: nested too deeply to read" in r.stderr
