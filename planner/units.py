"""Parse sizes a user types (1GiB, 512MiB, 4M) into plain numbers."""

from __future__ import annotations

import re

from planner.errors import UserError
from planner.limits import shown_text

_BINARY = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DECIMAL = {"k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}


def parse_size(text: str, what: str = "size") -> int:
    """'1GiB' -> 1073741824, '4M' -> 4000000. Raises UserError naming ``what`` on nonsense."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    shown = shown_text(str(text))
    if not m:
        raise UserError(f"{what}: cannot read {shown}; use a number with an optional unit, e.g. 1GiB, 512MiB, 64KiB")
    value, unit = float(m.group(1)), m.group(2).lower()
    scale = _BINARY.get(unit) or _DECIMAL.get(unit)
    if scale is None:
        raise UserError(f"{what}: unknown unit {shown_text(m.group(2))} in {shown}; "
                        "use B, KiB, MiB, GiB, TiB (or K, M, G, T)")
    if value * scale >= 2**62:  # past any size a user means (and 1e400 would be inf, which int() refuses)
        raise UserError(f"{what}: {shown} is too large to be a size")
    result = int(value * scale)
    if result <= 0:
        raise UserError(f"{what}: must be positive, got {shown}")
    return result
