"""Which TCP sockets a process tree listens on, read from /proc (no `ss`, no psutil's
net_connections, which needs every process of the machine).

    listeners(launcher_pid)  ->  {(pid, addr, port), ...}

A socket is a process's when one of its /proc/PID/fd links names the socket's inode;
the LISTEN rows come from /proc/ROOT/net/tcp and tcp6, the root process's network
namespace (a namespace host's launcher sees its own host's sockets)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import psutil

_LISTEN = "0A"


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # tcp6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listen_table(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in PID's namespace."""
    table: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            addr, port = fields[1].split(":")
            table[int(fields[9])] = (_address(addr), int(port, 16))
    return table


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to read
        return inodes
    for fd in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def process_tree(root: int) -> list[int]:
    try:
        proc = psutil.Process(root)
        return [root, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return []


def listeners(root: int) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket that ROOT or a descendant listens on."""
    table = listen_table(root)
    found = set()
    for pid in process_tree(root):
        for inode in socket_inodes(pid):
            if inode in table:
                found.add((pid, *table[inode]))
    return found


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
