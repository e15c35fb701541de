"""The elastic agent's rendezvous, bound to one address and checked before it is read.

torch's c10d rendezvous keeps its state (who has joined, ranks, heartbeats) as a pickle
in a TCPStore key, `torch.rendezvous.<run id>`, and every agent unpickles whatever it
finds there; its store listens on every interface, without authentication. So any host
that reaches the rendezvous port could write a pickle that runs code as the job's user.
meshforge runs the agent with rendezvous backends of its own, registered with torch's
handler registry (its public extension point) under their own names (`meshforge-c10d`,
`meshforge-static`), which the launcher picks in place of `c10d` and `static`:

- the store listens on one address (runtime/listen.py): loopback for a single-node run,
  else the rendezvous endpoint's own address on the node that serves it;
- the state is signed with HMAC-SHA256 when the job has a secret (MESHFORGE_JOB_SECRET,
  the same on every node; a single-node run makes a random one that never leaves the
  launcher) and refused, before anything unpickles it, when it is unsigned or signed
  with another key;
- with or without a secret, the state is refused before torch unpickles it when it
  holds anything but the types a rendezvous state is made of (an allowlist).

A refusal raises `RendezvousRefused`, one line naming the store and why; the agent then
stops its workers and `meshforge train` prints the line and exits 1.

Checked against torch 2.13. The subclasses below lean on torch internals where it has no
hook: C10dRendezvousBackend (its get_state/set_state carry the state's bytes),
DynamicRendezvousHandler._create_tcp_store_server (the store shared with the workers when
TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not 1), StaticTCPRendezvous (its store), and the
state's classes in dynamic_rendezvous (the allowlist)."""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    DEFAULT_PORT,
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    Token,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshforge.errors import ConfigError
from meshforge.runtime import listen, netif

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

SECRET_ENV = "MESHFORGE_JOB_SECRET"
C10D, STATIC = "meshforge-c10d", "meshforge-static"
BACKENDS = {"c10d": C10D, "static": STATIC}  # torch's name -> meshforge's

_MAGIC = b"meshforge-rdzv-v1:"
_MAC_BYTES = hashlib.sha256().digest_size
# A single-node run's key: made here, never written anywhere, so only this process (the
# launcher, which runs the agent) can sign its rendezvous state.
_PROCESS_KEY = secrets.token_bytes(32)

# What a pickled torch 2.13 _RendezvousState refers to (pickletools on a state with
# participants, wait list, heartbeats and a deadline): nothing else is let through.
_STATE_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_ALLOWED = {
    (_STATE_MODULE, "_RendezvousState"),
    (_STATE_MODULE, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
}


class RendezvousRefused(RendezvousStateError):
    """The rendezvous state was not written by this job's meshforge: refused unread."""


def job_secret(environ: dict[str, str] | None = None) -> bytes | None:
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    return value.encode() if value else None


def _state_key(secret: bytes, run_id: str) -> bytes:
    """One key per job and run id: a state signed for one job is not valid in another."""
    return hmac.new(secret, b"meshforge rendezvous state\0" + run_id.encode(), "sha256").digest()


class _Forbidden(pickle.UnpicklingError):
    pass


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise _Forbidden(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _Forbidden("a persistent id")


def check_state_types(state: bytes) -> str | None:
    """None when the pickle `state` refers to nothing but a rendezvous state's types (then
    unpickling it runs no code of anyone's choosing), else what it refers to: the first
    other global (e.g. `posix.system`), or "an unreadable pickle"."""
    try:
        _StateUnpickler(io.BytesIO(state)).load()
    except _Forbidden as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - any failure to read it is a refusal
        return "an unreadable pickle"
    return None


class GuardedC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend whose state is signed (with a key) and checked before torch's
    state holder unpickles it."""

    def __init__(self, store: Any, run_id: str, key: bytes | None, where: str) -> None:
        self._mac_key = _state_key(key, run_id) if key is not None else None
        self._where = where
        super().__init__(store, run_id)

    @property
    def name(self) -> str:
        return C10D

    def get_state(self) -> tuple[bytes, Token] | None:
        result = super().get_state()
        if result is None:
            return None
        state, token = result
        return self._open(state), token

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token and not isinstance(token, bytes):  # torch's own shortcut, on our get_state
            current = self.get_state()
            return (*current, False) if current is not None else None
        result = super().set_state(self._seal(state), token)
        if result is None:
            return None
        written, new_token, has_set = result
        return self._open(written), new_token, has_set

    def _seal(self, state: bytes) -> bytes:
        if self._mac_key is None:
            return state
        return _MAGIC + hmac.new(self._mac_key, state, "sha256").digest() + state

    def _open(self, sealed: bytes) -> bytes:
        signed = sealed.startswith(_MAGIC)
        if self._mac_key is None:
            if signed:
                self._refuse(
                    f"is signed, but this node has no {SECRET_ENV}: give every node of "
                    "the job the same secret"
                )
            state = sealed
        else:
            if not signed:
                self._refuse(
                    f"is not signed with this job's key ({self._key_source()}): another host "
                    "that reaches the rendezvous port wrote it, or a node runs without the "
                    "job's secret"
                )
            mac = sealed[len(_MAGIC) : len(_MAGIC) + _MAC_BYTES]
            state = sealed[len(_MAGIC) + _MAC_BYTES :]
            expected = hmac.new(self._mac_key, state, "sha256").digest()
            if not hmac.compare_digest(mac, expected):
                self._refuse(
                    f"is signed with another key than this job's ({self._key_source()}): "
                    "another host wrote it, or the nodes were given different secrets"
                )
        found = check_state_types(state)
        if found is not None:
            self._refuse(
                f"holds {found}, which a rendezvous state never holds: a host that reaches "
                "the rendezvous port wrote it"
            )
        return state

    def _key_source(self) -> str:
        return SECRET_ENV if job_secret() is not None else "the key this launcher made"

    def _refuse(self, why: str) -> None:
        raise RendezvousRefused(
            f"the rendezvous state in the store at {self._where} {why}; refused before "
            "unpickling it"
        )


class _DynamicHandler(DynamicRendezvousHandler):
    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        # torch binds every interface here; the store the workers share with the agent
        # listens on the node's own address (the launcher's local_addr) only
        addr = listen.store_address(master_addr, what="the agent's address")
        return listen.tcp_store_server(addr, master_port, timedelta(seconds=300))


def _c10d_store(params: RendezvousParameters, host: str, port: int) -> TCPStore:
    """torch's _create_tcp_store, with the server bound to the endpoint's own address."""
    cfg_is_host = params.get_as_bool("is_host")
    is_host = cfg_is_host if cfg_is_host is not None else listen.own_address(host) is not None
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    timeout = timedelta(seconds=read_timeout)
    for is_server in dict.fromkeys([is_host, False]):
        try:
            if not is_server:
                return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
            addr = listen.store_address(host, what="the rendezvous endpoint's host")
            return listen.tcp_store_server(addr, port, timeout)
        except ConfigError:
            raise
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
            # as torch does: a guessed host whose port is taken (another agent on this host
            # serves it) joins as a client
            if not is_server or cfg_is_host is not None:
                raise RendezvousConnectionError(
                    f"The connection to the C10d store at {host}:{port} has failed: {exc}"
                ) from exc
    raise AssertionError("unreachable")


def _create_c10d_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    store = _c10d_store(params, host, port)
    key = job_secret()
    if key is None and params.max_nodes == 1:
        key = _PROCESS_KEY
    backend = GuardedC10dBackend(store, params.run_id, key, f"{host}:{store.port}")

    def timeout(name: str) -> timedelta | None:
        seconds = params.get_as_int(f"{name}_timeout")
        return None if seconds is None else timedelta(seconds=seconds)

    # what torch's dynamic_rendezvous.create_handler does, with the handler above
    return _DynamicHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            timeout("join"), timeout("last_call"), timeout("close"), timeout("heartbeat")
        ),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),  # type: ignore[arg-type]
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),  # type: ignore[arg-type]
    )


class _StaticRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous (`--master-addr/--node-rank`) whose store, on node 0,
    listens on the master address only."""

    def get_backend(self) -> str:
        return STATIC

    def next_rendezvous(self) -> Any:
        if not self._store:
            if self.rank == 0:
                addr = listen.store_address(self.master_addr, what="--master-addr")
                self._store = listen.tcp_store_server(
                    addr, self.master_port, self.timeout, world_size=self.world_size
                )
            else:
                self._store = TCPStore(self.master_addr, self.master_port, self.world_size,
                                       False, self.timeout, multi_tenant=True)  # fmt: skip
        return super().next_rendezvous()


def _create_static_handler(params: RendezvousParameters) -> StaticTCPRendezvous:
    torch_own = create_rdzv_handler(params)  # torch's checks and defaults
    return _StaticRendezvous(
        torch_own.master_addr,
        torch_own.master_port,
        torch_own.rank,
        torch_own.world_size,
        torch_own.run_id,
        int(torch_own.timeout.total_seconds()),
    )


def register() -> None:
    """Make meshforge's backends known to torch's registry (once per process)."""
    rendezvous_handler_registry.register(C10D, _create_c10d_handler)
    rendezvous_handler_registry.register(STATIC, _create_static_handler)


def secure(config: LaunchConfig) -> LaunchConfig:
    """The launch config with meshforge's rendezvous backends in place of torch's; a
    single-node job's agent and workers meet on loopback. Changes `config` in place."""
    register()
    config.rdzv_backend = BACKENDS.get(config.rdzv_backend, config.rdzv_backend)
    if config.max_nodes == 1:
        config.local_addr = listen.LOOPBACK  # the workers' MASTER_ADDR
        if config.rdzv_backend in (C10D, STATIC) and config.rdzv_endpoint:
            host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
            if netif.is_loopback(host) or listen.own_address(host) is not None:
                config.rdzv_endpoint = f"{listen.LOOPBACK}:{port}" if port >= 0 else (
                    listen.LOOPBACK
                )  # fmt: skip
    return config


def unsigned_warning(endpoint: str) -> str:
    """The line printed at the launch of a multi-node c10d job without a secret."""
    return (
        f"no {SECRET_ENV} is set, so the rendezvous state is not signed: a host that "
        f"reaches {endpoint} can forge or wipe it (stall, end or join the job); meshforge "
        "still refuses a state that holds anything but rendezvous data. Set "
        f"{SECRET_ENV} to the same random value on every node (e.g. `openssl rand -hex 32`)"
    )
