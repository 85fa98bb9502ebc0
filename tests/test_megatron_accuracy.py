"""Every row of Megatron-LM's weak-scaling table (Narayanan et al. SC21 Table 1) within 10%."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_megatron_table1.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_megatron_table1", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()
ROWS = bench.rows()


def test_table_has_ten_rows(reference_dir):
    assert bench.CSV == reference_dir / "megatron2021_table1_weak_scaling.csv"
    assert len(ROWS) == 10
    assert [r["virtual_stages"] for r in ROWS] == [1, 1, 1, 1, 1, 3, 2, 2, 3, 1]


def test_paper_flops_formula():
    """Eq. 3 for the 1T row: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    f = bench.paper_flops(3072, 2048, 128, 25600, 51200)
    assert f == pytest.approx(96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['params_B']}B" for r in ROWS])
def test_row_within_seven_percent(row):
    """The cost-model issue asks for 10%; the worst row is 5.7% (README), so a change that loses
    a point and a half of accuracy on any row fails here."""
    result = bench.predict(row)
    assert result["fits"], f"{row['params_B']}B should fit on A100-80GB as it ran"
    assert abs(result["error"]) < 0.07, \
        f"{row['params_B']}B: predicted {result['predicted_tflops']:.1f} vs {row['published']}"


def test_model_is_megatron_gpt():
    m = bench.megatron_gpt(hidden=2304, heads=24, layers=24)
    # 12 L h^2 (1 + 13/12h + (V + s)/(12 L h)) parameters, L layers (Narayanan 2021 Sec 5.1)
    L, h, v, s = 24, 2304, 51200, 2048
    assert m.total_params() == pytest.approx(12 * L * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * L * h)), rel=1e-3)
