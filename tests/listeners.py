"""The TCP listening sockets of given processes, read from /proc (no `ss` needed).

``listeners_of(pids)``: every socket in LISTEN state that one of PIDS holds open, as
``(address, port, pid)``. A socket is matched to its process by inode (/proc/PID/fd links
``socket:[INODE]``) and read from /proc/PID/net/tcp{,6}, the tables of *that process's*
network namespace, so it works for processes in other namespaces too (the multi-host
rehearsal rig) where a plain `ss` sees only its own. ``descendants(pid)``: a process and
all its children, e.g. a launcher's ranks, a Ray node's workers.

Addresses come back as Python writes them (``127.0.0.2``, ``::``, ``::ffff:10.0.0.1``);
``WILDCARDS`` are the ones a test should refuse.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

WILDCARDS = frozenset({"0.0.0.0", "::"})
_LISTEN = "0A"  # TCP_LISTEN in include/net/tcp_states.h


def descendants(pid: int) -> list[int]:
    """PID and every live process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        # "PID (comm) STATE PPID ...": comm may hold spaces and parentheses
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(packed))


def _listening(pid: int) -> dict[int, tuple[str, int]]:
    """{inode: (address, port)} of the LISTEN sockets in PID's network namespace."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            addr, port = fields[1].split(":")
            table[int(fields[9])] = (_address(addr), int(port, 16))
    return table


def listeners_of(pids) -> list[tuple[str, int, int]]:
    """(address, port, pid) of each TCP socket in LISTEN state held open by one of PIDS,
    sorted; processes that have exited meanwhile are skipped."""
    found = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        for inode, (addr, port) in _listening(pid).items():
            if inode in inodes:
                found.add((addr, port, pid))
    return sorted(found)
