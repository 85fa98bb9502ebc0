"""Messages name inputs in terms of the model and degrees (planner/errors.py ``arg``): the API
reads its keywords, the CLI its flags (planner/cli/flags.py), and nothing below the CLI spells
a flag itself."""

from __future__ import annotations

import ast
import importlib
import pickle
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner import api
from planner.cli import COMMAND_MODULES, main
from planner.cli.flags import FLAGS, cli_data, cli_text
from planner.errors import Message, UserError, arg, marked, spell

PLANNER = Path(__file__).resolve().parent.parent / "planner"
# Below the CLI: the cost model, the search, the API, and the hardware and model inputs it loads.
BELOW_THE_CLI = ["cost", "search", "hardware", "model", "api.py", "api_records.py", "explore.py"]
# Files another change is rewriting; their messages convert with it.
PENDING: set[str] = set()  # files not converted yet
# Megatron-LM's own flags that share a name with one of dsplan's (messages quote them on purpose).
MEGATRON_FLAGS = {"--sequence-parallel", "--optimizer"}


def _dsplan_flags() -> set[str]:
    flags = set()
    for name in COMMAND_MODULES:
        for command in importlib.import_module(f"planner.cli.{name}").commands:
            for param in command.params:
                flags |= {o for o in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ()))
                          if o.startswith("--")}
    return flags


def _sources() -> list[Path]:
    out = []
    for part in BELOW_THE_CLI:
        path = PLANNER / part
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _message_strings(tree: ast.AST):
    """String constants that are not docstrings (f-string parts included)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_message_below_the_cli_spells_a_flag() -> None:
    flags = _dsplan_flags()
    assert {"--tp", "--micro-batch", "--global-batch", "--stage-blocks"} <= flags
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(flags, key=len, reverse=True)))
                         + r")(?![\w-])")
    found = []
    for path in _sources():
        rel = path.relative_to(PLANNER).as_posix()
        if rel in PENDING:
            continue
        for node in _message_strings(ast.parse(path.read_text(encoding="utf-8"))):
            for m in pattern.finditer(node.value):
                if m[1] in MEGATRON_FLAGS and "megatron" in rel.lower() + node.value.lower():
                    continue
                found.append(f"planner/{rel}:{node.lineno}: {m[1]} in {node.value!r}")
    assert not found, "name inputs with planner.errors.arg, not the CLI's flags:\n" + "\n".join(found)


def test_every_marked_name_has_its_flag() -> None:
    names = set()
    for path in [*_sources(), PLANNER / "emit" / "render.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "arg" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "whole_number" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    assert {"tp", "micro_batch", "global_batch", "virtual_stages"} <= names
    assert names <= set(FLAGS), sorted(names - set(FLAGS))
    assert set(FLAGS.values()) <= _dsplan_flags(), sorted(set(FLAGS.values()) - _dsplan_flags())


def test_the_same_error_reads_with_flags_on_the_cli_and_keywords_in_the_api() -> None:
    with pytest.raises(UserError) as err:
        api.estimate("llama-3-8b", api.load_cluster(nodes=1), tp=3)
    assert str(err.value) == ("tp 3 x pp 1 = 3 does not divide the 8 GPUs (1 nodes x 8); pick degrees whose product "
                              "divides 8")
    result = CliRunner().invoke(main, ["estimate", "--model", "llama-3-8b", "--tp", "3"])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {cli_text(err.value)}"
    assert result.output.strip() == ("error: --tp 3 x --pp 1 = 3 does not divide the 8 GPUs (1 nodes x 8); pick "
                                     "degrees whose product divides 8")


def test_a_search_error_reads_the_same_way() -> None:
    with pytest.raises(UserError) as err:
        api.suggest("llama-3-8b", api.load_cluster(nodes=1), tp=3)
    assert str(err.value) == "tp 3 cannot divide the 8 GPUs; pick from 1, 2, 4, 8"
    result = CliRunner().invoke(main, ["suggest", "--model", "llama-3-8b", "--tp", "3"])
    assert result.output.strip() == "error: --tp 3 cannot divide the 8 GPUs; pick from 1, 2, 4, 8"


def test_framework_rules_and_advice_name_flags_only_on_the_cli() -> None:
    cluster = api.load_cluster(nodes=1)
    with pytest.raises(UserError) as err:
        api.estimate("llama-3-8b", cluster, pp=2, zero=2, global_batch=64)
    assert "(pp 2) rejects ZeRO-2" in str(err.value) and "use zero 1 or pp 1" in str(err.value)
    assert "(--pp 2) rejects ZeRO-2" in cli_text(err.value) and "use --zero 1 or --pp 1" in cli_text(err.value)
    with pytest.raises(UserError) as nothing:
        api.suggest("llama-3.1-70b", cluster, tp=8, zero=0, framework="megatron")
    advice = nothing.value.result.advice
    assert "optimizer offload (offload optimizer)" in advice and all(isinstance(a, Message) for a in advice)
    assert "optimizer offload (--offload optimizer)" in cli_data({"advice": advice})["advice"]
    assert "would fit with: optimizer offload (offload optimizer)" in str(nothing.value)
    assert "would fit with: optimizer offload (--offload optimizer)" in cli_text(nothing.value)


def test_messages_keep_their_marks_through_copies_and_data() -> None:
    text = f"{arg('global_batch')} 24 gives this layout 12 micro-batches"
    note = Message(text)
    assert note == "global_batch 24 gives this layout 12 micro-batches" and marked(note) == text
    assert pickle.loads(pickle.dumps(note)).marked == text
    assert cli_data({"notes": [note], "n": 1, "plain": "--x"}) == {
        "notes": ["--global-batch 24 gives this layout 12 micro-batches"], "n": 1, "plain": "--x"}
    err = UserError(note)
    assert str(err) == note and cli_text(err) == "--global-batch 24 gives this layout 12 micro-batches"
    assert spell(f"{arg('no_sequence_parallel')}") == "sequence_parallel=False"
    assert cli_text(arg("no_sequence_parallel")) == "--no-sequence-parallel"
    with pytest.raises(ValueError):
        arg("--tp")


def test_emit_renders_plans_and_never_builds_a_search() -> None:
    """planner/emit renders a Plan: it imports neither the search nor the CLI."""
    for path in sorted((PLANNER / "emit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("planner.search", "planner.cli")), f"{path.name} imports {name}"
