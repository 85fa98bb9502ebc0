"""Copy standard input to standard output as it arrives, each line behind a prefix (``[rank 3] ``).

``dsplan run``'s rank wrapper (``.dsplan-run/rank_python``) pipes every rank's output through a
copy of this file, which the rank's own interpreter runs in isolated mode (``-I -S``): it uses
the standard library only, so it runs wherever the rank does. It replaced an awk filter:
Debian's default awk (mawk) block-buffers a pipe, so ranks' lines reached ``dsplan run`` minutes
late, and a job that printed was killed as hung.

Bytes in, bytes out (no decoding: any encoding, or none, passes as it is). A complete line goes
out in one write, so the ranks sharing a launcher's output do not cut into each other's lines.
A partial line (a prompt, a progress bar redrawn with CR) waits ``PARTIAL_WAIT_S`` for the rest,
then goes out as it is, and the rest continues it without a second prefix. SIGINT and SIGTERM
are ignored: the filter ends when the rank closes its output, after the rank's last words.
"""

from __future__ import annotations

import os
import select
import signal
import sys

PARTIAL_WAIT_S = 0.5
CHUNK = 65536


def _write(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def pump(prefix: bytes, src: int = 0, dst: int = 1, wait_s: float = PARTIAL_WAIT_S) -> None:
    """Copy ``src`` to ``dst`` until end of input, prefixing every line."""
    pending = b""  # the start of a line not yet written
    continued = False  # the line being read began in an earlier write (its prefix is out)
    while True:
        if pending and not select.select([src], [], [], wait_s)[0]:
            _write(dst, pending if continued else prefix + pending)
            pending, continued = b"", True
            continue
        chunk = os.read(src, CHUNK)
        if not chunk:
            break
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            _write(dst, (line if continued else prefix + line) + b"\n")
            continued = False
    if pending:
        _write(dst, (pending if continued else prefix + pending) + b"\n")
    elif continued:  # the last line went out unfinished: end it, so what follows starts a line
        _write(dst, b"\n")


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    prefix = os.fsencode(argv[1]) if len(argv) > 1 else b""
    try:
        pump(prefix)
    except BrokenPipeError:  # the reader (dsplan run) is gone: nothing more to show
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
