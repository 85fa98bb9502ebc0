"""The repository stands alone: nothing in it reads the team folder ``../shared`` beside a
checkout (no user's clone has one); the published data it needs is in ``reference/``.

Every file of the product and its checks is scanned (tracked or not; Python's caches aside),
so the test also runs where there is no git, as in the copy ``.ci/run`` tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REFERENCE_DIR, REPO_ROOT

SCANNED = ("planner", "tests", "benchmarks", "notebooks", ".ci", "templates", "hardware_profiles", "pyproject.toml")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
THIS = Path(__file__).resolve()

# A path into a sibling "shared" folder, however it is spelt.
SIBLING_SHARED = re.compile(
    r"\.\.[/\\]shared\b"                          # ../shared, "$root/../shared", f"{x}/../shared"
    r"|\bshared/reference\b"                      # the team folder's layout, without its ../
    r"|/\s*[\"']shared[\"']"                      # Path(...).parent / "shared", parents[2] / 'shared'
    r"|[\"'](?:\.\.|shared)[\"']\s*,\s*[\"'](?:shared|reference)[\"']"  # os.path.join(x, "..", "shared", ...)
    r"|(?:pardir|parent)\s*,\s*[\"']shared[\"']"  # os.path.join(here, os.pardir, "shared")
    r"|joinpath\([^)]*[\"']shared[\"']"           # .joinpath("..", "shared")
    r"|\$\(dirname[^\n]*\)\"?/shared\b"           # "$(dirname "$(dirname "$0")")/shared"
)
# A citation of a reference file by its path in the repository.
CITED = re.compile(r"(?<![\w/.-])reference/[\w./-]+\.(?:csv|json|md)\b")


def _files() -> list[Path]:
    out = []
    for name in SCANNED:
        top = REPO_ROOT / name
        candidates = [top] if top.is_file() else top.rglob("*")
        for path in candidates:
            rel = path.relative_to(REPO_ROOT)
            if path.is_file() and not SKIPPED_DIRS & set(rel.parts) and path.suffix != ".pyc":
                out.append(path)
    return sorted(out)


def _text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def test_the_scan_covers_the_product_and_its_checks():
    rels = {p.relative_to(REPO_ROOT).as_posix() for p in _files()}
    for expected in ("pyproject.toml", ".ci/run", "tests/conftest.py", "benchmarks/bench_megatron_table1.py",
                     "planner/cost/memory.py", "notebooks/tradeoffs.ipynb", "hardware_profiles/dgx-h100.yaml"):
        assert expected in rels
    assert len(rels) > 150


@pytest.mark.parametrize("text", [
    'CSV = Path(__file__).resolve().parents[2] / "shared" / "reference" / "x.csv"',
    "REF = REPO_ROOT.parent / 'shared'",
    'see ../shared/reference/models/README.md',
    "# scripts' interleaving; shared/reference/megatron2021_table1_weak_scaling.csv",
    'os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference")',
    'os.path.join(root, os.pardir, "shared")',
    'here.parent.parent.joinpath("shared", "reference")',
    'cp -r "$(dirname "$(dirname "$0")")/shared" .',
    'ls "$root"/../shared/reference',
])
def test_a_path_to_the_sibling_shared_folder_is_recognised(text):
    assert SIBLING_SHARED.search(text)


@pytest.mark.parametrize("text", [
    'REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "x.csv"',
    "shared_ffn=shared * expert_ffn",
    "# DeepSpeed's CPU shared-memory all-reduce",
    'resource == "rdma/rdma_shared_device_a"',
    '"""Options shared by commands that take parallel degrees."""',
    "MoE with shared experts",
])
def test_ordinary_uses_of_the_word_shared_are_not(text):
    assert not SIBLING_SHARED.search(text)


def test_nothing_reads_or_cites_the_sibling_shared_folder():
    offenders = [f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
                 for path in _files() if path != THIS
                 for n, line in enumerate(_text(path).splitlines(), 1) if SIBLING_SHARED.search(line)]
    assert not offenders, "use reference/ in the repository instead:\n" + "\n".join(offenders)


def test_every_cited_reference_file_is_in_the_repository():
    missing = sorted({f"{path.relative_to(REPO_ROOT)}: {m}"
                      for path in _files() if path != THIS
                      for m in CITED.findall(_text(path)) if not (REPO_ROOT / m).is_file()})
    assert not missing, "\n".join(missing)


def test_the_reference_readme_has_an_entry_for_every_file():
    readme = (REFERENCE_DIR / "README.md").read_text()
    files = [p.relative_to(REFERENCE_DIR).as_posix() for p in REFERENCE_DIR.rglob("*") if p.is_file()]
    assert len(files) > 10
    unlisted = [f for f in files if f != "README.md" and f"`{f}`" not in readme
                and not (f.startswith("models/") and f.endswith(".json") and "`models/<name>.json`" in readme)]
    assert not unlisted, unlisted
