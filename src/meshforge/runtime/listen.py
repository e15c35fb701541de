"""Where meshforge's TCP stores listen: on one address, never on every interface.

A torch `TCPStore` server binds the wildcard address (every interface, IPv4 and IPv6)
whatever host name it is given, and it has no authentication. meshforge binds the
listening socket itself, to the one address the store is reached at, and hands it to
the store (`TCPStore(..., master_listen_fd=FD)`, torch's own option; the store owns and
closes the socket from then on). The address is:

- for a single-node run: loopback (127.0.0.1);
- across nodes: the address the store's host name resolves to on this host (the
  rendezvous endpoint's address for the agent's store; MASTER_ADDR, the address the
  launcher advertises, for the workers' store); when that name is not an address of
  this host (a NAT or a service address), the address of the interface the job was
  given (GLOO_SOCKET_IFNAME, which `--iface` sets).

See docs/cluster.md, "Trust model"."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from meshforge.errors import ConfigError
from meshforge.runtime import netif

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LOOPBACK = "127.0.0.1"


def _family(addr: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET


def _bindable(addr: str) -> bool:
    """Whether `addr` is an address of this host (a socket can be bound to it)."""
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
    except (OSError, ValueError):
        return False
    return True


def resolve(host: str) -> list[str]:
    """The addresses `host` (a name or an address) resolves to, IPv4 first; "localhost"
    is 127.0.0.1 (some resolvers answer ::1 first, and the peers connect to IPv4)."""
    if host in ("", "localhost"):
        return [LOOPBACK]
    found: list[str] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            continue
        for *_, sockaddr in infos:
            addr = str(sockaddr[0]).split("%")[0]
            if addr not in found:
                found.append(addr)
    return found


def own_address(host: str) -> str | None:
    """The first address `host` resolves to that belongs to this host, else None."""
    for addr in resolve(host):
        if _bindable(addr):
            return addr
    return None


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to addr:port (port 0: any free port) and listening."""
    sock = socket.socket(_family(addr), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store_server(
    addr: str,
    port: int,
    timeout: timedelta,
    world_size: int | None = None,
    wait_for_workers: bool = True,
) -> TCPStore:
    """A TCPStore server that listens on `addr` only (port 0: a free one; the store's
    `.port` says which). Raises OSError when the address cannot be bound (not this
    host's, or the port is taken)."""
    from torch.distributed import TCPStore

    sock = listen_socket(addr, port)
    bound_port = sock.getsockname()[1]
    try:
        fd = sock.detach()  # the store owns the socket from here (and closes it)
        return TCPStore(
            addr,
            bound_port,
            world_size,
            True,
            timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=True,
            master_listen_fd=fd,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def store_address(
    host: str, what: str = "MASTER_ADDR", environ: Mapping[str, str] | None = None
) -> str:
    """The address a store reached at `host` listens on (`what` names `host` in the
    error): `host`'s own address, else the address of the job's interface
    (GLOO_SOCKET_IFNAME) when `host` is not this host's (a NAT or a service address) or
    is a name that resolves to loopback here only (Debian's 127.0.1.1 for the host name,
    while the job names a cluster interface); a ConfigError when neither is known."""
    env = os.environ if environ is None else environ
    addr = own_address(host)
    iface = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    iface_addr = netif.ipv4_of(iface) if iface else None
    if addr is not None and not (
        netif.is_loopback(addr)
        and not netif.is_loopback(host)
        and iface_addr is not None
        and not netif.is_loopback(iface_addr)
    ):
        return addr
    if iface_addr is not None:
        return iface_addr
    raise ConfigError(
        f"{what} {host} is not an address of this host, so this node cannot tell where "
        "the store it serves should listen (on one address, never on every interface): "
        f"give {what} as this host's address, or name the job's interface (--iface NAME, "
        "or GLOO_SOCKET_IFNAME)"
    )


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux)."""
    return netif.interface_with_address(LOOPBACK) or "lo"


def pin_collectives_to_loopback(environ: dict[str, str] | None = None) -> str:
    """Sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the loopback interface (gloo and
    NCCL's bootstrap then listen on 127.0.0.1 only); returns its name."""
    env = os.environ if environ is None else environ
    lo = loopback_interface()
    env["GLOO_SOCKET_IFNAME"] = lo
    env["NCCL_SOCKET_IFNAME"] = lo
    return lo
