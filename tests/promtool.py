"""Prometheus's promtool, for the tests of prometheus-rules.yaml (tests/test_monitoring.py).

``ensure_promtool()`` returns the path of Debian bookworm's promtool (package prometheus
2.42.0+ds-5+deb12u1 ships /usr/bin/promtool), fetched once with ``apt-get download`` (no root
needed) into the tests' cache (tests/megatron_parser.py cache_root) and unpacked with
``dpkg-deb -x``. It raises PromtoolUnavailable, with the commands' output, when it cannot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.megatron_parser import cache_root

# Debian bookworm's prometheus (2.42.0): the promtool whose `check rules` / `test rules` judge the file.
PROMETHEUS_DEB = "prometheus=2.42.0+ds-5+deb12u1"


class PromtoolUnavailable(RuntimeError):
    """promtool could not be downloaded or unpacked."""


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PromtoolUnavailable(f"$ {' '.join(cmd)}\n{e!r}") from e
    if r.returncode != 0:
        raise PromtoolUnavailable(f"$ {' '.join(cmd)}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def ensure_promtool(cache_dir: Path | None = None) -> Path:
    """The promtool binary, downloaded and unpacked on first use."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"prometheus-{PROMETHEUS_DEB.partition('=')[2]}"
    binary = target / "usr" / "bin" / "promtool"
    if binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="prometheus-", dir=root))
    try:
        _run(["apt-get", "download", PROMETHEUS_DEB], work)
        debs = sorted(work.glob("prometheus_*.deb"))
        if not debs:
            raise PromtoolUnavailable(f"apt-get download {PROMETHEUS_DEB} left no .deb in {work}")
        _run(["dpkg-deb", "-x", str(debs[0]), str(work / "pkg")], work)
        try:
            os.replace(work / "pkg", target)  # atomic: a parallel worker may have won the race
        except OSError:
            if not binary.is_file():
                raise
    except OSError as e:
        raise PromtoolUnavailable(f"could not unpack {PROMETHEUS_DEB}: {e!r}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return binary
