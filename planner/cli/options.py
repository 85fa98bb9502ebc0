"""Option parsing shared by commands that take parallel degrees (``suggest``, ``estimate``).

Each degree flag takes one value or a comma list (``--pp 2,4``); ``parse_int_list`` and
``parse_choice_list`` turn the text into a tuple and raise UserError naming the flag, so a
typo exits with status 2 and one message. ``estimate`` wants exactly one value per flag;
``single`` picks it out with the same message style.
"""

from __future__ import annotations

from typing import Sequence

from planner.errors import UserError


def parse_int_list(flag: str, text: str | None, *, minimum: int = 1) -> tuple[int, ...] | None:
    """'2,4' -> (2, 4); None stays None; non-numbers and values below ``minimum`` are errors."""
    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t for t in items):
        raise UserError(f"{flag}: empty value in {text!r}; give one number or a comma list such as 2,4")
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise UserError(f"{flag}: {item!r} is not a whole number; give one number or a comma list such as 2,4") from None
        if value < minimum:
            raise UserError(f"{flag}: {value} is below {minimum}; give values >= {minimum}")
        out.append(value)
    return tuple(dict.fromkeys(out))


def parse_choice_list(flag: str, text: str | None, choices: Sequence[str]) -> tuple[str, ...] | None:
    """'none,full' -> ('none', 'full'), each checked against ``choices`` (case-insensitive)."""
    if text is None:
        return None
    out = []
    for item in (t.strip().lower() for t in str(text).split(",")):
        if item not in choices:
            raise UserError(f"{flag}: unknown value {item!r}; choose from {', '.join(choices)} (one or a comma list)")
        out.append(item)
    return tuple(dict.fromkeys(out))


def single(flag: str, values: tuple | None, default):
    """The one value of a flag that must not be a list (``estimate``)."""
    if values is None:
        return default
    if len(values) != 1:
        raise UserError(f"{flag}: give one value here, not a list ({', '.join(map(str, values))})")
    return values[0]
