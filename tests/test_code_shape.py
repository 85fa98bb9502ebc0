"""planner/ stays in small modules of short functions: no file over 400 lines, no function over
60 lines unless its docstring says why it must be long (a paragraph starting "Long:")."""

from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[1] / "planner"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def long_functions(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if lines > MAX_FUNCTION_LINES and not any(p.strip().startswith("Long:") for p in doc.split("\n\n")):
                out.append(f"{path.relative_to(PLANNER.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_planner_file_is_over_400_lines() -> None:
    big = [f"{p.relative_to(PLANNER.parent)} ({n} lines)" for p in sorted(PLANNER.rglob("*.py"))
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert big == []


def test_no_planner_function_is_over_60_lines_without_a_reason() -> None:
    found = [f for p in sorted(PLANNER.rglob("*.py")) for f in long_functions(p)]
    assert found == []


def test_the_checks_see_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n\n\n"
                                      f"def g():\n    \"\"\"Short.\n\n    Long: a table.\"\"\"\n{body}\n")
    global PLANNER
    saved, PLANNER = PLANNER, tmp_path
    try:
        assert [s.split(" ")[1] for s in long_functions(tmp_path / "long.py")] == ["f"]
    finally:
        PLANNER = saved
