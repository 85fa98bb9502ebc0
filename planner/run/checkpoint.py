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
"""

from __future__ import annotations

import os
import shutil
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


def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any]) -> str:
    """Save on every rank, then publish from rank 0. Returns the tag."""
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
        _write_durably(ckpt_dir / tag / COMPLETE, f"{step}\n")
        _write_durably(ckpt_dir / LATEST, f"{tag}\n")
        _prune(ckpt_dir, keep=tag)
    dist.barrier()
    return tag


def _prune(ckpt_dir: Path, keep: str) -> None:
    complete = sorted(p.name for p in ckpt_dir.glob("step_*") if is_complete(ckpt_dir, p.name))
    for tag in complete[:-KEEP]:
        if tag != keep:
            shutil.rmtree(ckpt_dir / tag, ignore_errors=True)


def load(engine: Any, ckpt_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """Load the latest good checkpoint into ``engine``; None when there is none yet."""
    tag = latest_good(ckpt_dir)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {ckpt_dir}")
    return tag, client_state or {}
