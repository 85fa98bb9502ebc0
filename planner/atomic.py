"""Replace a file in one step: write a temporary file beside it, then rename it over the target.

A reader (or a crash) sees the old file or the new one, never half of either. mkstemp creates
the temporary file with mode 0600; the result gets the mode a plain ``open(path, "w")`` would
give (0666 less the umask), so plots, drawings and run reports stay readable by the group.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

# stage()'s temporaries: ".NAME." + mkstemp's 8 random characters (tempfile's alphabet) + ".tmp".
_SUFFIX = ".tmp"
_RANDOM = re.compile(r"[a-z0-9_]{8}")


def default_mode() -> int:
    """0666 less the process umask (what ``open`` gives a new file)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def stage(path: str | Path, write: Callable[[str], None], mode: int | None = None, fsync: bool = False) -> str:
    """Call ``write(tmp)`` to fill a temporary file next to ``path``, give it its final mode,
    and return its name; nothing is left behind if anything fails. The parent must exist.

    Callers that replace several files at once stage them all before renaming any."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=_SUFFIX)
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, default_mode() if mode is None else mode)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def replace_atomically(path: str | Path, write: Callable[[str], None], mode: int | None = None,
                       fsync: bool = False) -> Path:
    """``stage`` a new ``path`` and rename it into place."""
    tmp = stage(path, write, mode, fsync)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def write_bytes_atomically(path: str | Path, data: bytes, fsync: bool = False) -> Path:
    return replace_atomically(path, lambda tmp: Path(tmp).write_bytes(data), fsync=fsync)


def leftovers(directory: str | Path, names: Iterable[str]) -> list[Path]:
    """Regular files in ``directory`` named as ``stage`` names the temporaries of ``names``: what
    a process killed between staging and renaming (SIGKILL, power loss) left behind."""
    wanted = set(names)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    found = []
    for entry in entries:
        name = entry.name
        if not (name.startswith(".") and name.endswith(_SUFFIX)):
            continue
        target, dot, random = name[1:-len(_SUFFIX)].rpartition(".")
        if not (dot and target in wanted and _RANDOM.fullmatch(random)):
            continue
        try:
            if stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                found.append(Path(entry.path))
        except OSError:
            continue
    return sorted(found)
