"""Finding, signalling and naming the processes of a job (Linux /proc)."""

from __future__ import annotations

import os
import signal
import socket

JOB_ID_ENV = "DSPLAN_JOB_ID"  # carried by every process of a job: how its processes are found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_processes(job_id: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment has DSPLAN_JOB_ID=job_id."""
    marker = f"{JOB_ID_ENV}={job_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
            if state in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def signal_name(code: int) -> str:
    """' (SIGKILL)' for -9 (Popen), 137 (a shell) and 247 (Python's sys.exit(-9)); else ''."""
    if code < 0:
        sig = -code
    elif 128 < code < 160:
        sig = code - 128
    elif code > 192:
        sig = 256 - code
    else:
        return ""
    try:
        return f" ({signal.Signals(sig).name})" if sig else ""
    except ValueError:
        return ""


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# DeepSpeed's CPU shared-memory all-reduce (csrc/cpu/comm/shm.cpp) gives each rank of a job
# whose ranks share a machine a ~66 MB POSIX shared-memory buffer named
# deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, and never unlinks it:
# every CPU job leaves them in /dev/shm (RAM) until reboot (DeepSpeed PR #4115 discussion).
SHM_DIR = "/dev/shm"
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"


def shm_buffer_name(master_addr: str, master_port: int | str, rank: int | str) -> str:
    return f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{master_addr}_{master_port}_{rank}"


def remove_shm_buffers(master_addr: str, master_port: int | str) -> int:
    """Unlink the shared-memory buffers of the job at ``master_addr:master_port``; returns how
    many. Ranks that still map one keep it until they exit; the name is gone at once."""
    prefix = shm_buffer_name(master_addr, master_port, "")
    removed = 0
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith(prefix) and entry.name[len(prefix):].isdigit():
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:
                pass
    return removed
