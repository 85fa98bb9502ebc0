"""`dsplan topo`: summary, one collective, drawings, and exit-2 errors."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from planner.cli import main


def _run(*args: str):
    return CliRunner().invoke(main, ["topo", *args])


def test_summary_table_and_json():
    result = _run("--nodes", "4")
    assert result.exit_code == 0, result.output
    for text in ("dgx-a100-80g", "32 (8 per node)", "nvlink: 32", "25 GB/s per GPU", "network bisection", "400 GB/s",
                 "1:1"):
        assert text in result.output
    data = json.loads(_run("--hardware", "hgx-h200", "--nodes", "2", "--json").output)
    assert data["gpus"] == 16 and data["nic_bw_per_gpu_GBps"] == 50.0 and data["nvls"] is True
    assert data["bisection_bw_GBps"] == 400.0 and data["oversubscription"] == 1.0
    assert data["links_by_type"] == {"nvlink": 16, "pcie": 16, "network": 16}


def test_collective_json_keys_and_numbers():
    result = _run("--collective", "allreduce", "--group-size", "8", "--bytes", "1GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"time_s", "algbw_GBps", "busbw_GBps", "algorithm"} <= set(data)
    assert data["algorithm"] == "ring/Simple"
    assert data["busbw_GBps"] == pytest.approx(data["algbw_GBps"] * 2 * 7 / 8)
    assert data["time_s"] == pytest.approx(2**30 / (data["algbw_GBps"] * 1e9))
    assert 195 < data["busbw_GBps"] < 265  # measured 229 GB/s at 1 GiB (nccl_allreduce_busbw_measured.csv)
    human = _run("--hardware", "hgx-h200", "--collective", "all-reduce", "--bytes", "16GiB")
    assert human.exit_code == 0 and "nvls/Simple" in human.output
    off = json.loads(_run("--hardware", "hgx-h200", "--collective", "allreduce", "--bytes", "16GiB", "--no-nvls",
                          "--json").output)
    assert off["algorithm"] == "ring/Simple" and off["busbw_GBps"] < 450


def test_dot_and_png_are_written_whole(tmp_path):
    dot, png = tmp_path / "topo.dot", tmp_path / "topo.png"
    result = _run("--nodes", "2", "--dot", str(dot), "--draw", str(png))
    assert result.exit_code == 0, result.output
    text = dot.read_text()
    assert text.startswith('graph "dgx-a100-80g x2"') and '"n1.gpu7" -- "n1.nvswitch"' in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["topo.dot", "topo.png"]  # no temp files left
    big = tmp_path / "big.dot"
    assert _run("--nodes", "300", "--dot", str(big)).exit_code == 0
    summary = big.read_text()
    assert "n0.gpu0" not in summary and '"nodes0-19"' in summary and "spine switches" in summary


def test_draw_without_matplotlib_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result = _run("--draw", str(tmp_path / "x.png"))
    assert result.exit_code == 2
    assert "matplotlib" in result.output and "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "0"], "--nodes"),
        (["--collective", "allreduce", "--group-size", "16"], "larger than the cluster"),
        (["--nodes", "2", "--collective", "allreduce", "--group-size", "3"], "does not divide"),
        (["--nodes", "3", "--collective", "allgather", "--group-size", "12"], "unevenly"),
        (["--collective", "allsum"], "unknown collective"),
        (["--collective", "allreduce", "--bytes", "12 parsecs"], "--bytes"),
        (["--hardware", "no-such-box"], "unknown hardware profile"),
        (["--dot", "/no/such/dir/topo.dot"], "does not exist"),
    ],
)
def test_bad_input_exits_2(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_cli_ops_list_matches_the_model():
    from planner.cli import topo
    from planner.cost import collectives

    assert topo.OPS == collectives.OPS
