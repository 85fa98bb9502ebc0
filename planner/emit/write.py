"""Write a rendered run directory: atomically, and never over a file the user changed.

``.dsplan-manifest.json`` records the sha256 of every file dsplan wrote. On regeneration a file
on disk may be replaced only if it still has the content dsplan generated last time (or
already has the new content); anything else is a user edit, and the whole write is refused
(listing the files) unless ``force``. Every check runs before the first byte is written, and
every file (the manifest too) is staged under a temporary name before any is renamed into
place: if staging fails (no permission, full disk, a path under /proc), the temporary files and
the directories this call created are removed and the error propagates, with nothing of the
run directory changed. A write killed outright (SIGKILL) cannot clean up: the next successful
write removes the ``.NAME.XXXXXXXX.tmp`` files it left (planner.atomic ``leftovers``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from planner import __version__
from planner.atomic import leftovers, stage
from planner.emit.render import GeneratedFile
from planner.errors import UserError

MANIFEST = ".dsplan-manifest.json"


class WriteReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    out_dir: str
    written: list[str] = Field(default_factory=list)  # new or changed files
    unchanged: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)  # generated last time, not any more
    replaced_edits: list[str] = Field(default_factory=list)  # user edits overwritten by --force
    temporaries_removed: list[str] = Field(default_factory=list)  # a killed earlier write's staged files


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(out_dir: Path) -> dict[str, str]:
    """File name -> sha256 of what dsplan generated last time ({} when there is no manifest)."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            return files
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise UserError(f"{path}: the manifest is damaged, so dsplan cannot tell which files you edited; "
                    "remove it or use --force")


def _stage(path: Path, content: str, executable: bool) -> str:
    """Write ``content`` to a temporary file next to ``path`` (synced, final mode); its name."""
    return stage(path, lambda tmp: Path(tmp).write_text(content, encoding="utf-8", newline="\n"),
                 mode=0o755 if executable else 0o644, fsync=True)


def _discard(temporaries: list[str]) -> None:
    for tmp in temporaries:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _missing_dirs(out: Path) -> list[Path]:
    """``out`` and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    current = out
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    return missing


def _remove_created(created: list[Path]) -> None:
    """Remove the directories this write created (deepest first), where still empty."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            pass


def write_run_dir(out_dir: str | Path, files: dict[str, GeneratedFile], *, force: bool = False) -> WriteReport:
    """Write ``files`` into ``out_dir`` (created if needed); refuse to clobber user edits.

    Three steps: sort the files (new, unchanged, edited by the user, stale), stage every file
    that changes next to its target, then rename them into place with the manifest last.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; pick a directory path")
    previous = read_manifest(out) if out.is_dir() else {}
    written, unchanged, edited = _sort_files(out, files, previous)
    stale = [n for n in previous if n not in files and (out / n).is_file() and not (out / n).is_symlink()]
    stale_edited = [n for n in stale if _sha256_file(out / n) != previous[n]]
    if (edited or stale_edited) and not force:
        listing = ", ".join(sorted(edited + stale_edited))
        raise UserError(
            f"--out {out}: these files differ from what dsplan generated (edited by you, or not written by dsplan): "
            f"{listing}; nothing was written. Move them away, or pass --force to replace them"
        )
    staged = _stage_all(out, files, written + edited, unchanged)
    removed = _commit(out, staged, [n for n in stale if force or n not in stale_edited])
    return WriteReport(
        out_dir=str(out), written=sorted(written + edited), unchanged=sorted(unchanged), removed=sorted(removed),
        replaced_edits=sorted(edited + [n for n in stale_edited if n in removed]),
        temporaries_removed=_remove_leftovers(out, [*files, *previous, MANIFEST]),
    )


def _remove_leftovers(out: Path, names: list[str]) -> list[str]:
    """Remove the temporaries of ``names`` that a generate killed while writing left in ``out``
    (this write's own are renamed or removed already); their names."""
    removed = []
    for path in leftovers(out, names):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def _sort_files(out: Path, files: dict[str, GeneratedFile],
                previous: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(to write, unchanged, edited since dsplan wrote them, by ``previous``'s hashes); a directory,
    link or device where a file goes is a UserError (never read through)."""
    written, unchanged, edited = [], [], []
    for name, generated in files.items():
        path = out / name
        if not path.exists():
            written.append(name)
            continue
        if path.is_dir():
            raise UserError(f"--out {out}: {name} is a directory where dsplan writes a file; move it away")
        if path.is_symlink() or not path.is_file():  # a link or a device (e.g. -> /dev/zero): never read it
            raise UserError(f"--out {out}: {name} is a link or special file where dsplan writes a file; move it away")
        current = _sha256_file(path)
        if current == sha256_text(generated.content):
            unchanged.append(name)
        elif previous.get(name) == current:
            written.append(name)
        else:
            edited.append(name)
    return written, unchanged, edited


def _stage_all(out: Path, files: dict[str, GeneratedFile], changed: list[str],
               unchanged: list[str]) -> list[tuple[str, Path]]:
    """Stage every changed file and the manifest (last) as (temporary, target) pairs; only when all
    of them are on disk does anything replace a file. A failure removes what was staged and the
    directories this write created."""
    created = _missing_dirs(out)
    manifest = {"generator": f"dsplan {__version__}", "files": {n: sha256_text(f.content) for n, f in files.items()}}
    staged: list[tuple[str, Path]] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in changed:
            generated = files[name]
            staged.append((_stage(out / name, generated.content, generated.executable), out / name))
        staged.append((_stage(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n", False),
                       out / MANIFEST))
        for name in unchanged:  # content is right; make sure the mode is too
            os.chmod(out / name, 0o755 if files[name].executable else 0o644)
    except BaseException:
        _discard([tmp for tmp, _ in staged])
        _remove_created(created)
        raise
    return staged


def _commit(out: Path, staged: list[tuple[str, Path]], remove: list[str]) -> list[str]:
    """Renames within one directory, then the stale files in ``remove``, and the manifest last;
    returns the names removed."""
    committed = 0
    try:
        for tmp, path in staged[:-1]:
            os.replace(tmp, path)
            committed += 1
        for name in remove:
            (out / name).unlink()
        tmp, path = staged[-1]
        os.replace(tmp, path)
        committed += 1
    except BaseException:
        _discard([tmp for tmp, _ in staged[committed:]])
        raise
    return remove
