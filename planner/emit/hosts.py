"""Host names for the hostfile and launch scripts, validated before they go near a shell.

A host is an RFC 1123 host name (dot-separated labels of letters, digits and inner hyphens,
each at most 63 characters, 253 in all) or an IPv4/IPv6 address. Anything else, such as
``node1;rm -rf /``, is refused with a message naming where it came from.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, PositiveInt

from planner.errors import UserError

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_SLOTS = re.compile(r"slots=([0-9]+)")


class Host(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    slots: PositiveInt | None = None  # from a hostfile; None when given by --hosts


def is_valid_host(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if not name or len(name) > 253:
        return False
    return all(_LABEL.fullmatch(label) for label in name.split("."))


def check_host(name: str, source: str) -> str:
    if not is_valid_host(name):
        raise UserError(
            f"{source}: {name!r} is not a valid host name; use RFC 1123 names (letters, digits, hyphens, dots) "
            "or IP addresses, separated by commas"
        )
    return name


def parse_hosts(text: str) -> list[Host]:
    """``--hosts h1,h2,h3``."""
    names = [part.strip() for part in text.split(",")]
    if not any(names):
        raise UserError("--hosts: no host names given; pass them comma-separated, e.g. --hosts node1,node2")
    hosts = [Host(name=check_host(n, "--hosts")) for n in names if n]
    _no_duplicates(hosts, "--hosts")
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """An MPI/DeepSpeed-style hostfile: ``host [slots=N]`` per line, ``#`` comments."""
    p = Path(path).expanduser()
    source = f"--hostfile {p}"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{source}: no such file") from None
    except (OSError, ValueError) as err:  # ValueError: not UTF-8, or a NUL byte in the name
        raise UserError(f"{source}: cannot read it ({err.__class__.__name__})") from None
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        where = f"{source} line {lineno}"
        check_host(name, where)
        slots = None
        if rest:
            m = _SLOTS.fullmatch(rest[0]) if len(rest) == 1 else None
            if m is None or int(m.group(1)) == 0:
                raise UserError(f"{where}: expected 'host slots=N' with N > 0, got {raw.strip()!r}")
            slots = int(m.group(1))
        hosts.append(Host(name=name, slots=slots))
    if not hosts:
        raise UserError(f"{source}: the hostfile lists no hosts; write one 'host slots=N' line per node")
    _no_duplicates(hosts, source)
    return hosts


def select_hosts(hosts: list[Host], nodes: int, gpus_per_node: int, source: str) -> list[Host]:
    """The first ``nodes`` hosts, each with ``gpus_per_node`` slots; too few is an error."""
    if len(hosts) < nodes:
        raise UserError(f"{source}: the plan needs {nodes} nodes but only {len(hosts)} host(s) were given; "
                        "list one host per node")
    chosen = hosts[:nodes]
    for host in chosen:
        if host.slots is not None and host.slots < gpus_per_node:
            raise UserError(
                f"{source}: host {host.name} has slots={host.slots} but the plan runs {gpus_per_node} GPUs per node"
            )
    return [Host(name=h.name, slots=gpus_per_node) for h in chosen]


def _no_duplicates(hosts: list[Host], source: str) -> None:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise UserError(f"{source}: host {host.name} is listed twice; list each node once")
        seen.add(host.name)
