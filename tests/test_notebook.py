"""notebooks/tradeoffs.ipynb: stored without outputs, and it runs top to bottom headless."""

from __future__ import annotations

import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO_ROOT

NOTEBOOK = REPO_ROOT / "notebooks" / "tradeoffs.ipynb"
TIMEOUT_S = 240  # per cell; the whole notebook runs in well under a minute on two cores


def _read():
    return nbformat.read(NOTEBOOK, as_version=4)


def test_notebook_is_stored_without_outputs():
    nb = _read()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [], cell.source[:60]
        assert cell.execution_count is None, cell.source[:60]
    assert nb.metadata.kernelspec.name == "python3"


def test_every_plot_has_a_sentence_saying_what_it_shows():
    cells = _read().cells
    plotting = [i for i, c in enumerate(cells) if c.cell_type == "code" and "plots.plot_" in c.source]
    assert len(plotting) >= 7
    shown = {name for c in cells if c.cell_type == "code" for name in
             ("plot_scaling", "plot_pareto", "plot_heatmap", "plot_zero", "plot_partition", "plot_fabric",
              "plot_vision")
             if name in c.source}
    assert len(shown) == 7
    for i in plotting:
        before = cells[i - 1]
        assert before.cell_type == "markdown", cells[i].source[:60]
        assert "show" in before.source.lower() and len(before.source.split()) > 15


@pytest.fixture(scope="module")
def executed():
    nb = _read()
    # One extra cell, in memory only: which interpreter the kernel runs.
    nb.cells.append(nbformat.v4.new_code_cell(
        "import sys, matplotlib; print(sys.executable); print(matplotlib.get_backend())"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPLBACKEND", "Agg")  # no display; the kernel inherits it
        # jupyter_client starts a "python" kernelspec with sys.executable: this venv's interpreter.
        NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def test_notebook_runs_without_errors_and_draws_every_plot(executed):
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 8  # scaling, Pareto, heatmap, ZeRO, partition, two fabric, images/tiles
    assert all(len(o["data"]["image/png"]) > 10_000 for o in images)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "deepseek-vl2" in text and "llama-2-70b" in text
    last = executed.cells[-1].outputs[0]["text"].split()
    assert os.path.realpath(last[0]) == os.path.realpath(sys.executable)
