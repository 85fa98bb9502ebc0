"""The cost model's measured error: the one figure dsplan quotes when two predictions are close.

A ranking by predicted step time means little where plans differ by less than the model's
error. ``MODEL_ERROR`` is that error as measured: the mean |error| of the step times dsplan
predicts for the published training runs of benchmarks/bench_published_runs.py, none of which
was used to calibrate the model (docs/accuracy.md, "published runs outside the calibration").
Error there is published time / predicted time - 1. It is the error of one prediction against
a measured run; two plans of one model on one cluster share part of it (the GPU's attainable
peak, the software stack), but no benchmark measures how much, so dsplan uses the figure one
does. tests/test_accuracy_figure.py recomputes it from the benchmark, so it cannot go stale.
"""

from __future__ import annotations

from typing import Sequence

MODEL_ERROR = 0.088
MODEL_ERROR_RUNS = 80
MODEL_ERROR_SOURCE = (f"the model's mean error on {MODEL_ERROR_RUNS} published runs "
                      "(benchmarks/bench_published_runs.py, docs/accuracy.md)")


def ties_with_best(step_times_s: Sequence[float], error: float = MODEL_ERROR) -> list[int]:
    """Indices of the plans whose predicted step time is within ``error`` of the first's
    (step / first step - 1 <= error, the benchmark's measure): the first plan included."""
    if not step_times_s:
        return []
    best = step_times_s[0]
    return [i for i, s in enumerate(step_times_s) if s <= best * (1 + error)]
