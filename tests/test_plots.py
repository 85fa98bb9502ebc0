"""Trade-off sweeps (planner/explore.py), their plots (planner/plots.py) and ``dsplan plot``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from matplotlib.figure import Figure
from matplotlib.image import imread

from planner import api, explore, plots
from planner.cli import main
from planner.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SEARCH = {"framework": "deepspeed"}


@pytest.fixture(scope="module")
def one_node():
    return api.load_cluster("dgx-a100-80g", nodes=1)


@pytest.fixture(scope="module")
def llama_candidates(one_node):
    return explore.candidates("llama-3-8b", one_node, **SEARCH)


def _png_size(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = imread(path)
    return img.shape[1], img.shape[0]


# -- sweeps ---------------------------------------------------------------------------------


def test_pareto_front_keeps_exactly_the_non_dominated_rows():
    rows = [{"id": i, "peak_bytes": m, "tokens_per_s": t}
            for i, (m, t) in enumerate([(5, 10), (3, 8), (3, 9), (7, 10), (1, 2), (6, 12), (2, 2), (4, 9)])]
    front = explore.pareto_front(rows)
    assert [r["id"] for r in front] == [4, 2, 0, 5]
    for r in rows:  # every row is on the front or dominated by a front row
        on = any(f["id"] == r["id"] for f in front)
        dominated = any(f["peak_bytes"] <= r["peak_bytes"] and f["tokens_per_s"] >= r["tokens_per_s"]
                        and f["id"] != r["id"] for f in front)
        assert on != dominated or (on and not dominated)
    assert explore.pareto_front([]) == []


def test_candidates_are_the_search_space_scored_like_estimate(one_node, llama_candidates):
    rows = llama_candidates
    found = api.suggest("llama-3-8b", one_node, top=1, **SEARCH)
    assert len(rows) == found.evaluated
    fitting = [r for r in rows if r["fits"]]
    assert 0 < len(fitting) < len(rows)
    assert all(r["framework"] == "deepspeed" for r in rows)
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    assert fitting[0]["tokens_per_s"] == pytest.approx(found.plans[0].plan.tokens_per_s, rel=1e-9)
    # Single-stage candidates need no partition: estimate gives the same numbers.
    for r in [r for r in rows if r["pp"] == 1][:: max(1, len(rows) // 12)]:
        plan = api.estimate("llama-3-8b", one_node, workload=api.make_workload("llama-3-8b", gpus=8), tp=r["tp"],
                            zero=r["zero_stage"], offload=r["offload"], micro_batch=r["micro_batch"],
                            recompute=r["recompute"], sequence_parallel=r["sequence_parallel"],
                            framework=r["framework"], cp=r["cp"], cp_comm=r["cp_comm"])
        assert plan.step_time_s == pytest.approx(r["step_time_s"], rel=1e-6)
        assert plan.memory.peak == pytest.approx(r["peak_bytes"], rel=1e-6)
        assert plan.mfu == pytest.approx(r["mfu"], rel=1e-6)
        assert plan.fits == r["fits"]


def test_tp_pp_grid_takes_the_best_fitting_candidate_per_cell(llama_candidates):
    grid = explore.tp_pp_grid(llama_candidates)
    cells = {(r["tp"], r["pp"]): r for r in grid}
    assert set(cells) == {(r["tp"], r["pp"]) for r in llama_candidates}
    for (tp, pp), cell in cells.items():
        fits = [r["tokens_per_s"] for r in llama_candidates if (r["tp"], r["pp"]) == (tp, pp) and r["fits"]]
        assert cell["tokens_per_s"] == (max(fits) if fits else 0.0)
        assert cell["fits"] == bool(fits)
    hand = explore.tp_pp_grid([{"tp": 2, "pp": 1, "fits": False, "tokens_per_s": 9.0},
                               {"tp": 2, "pp": 1, "fits": True, "tokens_per_s": 3.0},
                               {"tp": 1, "pp": 2, "fits": False, "tokens_per_s": 5.0}])
    assert [(r["tp"], r["pp"], r["tokens_per_s"], r["fits"]) for r in hand] == [(1, 2, 0.0, False), (2, 1, 3.0, True)]


def test_scaling_keeps_the_workload_and_marks_what_does_not_fit():
    rows = explore.scaling("llama-2-70b", "dgx-a100-80g", (4, 1, 2), offload="none", zero=[0, 1], **SEARCH)
    assert [r["nodes"] for r in rows] == [1, 2, 4]
    assert len({(r["global_batch"], r["seq_len"]) for r in rows}) == 1
    assert rows[0]["fits"] is False and "no plan fits" in rows[0]["reason"] and rows[0]["tokens_per_s"] == 0.0
    assert rows[1]["fits"] and rows[2]["fits"]
    assert rows[2]["tokens_per_s"] > rows[1]["tokens_per_s"] > 0
    best4 = api.suggest("llama-2-70b", api.load_cluster(nodes=4), workload=api.make_workload("llama-2-70b", gpus=32),
                        top=1, offload="none", zero=[0, 1], **SEARCH)
    assert rows[2]["tokens_per_s"] == best4.plans[0].plan.tokens_per_s
    with pytest.raises(UserError, match="unknown search constraint"):
        explore.scaling("llama-3-8b", nodes=(1,), tensor=2)
    with pytest.raises(UserError, match="node counts >= 1"):
        explore.scaling("llama-3-8b", nodes=(0, 1))


def test_zero_stages_shard_more_state_at_each_stage(one_node):
    rows = explore.zero_stages("llama-3-8b", one_node)
    assert [r["zero_stage"] for r in rows] == [0, 1, 2, 3]
    states = [r["weights_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] for r in rows]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4
    assert rows[1]["optimizer_bytes"] == pytest.approx(rows[0]["optimizer_bytes"] / 8, rel=0.01)
    assert rows[3]["weights_bytes"] < rows[2]["weights_bytes"]
    for r in rows:
        assert r["step_time_s"] == api.estimate("llama-3-8b", one_node, zero=r["zero_stage"]).step_time_s
    # DeepSpeed's pipeline engine runs ZeRO 0/1 only: the other stages are left out.
    assert [r["zero_stage"] for r in explore.zero_stages("llama-3-8b", one_node, pp=2)] == [0, 1]


def test_optimal_partition_never_loses_to_greedy():
    rows = explore.partition_comparison("vl2", api.load_cluster(nodes=4), pp=4, ep=8, zero=1)
    nblocks = len(api.load_model("vl2").blocks)
    for name in ("greedy", "optimal"):
        sel = sorted((r for r in rows if r["balancer"] == name), key=lambda r: r["stage"])
        assert [r["stage"] for r in sel] == [0, 1, 2, 3]
        bounds = [tuple(map(int, r["blocks"].split("-"))) for r in sel]
        assert bounds[0][0] == 0 and bounds[-1][1] == nblocks
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert sel[0]["bottleneck_s"] == max(r["stage_time_s"] for r in sel)
    greedy = next(r for r in rows if r["balancer"] == "greedy")
    optimal = next(r for r in rows if r["balancer"] == "optimal")
    assert optimal["bottleneck_s"] < greedy["bottleneck_s"]
    assert optimal["tokens_per_s"] > greedy["tokens_per_s"]
    with pytest.raises(UserError, match="pp >= 2"):
        explore.partition_comparison("vl2", api.load_cluster(nodes=1), pp=1)


def test_fabric_whatif_a_better_fabric_never_makes_the_best_plan_slower():
    rows = explore.fabric_whatif("llama-3-8b", "dgx-a100-80g", nodes=32, zero=1, **SEARCH)
    by = {r["variant"]: r for r in rows}
    assert list(by) == [v["name"] for v in explore.DEFAULT_FABRICS]
    hdr, hdr2, ndr, ndr2 = (by[v["name"]] for v in explore.DEFAULT_FABRICS)
    assert (hdr["nic_gbit"], ndr["nic_gbit"], hdr2["oversubscription"]) == (200.0, 400.0, 2.0)
    assert ndr["tokens_per_s"] >= hdr["tokens_per_s"] > hdr2["tokens_per_s"]
    assert ndr["tokens_per_s"] >= ndr2["tokens_per_s"] >= hdr2["tokens_per_s"]
    assert hdr2["dp_comm_s"] > hdr["dp_comm_s"]


def test_vision_load_more_tiles_more_vision_work(one_node):
    rows = explore.vision_load("vl2", api.load_cluster(nodes=2), images=(1, 2), tiles=(1, 4), **SEARCH)
    assert [(r["images_per_sample"], r["tiles_per_image"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    share = {(r["images_per_sample"], r["tiles_per_image"]): r["vision_share"] for r in rows}
    tps = {(r["images_per_sample"], r["tiles_per_image"]): r["tokens_per_s"] for r in rows}
    assert 0 < share[(1, 1)] < share[(1, 4)] < share[(2, 4)] < 1
    assert share[(1, 1)] < share[(2, 1)]
    assert tps[(1, 1)] > tps[(1, 4)] > tps[(2, 4)]
    with pytest.raises(UserError, match="no vision tower"):
        explore.vision_load("llama-3-8b", one_node)


# -- figures --------------------------------------------------------------------------------


def test_every_plot_renders_to_png(tmp_path, llama_candidates, one_node):
    feasible = [r for r in llama_candidates if r["fits"]]
    scaling = explore.scaling("llama-3-8b", nodes=(1, 2), **SEARCH)
    figures = {
        "scaling": plots.plot_scaling(scaling),
        "pareto": plots.plot_pareto(feasible),
        "heatmap": plots.plot_heatmap(explore.tp_pp_grid(llama_candidates)),
        "zero": plots.plot_zero(explore.zero_stages("llama-3-8b", one_node)),
        "partition": plots.plot_partition(explore.partition_comparison("llama-3-8b", one_node, pp=2)),
        "fabric": plots.plot_fabric(explore.fabric_whatif("llama-3-8b", nodes=2, variants=explore.DEFAULT_FABRICS[:2],
                                                          **SEARCH)),
        "vision": plots.plot_vision(explore.vision_load("vl2", one_node, images=(1,), tiles=(1, 2), **SEARCH)),
    }
    for name, fig in figures.items():
        assert isinstance(fig, Figure)
        path = plots.save_png(fig, tmp_path / f"{name}.png")
        width, height = _png_size(path)
        assert width > 400 and height > 250, name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in figures)  # no temp files left
    assert plots.png_bytes(figures["pareto"])[:8] == PNG_MAGIC


def test_plots_refuse_empty_input_and_missing_directories(tmp_path):
    with pytest.raises(UserError, match="nothing to plot"):
        plots.plot_pareto([])
    fig = plots.plot_partition([{"balancer": "greedy", "stage": 0, "stage_time_s": 1.0, "bottleneck_s": 1.0,
                                 "blocks": "0-3", "tokens_per_s": 1.0}])
    with pytest.raises(UserError, match="directory .* does not exist"):
        plots.save_png(fig, tmp_path / "missing" / "x.png")


# -- dsplan plot ------------------------------------------------------------------------------


def _plot(*args: str):
    return CliRunner().invoke(main, ["plot", *args])


def test_cli_pareto_writes_the_front(tmp_path, llama_candidates):
    out = tmp_path / "pareto.png"
    result = _plot("pareto", "--model", "llama-3-8b", "--nodes", "1", "--framework", "deepspeed", "--out", str(out),
                   "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    feasible = [r for r in llama_candidates if r["fits"]]
    assert ((data["kind"], data["out"], data["candidates"], data["feasible"])
            == ("pareto", str(out), len(llama_candidates), len(feasible)))
    front = explore.pareto_front(feasible)
    assert [r["label"] for r in data["rows"]] == [r["label"] for r in front]
    assert [r["tokens_per_s"] for r in data["rows"]] == sorted(r["tokens_per_s"] for r in data["rows"])
    _png_size(out)


def test_cli_heatmap_and_scaling(tmp_path):
    heat = tmp_path / "heat.png"
    result = _plot("heatmap", "--model", "llama-3-8b", "--nodes", "1", "--framework", "megatron-deepspeed",
                   "--tp", "1,2,4", "--pp", "1,2", "--out", str(heat), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert sorted((r["tp"], r["pp"]) for r in rows) == [(t, p) for t in (1, 2, 4) for p in (1, 2)]
    assert all(r["fits"] and r["tokens_per_s"] > 0 for r in rows)
    _png_size(heat)

    scale = tmp_path / "scaling.png"
    result = _plot("scaling", "--model", "llama-3-8b", "--nodes", "4", "--framework", "deepspeed", "--out", str(scale))
    assert result.exit_code == 0, result.output
    assert f"wrote {scale}" in result.output.replace("\n", "") and "3 points" in result.output
    _png_size(scale)
    result = _plot("scaling", "--model", "llama-3-8b", "--nodes", "2,1", "--framework", "deepspeed",
                   "--out", str(scale), "--json")
    assert [r["nodes"] for r in json.loads(result.output)["rows"]] == [1, 2]


@pytest.mark.parametrize("args, message", [
    (["pareto", "--model", "llama-3-8b", "--nodes", "0"], "--nodes: 0 is below 1"),
    (["pareto", "--model", "llama-3-8b", "--nodes", "1,2"], "give one node count"),
    (["heatmap", "--model", "llama-3-8b", "--zero", "5"], "--zero: stages are 0, 1, 2 or 3"),
    (["heatmap", "--model", "llama-3-8b", "--recompute", "most"], "--recompute: unknown value 'most'"),
    (["pareto", "--model", "no-such-model"], "no-such-model"),
    (["pareto", "--model", "llama-3-8b", "--images-per-sample", "2"], "not a vision-language model"),
    (["pareto", "--model", "llama-2-70b", "--zero", "0", "--offload", "none", "--tp", "1", "--pp", "1"],
     "no plan of llama-2-70b fits"),
    (["scaling", "--model", "llama-2-70b", "--nodes", "1", "--zero", "0", "--offload", "none", "--tp", "1",
      "--pp", "1"],
     "no plan of llama-2-70b fits at any of 1 node"),
])
def test_cli_bad_input_exits_2_without_traceback(tmp_path, args, message):
    out = tmp_path / "x.png"
    result = _plot(*args, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_cli_missing_output_directory(tmp_path):
    result = _plot("heatmap", "--model", "llama-3-8b", "--framework", "deepspeed", "--tp", "1", "--pp", "1",
                   "--micro-batch", "1", "--out", str(tmp_path / "nope" / "x.png"))
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output


def test_cli_without_matplotlib_names_the_extra(tmp_path):
    code = "import sys; sys.modules['matplotlib'] = None; from planner.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code, "plot", "pareto", "--model", "llama-3-8b",
                          "--out", str(tmp_path / "x.png")],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2
    assert "pip install 'dsplan[plot]'" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_cli_registration_imports_no_matplotlib():
    code = "import sys, planner.cli; print('matplotlib' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
