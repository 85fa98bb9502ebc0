"""The per-rank metrics files: the trainer appends one JSON line per step, the supervisor tails them.

Names: ``<log stem>.rank<R><suffix>`` (for the default ``DIR/metrics.jsonl``:
``DIR/metrics.rank0.jsonl``, ...); ``metrics_path`` is the one place that rule lives, so the
supervisor reads what the trainer writes. Each line is one step of one rank (step, rank, loss,
step_time_s, tokens_per_s, tokens, peak_memory_bytes, time); planner.run.report turns them
into the measured numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def metrics_path(log: Path, rank: int | str) -> Path:
    """Per-rank metrics file: ``metrics.jsonl`` -> ``metrics.rank3.jsonl`` (rank ``"*"``: a glob)."""
    log = Path(log)
    return log.with_name(f"{log.stem}.rank{rank}{log.suffix or '.jsonl'}")


class MetricsLog:
    """Append one JSON line per step, synced; resumed runs add to the same file."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())


class MetricsTail:
    """New records of every rank's metrics file since construction (files may appear later)."""

    def __init__(self, log: Path):
        self.dir, self.pattern = log.parent, metrics_path(log, "*").name
        self.offsets: dict[Path, int] = {p: p.stat().st_size for p in self._files()}
        self.partial: dict[Path, bytes] = {}

    def _files(self) -> list[Path]:
        return sorted(self.dir.glob(self.pattern))

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in self._files():
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except OSError:
                continue
            if not chunk:
                continue
            self.offsets[path] = offset + len(chunk)
            data = self.partial.pop(path, b"") + chunk
            *lines, rest = data.split(b"\n")
            if rest:
                self.partial[path] = rest
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    out.append(record)
        return out
