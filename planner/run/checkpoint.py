"""Atomic DeepSpeed checkpoints: a crash while saving never leaves one that loads wrongly.

Layout under the checkpoint directory::

    step_00000004/          DeepSpeed's files for tag step_00000004 (every rank writes its part)
    step_00000004/COMPLETE  written by rank 0 after *all* ranks finished saving (barrier)
    latest_good             the tag of the newest complete checkpoint (replaced atomically)

The order of operations is the whole design: every rank saves, barrier, rank 0 writes and
fsyncs ``COMPLETE``, then swaps ``latest_good`` with ``os.replace`` and fsyncs the directory.
A crash at any point leaves ``latest_good`` naming an older, complete tag (or nothing), and
a tag directory without ``COMPLETE`` is never loaded; it is removed before its step is saved
again. DeepSpeed's own ``latest`` file is not written (it is updated before the other ranks
have finished).

``COMPLETE`` also lists every file of the tag with its size and CRC-32, so a checkpoint damaged
after it was published (a truncated file, a bad disk) is known before DeepSpeed reads it: a
restart loads the newest *readable* complete tag, of the last two kept here and of the second
copy (``--checkpoint-copy``), which rank 0 writes after publishing, the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
LATEST = "latest_good"
KEEP = 2  # complete checkpoints kept; older ones are pruned after a newer one is published


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def is_complete(ckpt_dir: Path, tag: str) -> bool:
    return (Path(ckpt_dir) / tag / COMPLETE).is_file()


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest(tag_dir: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file of a tag but COMPLETE."""
    return {p.relative_to(tag_dir).as_posix(): [p.stat().st_size, _crc(p)]
            for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != COMPLETE}


def is_readable(ckpt_dir: Path, tag: str) -> bool:
    """Complete, and every file its COMPLETE lists is there, the same size and checksum."""
    marker = Path(ckpt_dir) / tag / COMPLETE
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(files, dict):
        return False
    tag_dir = marker.parent
    try:
        return all((tag_dir / name).stat().st_size == size and _crc(tag_dir / name) == crc
                   for name, (size, crc) in files.items())
    except (OSError, ValueError, TypeError):
        return False


def readable_tags(*dirs: Path | None) -> list[tuple[Path, str]]:
    """(directory, tag) of every readable checkpoint under ``dirs``, newest step first (the
    first directory first at equal steps)."""
    found = [(Path(d), p.name) for d in dirs if d is not None and Path(d).is_dir()
             for p in Path(d).glob("step_*") if is_readable(Path(d), p.name)]
    return sorted(found, key=lambda dt: -step_of(dt[1]))


def step_of(tag: str) -> int:
    """The step a tag written by ``tag_for`` names."""
    return int(tag.removeprefix("step_"))


def latest_good(ckpt_dir: Path) -> str | None:
    """The newest published tag, or None. A pointer to an incomplete tag is not trusted."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if tag and is_complete(ckpt_dir, tag) else None


def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any], copy_dir: Path | None = None) -> str:
    """Save on every rank, then publish from rank 0 (and copy to ``copy_dir``). Returns the tag."""
    import deepspeed.comm as dist  # here, not at the top: the supervisor reads checkpoints without DeepSpeed

    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        stale = ckpt_dir / tag
        if stale.exists() and not is_complete(ckpt_dir, tag):
            shutil.rmtree(stale)  # left by a crash mid-save; never published
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()  # every rank's files are on disk before the checkpoint is declared good
    if rank == 0:
        _publish(ckpt_dir, tag, step)
        if copy_dir is not None:
            copy_tag(ckpt_dir, tag, Path(copy_dir))
    dist.barrier()
    return tag


def _publish(ckpt_dir: Path, tag: str, step: int) -> None:
    _write_durably(ckpt_dir / tag / COMPLETE, json.dumps({"step": step, "files": manifest(ckpt_dir / tag)}) + "\n")
    _write_durably(ckpt_dir / LATEST, f"{tag}\n")
    _prune(ckpt_dir, keep=tag)


def copy_tag(ckpt_dir: Path, tag: str, copy_dir: Path) -> None:
    """The second copy: the tag's files into ``copy_dir`` under a temporary name, renamed and
    published there as in the first (a crash mid-copy leaves no tag that looks complete)."""
    copy_dir.mkdir(parents=True, exist_ok=True)
    tmp = copy_dir / f".{tag}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt_dir / tag, tmp, ignore=shutil.ignore_patterns(COMPLETE))
    shutil.rmtree(copy_dir / tag, ignore_errors=True)
    os.replace(tmp, copy_dir / tag)
    _publish(copy_dir, tag, step_of(tag))


def _prune(ckpt_dir: Path, keep: str) -> None:
    complete = sorted(p.name for p in ckpt_dir.glob("step_*") if is_complete(ckpt_dir, p.name))
    for tag in complete[:-KEEP]:
        if tag != keep:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def load(engine: Any, ckpt_dir: Path, copy_dir: Path | None = None) -> tuple[str, dict[str, Any]] | None:
    """Load the newest readable checkpoint (of ``ckpt_dir``, then ``copy_dir``) into ``engine``;
    None when there is none yet. Every rank checks the same files, so all pick the same tag."""
    for where, tag in readable_tags(ckpt_dir, copy_dir):
        path, client_state = engine.load_checkpoint(str(where), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {where}")
        return tag, client_state or {}
    return None
