"""The one exception type a user can cause, and how messages name the inputs.

Anything raised as ``UserError`` is printed by the CLI as a single clear message and the
process exits with status 2; every other exception is a bug and may show a traceback.

A message names an input through ``arg`` (``f"{arg('tp')} {tp} does not divide ..."``), never
by a command-line flag: the planner below the CLI does not know its flags. ``str()`` of the
error (what API users and tracebacks see) spells each marked name as the API's keyword
(``tp``, ``micro_batch``); the CLI spells it as its flag (``--tp``, ``--micro-batch``) with
``spell(err, FLAGS)`` (planner/cli/flags.py). Text that outlives an error and reaches users
as data (a plan's notes, a search's advice) is a ``Message``: a str that reads with the
keywords and keeps its marks for the CLI.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Mapping, Sequence

# The marks around an input's name: control characters no message contains otherwise.
_OPEN, _CLOSE = "\x02", "\x03"
_MARKED = re.compile(f"{_OPEN}([a-z_]+){_CLOSE}")
# Marked names whose API spelling is not the name itself: the negative flags.
_KEYWORDS = {"no_sequence_parallel": "sequence_parallel=False", "no_ep_comm_overlap": "ep_comm_overlap=False"}


def arg(name: str) -> str:
    """``name``, an input's API keyword (``"tp"``, ``"global_batch"``), marked inside a message."""
    if not re.fullmatch("[a-z_]+", name):
        raise ValueError(f"arg({name!r}): an input name is a snake_case keyword")
    return f"{_OPEN}{name}{_CLOSE}"


def marked(text: Any) -> str:
    """The marked text of a message: a UserError's or a Message's own, or ``text`` itself."""
    return getattr(text, "marked", text)


def spell(text: Any, names: Mapping[str, str] | None = None) -> str:
    """``text`` (a str, Message or UserError) with every marked input spelled ``names[name]``,
    or the API keyword where ``names`` is None or has no entry for it."""
    table = _KEYWORDS if names is None else names
    return _MARKED.sub(lambda m: table.get(m[1], _KEYWORDS.get(m[1], m[1])), marked(text))


def spell_all(data: Any, names: Mapping[str, str]) -> Any:
    """``data`` (dicts, lists and tuples of JSON values) with every Message spelled by ``names``;
    containers without one come back as they are."""
    kind = type(data)
    if kind is Message:
        return spell(data, names)
    if kind is dict:
        out = None
        for key, value in data.items():
            if type(value) in _WALKED:
                new = spell_all(value, names)
                if new is not value:
                    if out is None:
                        out = dict(data)
                    out[key] = new
        return data if out is None else out
    if kind is list or kind is tuple:
        items = [spell_all(v, names) if type(v) in _WALKED else v for v in data]
        return data if all(a is b for a, b in zip(items, data)) else kind(items)
    return data


class Message(str):
    """A message that outlives an error (a note, a piece of advice): its value reads with the
    API keywords; ``marked`` keeps the marks, so the CLI can spell it with its flags."""

    marked: str

    def __new__(cls, text: str) -> "Message":
        self = super().__new__(cls, spell(text))
        self.marked = marked(text)
        return self

    def __reduce__(self):  # copy and pickle keep the marks
        return (Message, (self.marked,))


_WALKED = {dict, list, tuple, Message}


class UserError(Exception):
    """Bad input: the message names the input (``arg``) and says how to fix it."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(spell(message))
        self.marked = marked(message)


def whole_number(name: str, value: Any, low: int = 1) -> int:
    """``value`` as an int when it is a whole number >= ``low`` (an int or a numpy integer, not a
    bool), else a UserError naming the input ``name``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low:
        raise UserError(f"{arg(name)}: need a whole number >= {low}, got {value!r}")
    return number


def name_list(name: str, value: "str | Sequence[str]", choices: Sequence[str], noun: str, hint: str) -> tuple[str, ...]:
    """A comma list (or a sequence) of ``choices``, in ``choices``' order, else one UserError naming
    the input ``name`` (``noun``: what one item is; ``hint``: what the list chooses)."""
    items = [v.strip().lower() for v in (value.split(",") if isinstance(value, str) else value)]
    items = [v for v in items if v]
    bad = [v for v in items if v not in choices]
    if bad or not items:
        what = f"unknown {noun} {bad[0]!r}" if bad else f"no {noun} given"
        raise UserError(f"{arg(name)}: {what}; give a comma list of {', '.join(choices)} ({hint})")
    return tuple(c for c in choices if c in items)


def describe_validation_error(source: str, err: Exception) -> str:
    """Turn a pydantic ValidationError into one message naming the source and the fields."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return f"{source}: {err}"
    parts = []
    for item in errors():
        loc = ".".join(str(x) for x in item.get("loc", ()) if x != "__root__") or "(top level)"
        parts.append(f"{loc}: {item.get('msg', 'invalid value')}")
    return f"{source}: invalid field(s): " + "; ".join(parts)
