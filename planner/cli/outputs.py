"""Output paths and streams: where a write failure becomes one message naming the option.

An option that names a file or directory dsplan writes (``generate --out``, ``topo --draw`` /
``--dot``, ``plot --out``) is declared with ``type=OutputPath(...)``. Parsing it checks what can
be checked cheaply before any work is done (the parent directory exists, no regular file sits
where a directory is needed) and records ``(option, path)`` in the context. When a command then
fails with an ``OSError`` (``/proc/x``, a read-only or full disk, permission denied), the group
(planner/cli/__init__.py) asks ``write_error_message`` which recorded option the failing path
belongs to, and prints ``error: cannot write --out /proc/x: ... (choose a writable directory)``
with exit status 2 instead of a traceback. A full or closed standard output is handled there too
(``stdout_error_message``).
"""

from __future__ import annotations

import errno
import os
from typing import Any, Literal

import click

from planner.errors import UserError

_META_KEY = "dsplan.output_paths"

# errno values that say "this stream can take no more output" (its reader left, or its disk is full).
_STREAM_ERRNOS = frozenset({errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


class OutputPath(click.ParamType):
    """A path dsplan writes: ``kind="file"`` (a file, replaced atomically) or ``"dir"`` (created if missing)."""

    name = "path"

    def __init__(self, kind: Literal["file", "dir"] = "file", suffix: str | None = None) -> None:
        self.kind = kind
        self.suffix = suffix  # the format written: a file named otherwise is refused, not mislabelled

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:  # type: ignore[override]
        return "DIR" if self.kind == "dir" else "FILE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = os.fspath(value) if not isinstance(value, str) else value
        flag = _flag(param)
        if not text.strip():
            raise UserError(f"{flag}: empty path; give a {'directory' if self.kind == 'dir' else 'file'} to write")
        _check_printable(flag, text)
        _precheck(flag, text, self.kind)
        if self.suffix and not text.lower().endswith(self.suffix):
            raise UserError(f"{flag} {text}: dsplan writes {self.suffix[1:].upper()} here; "
                            f"name the file *{self.suffix}")
        if ctx is not None:
            recorded = ctx.meta.setdefault(_META_KEY, [])
            if (flag, text) not in recorded:
                recorded.append((flag, text))
        return text


def _flag(param: click.Parameter | None) -> str:
    if param is None or not param.opts:
        return "output path"
    return max(param.opts, key=len)


# Characters no output path may hold: control characters (newline, CR, tab, ESC, ...), line and
# paragraph separators, and lone surrogates (bytes that are not UTF-8). The path reaches shell
# scripts, YAML, README files and the terminal, where each of these breaks a line, ends a
# comment, fails to encode or drives the terminal.
_UNPRINTABLE = frozenset({"Cc", "Cs", "Zl", "Zp"})
_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x1b": "an escape character (ESC)"}


def _check_printable(flag: str, text: str) -> None:
    """A UserError naming the first unprintable character of ``text`` (the path shown as Python
    writes it, escaped, so the message stays one line)."""
    import unicodedata

    bad = next((ch for ch in text if unicodedata.category(ch) in _UNPRINTABLE), None)
    if bad is None:
        return
    if bad in _NAMES:
        what = _NAMES[bad]
    elif unicodedata.category(bad) == "Cs":  # how os.fsdecode keeps a byte that is not UTF-8
        what = f"a byte that is not UTF-8 (\\x{ord(bad) - 0xDC00:02x})"
    else:
        what = f"a {unicodedata.name(bad, 'control character').lower()} (U+{ord(bad):04X})"
    raise UserError(f"{flag} {text!r}: the path holds {what}; choose a path of printable characters")


def _nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists (lexically: '..' is not resolved)."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _precheck(flag: str, text: str, kind: str) -> None:
    """What can be refused before any work: a file in the way, a missing parent directory."""
    path = os.path.abspath(text)
    if kind == "dir":
        if os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"cannot write {flag} {text}: it exists and is not a directory (pick a directory path)")
        existing = _nearest_existing(path)
        if existing != path and not os.path.isdir(existing):
            raise UserError(f"cannot write {flag} {text}: {existing} is not a directory (choose another path)")
        return
    if os.path.isdir(path):
        raise UserError(f"cannot write {flag} {text}: it is a directory (give a file path)")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        existing = _nearest_existing(parent)
        if os.path.lexists(existing) and not os.path.isdir(existing):
            raise UserError(f"cannot write {flag} {text}: {existing} is not a directory (choose another path)")
        raise UserError(f"cannot write {flag} {text}: directory {os.path.dirname(text) or parent} does not exist "
                        "(create it first or choose another path)")


def _belongs_to(failed: str, target: str) -> bool:
    """Whether ``failed`` (an OSError's filename) is ``target``, inside it, one of its ancestors,
    or the temporary sibling an atomic write stages it in (``.NAME.xxxx.tmp`` next to it)."""
    failed, target = os.path.abspath(failed), os.path.abspath(target)
    if failed == target or failed.startswith(target.rstrip(os.sep) + os.sep):
        return True
    ancestor = failed.rstrip(os.sep)
    if ancestor and target.startswith(ancestor + os.sep):  # never "/": that would claim every path
        return True
    return (os.path.dirname(failed) == os.path.dirname(target)
            and os.path.basename(failed).startswith(f".{os.path.basename(target)}."))


def _hint(err: OSError, text: str) -> str:
    code = err.errno
    existing = _nearest_existing(text)
    if existing != os.path.abspath(text) and os.path.lexists(existing) and not os.path.isdir(existing):
        return f"{existing} is not a directory; choose another path"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "free some space or choose another directory"
    if code == errno.EISDIR:
        return "it is a directory; give a file path"
    if code == errno.ENAMETOOLONG:
        return "give a shorter path"
    return "choose a writable directory"


def write_error_message(err: OSError, ctx: click.Context) -> str | None:
    """``cannot write --out PATH: reason (fix)`` when ``err`` hit a recorded output path, else None."""
    names = [n for n in (getattr(err, "filename", None), getattr(err, "filename2", None)) if n is not None]
    if not names:
        return None
    for flag, text in ctx.meta.get(_META_KEY, ()):
        for name in names:
            try:
                name = os.fsdecode(name)
            except TypeError:
                continue
            if _belongs_to(name, text):
                reason = err.strerror or str(err)
                return f"cannot write {flag} {text}: {reason} ({_hint(err, text)})"
    return None


def is_stdout_error(err: OSError) -> bool:
    """A write to standard output that failed: closed pipe, full disk (``> /dev/full``)."""
    return getattr(err, "filename", None) is None and err.errno in _STREAM_ERRNOS


def stdout_error_message(err: OSError) -> str | None:
    """The one line to print for a failed standard output; None for a closed pipe (stay quiet)."""
    if err.errno == errno.EPIPE:
        return None
    reason = err.strerror or str(err)
    return f"cannot write to standard output: {reason} (free some space, or send the output elsewhere)"


def silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the flush at exit cannot fail (and print) again."""
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test runner's buffer)
        pass
