"""Read the text nccl-tests (``all_reduce_perf``, ``all_gather_perf``, ...) prints.

The format is nccl-tests' own (NVIDIA/nccl-tests src/util.cu, 2.19: writeResultHeader,
writeBenchmarkLinePreamble/Body, writeResultFooter): ``#`` comment lines (the settings, the
devices, the column header), one row per buffer size with ``size count type redop root``
then ``time algbw busbw #wrong`` out-of-place and the same four in-place, then the footer
``# Out of bounds values : N OK|FAILED`` and ``# Avg bus bandwidth : X``. With ``-I 1``
(per-iteration timing) each half has four more columns; with timestamps one more at the end.
``#wrong`` is ``N/A`` when the test ran without checking (``-c 0``).

A run that crashed or was killed stops before the footer: ``parse`` says so rather than
comparing half a table. Lines that are neither comments nor rows (NCCL's own log lines,
mpirun's) are skipped; a line that starts like a row but does not read as one is garbled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_OOB = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")
_TEST = re.compile(r"^#\s*Collective test starting:\s*(\S+)")
_RANK = re.compile(r"^#\s+Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+")
_PREAMBLE = 5  # size, count, type, redop, root (writeBenchmarkLinePreamble)


class NcclTestsOutputError(ValueError):
    """Output that cannot be compared: empty, truncated or garbled (the message says which)."""


@dataclass(frozen=True)
class Half:
    """One of a row's two halves (out-of-place, in-place)."""

    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None  # None: "N/A", the test did not check the results (-c 0)


@dataclass(frozen=True)
class Row:
    size_bytes: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Half
    in_place: Half

    @property
    def busbw_GBps(self) -> float:
        """The better half's bus bandwidth: a sick link or GPU slows both."""
        return max(self.out_of_place.busbw_GBps, self.in_place.busbw_GBps)

    @property
    def time_us(self) -> float:
        return min(self.out_of_place.time_us, self.in_place.time_us)

    @property
    def wrong(self) -> int | None:
        counts = [h.wrong for h in (self.out_of_place, self.in_place) if h.wrong is not None]
        return sum(counts) if counts else None


@dataclass(frozen=True)
class Result:
    test: str | None  # "all_reduce_perf", from the "Collective test starting" line (nccl-tests 2.14+)
    rows: tuple[Row, ...]
    avg_busbw_GBps: float
    out_of_bounds: int | None
    ranks: int  # the "#  Rank N ..." device lines
    hosts: tuple[str, ...]


def _half(fields: list[str]) -> Half:
    wrong = None if fields[3] == "N/A" else int(float(fields[3]))
    return Half(float(fields[0]), float(fields[1]), float(fields[2]), wrong)


def _row(line: str, per_iteration: bool) -> Row:
    fields = line.split()
    width = 8 if per_iteration else 4  # time algbw busbw #wrong (+ i_min i_max i_p99 i_cv%)
    if len(fields) not in (_PREAMBLE + 2 * width, _PREAMBLE + 2 * width + 1):  # + a timestamp
        raise ValueError(f"{len(fields)} columns, expected {_PREAMBLE + 2 * width}")
    size, count, kind, redop, root = fields[:_PREAMBLE]
    first = fields[_PREAMBLE:_PREAMBLE + width]
    second = fields[_PREAMBLE + width:_PREAMBLE + 2 * width]
    return Row(int(size), int(count), kind, redop, int(root), _half(first), _half(second))


def parse(text: str, source: str = "nccl-tests output") -> Result:
    """Every row and the footer of one nccl-tests run, or NcclTestsOutputError naming what is wrong."""
    rows: list[Row] = []
    test, avg, oob, per_iteration = None, None, None, False
    hosts: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#"):
            per_iteration = per_iteration or "i_min" in stripped
            test = test or _match(_TEST, stripped)
            avg = _match(_AVG, stripped) or avg
            oob_text = _match(_OOB, stripped)
            oob = int(oob_text) if oob_text is not None else oob
            host = _match(_RANK, stripped)
            if host is not None:
                hosts.append(host)
            continue
        if not stripped or not stripped[0].isdigit() or " NCCL " in stripped:
            continue  # blank, NCCL's log lines, a launcher's notes
        try:
            rows.append(_row(stripped, per_iteration))
        except ValueError as err:
            raise NcclTestsOutputError(f"{source}: line {number} is garbled ({err}): {stripped[:100]!r}") from None
    if not rows:
        raise NcclTestsOutputError(f"{source}: no result rows (did the test start? look for an NCCL error above "
                                   "its header, or run it by hand)")
    if avg is None:
        raise NcclTestsOutputError(f"{source}: truncated: it ends after the {rows[-1].size_bytes}-byte row without "
                                   "the 'Avg bus bandwidth' line (the test crashed, hung or was killed)")
    try:
        avg_value = float(avg)
    except ValueError:
        raise NcclTestsOutputError(f"{source}: garbled 'Avg bus bandwidth' value {avg!r}") from None
    return Result(test, tuple(rows), avg_value, oob, len(hosts), tuple(dict.fromkeys(hosts)))


def _match(pattern: re.Pattern[str], line: str) -> str | None:
    found = pattern.match(line)
    return found.group(1) if found else None
