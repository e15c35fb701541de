"""This host's network interfaces and their IPv4 addresses, from the kernel (no `ip`).

Used for `--iface NAME` (the address to advertise and the interface gloo/NCCL bind)
and to tell whether a rendezvous endpoint lives on this host."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct

from meshforge.errors import ConfigError

_SIOCGIFADDR = 0x8915


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def ipv4_of(iface: str) -> str | None:
    """The interface's IPv4 address, or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", iface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_address(iface: str) -> str:
    """The IPv4 address of `iface`; a ConfigError naming the interfaces there are when it
    does not exist or has no address."""
    names = interface_names()
    if iface not in names:
        raise ConfigError(
            f"--iface {iface}: no such network interface on this host "
            f"(there are: {', '.join(names) or 'none'})"
        )
    addr = ipv4_of(iface)
    if addr is None:
        raise ConfigError(f"--iface {iface}: the interface has no IPv4 address")
    return addr


def interface_with_address(addr: str) -> str | None:
    """The interface holding `addr`, or None."""
    for name in interface_names():
        if ipv4_of(name) == addr:
            return name
    return None


def endpoint_is_local(host: str, port: int) -> bool | None:
    """Whether a rendezvous store at host:port should be served from this host.

    True when `host` is one of this host's addresses and the port is free; False when
    the address is not here, or the port is already taken (another agent on this host
    serves it); None when it cannot be told (a name that does not resolve)."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    if port == 0:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            if exc.errno == errno.EADDRNOTAVAIL:
                return False
            return None
    return True


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_own_address(host: str) -> bool | None:
    """Whether `host` (a name or an address) is an address of this host; None when the
    name does not resolve."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


def hostname_address() -> str | None:
    """What this host's name resolves to (what gloo advertises when no interface is set)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
