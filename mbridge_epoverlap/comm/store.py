"""The rendezvous store of a run, listening only where its ranks reach it.

`torch.distributed.TCPStore`'s server listens on every interface of its host. A serving worker's sockets
must listen on loopback or the cluster interface only (never on an address a client of the HTTP server
reaches), so the server side here is handed a socket bound to the rendezvous address itself
(`master_listen_fd`) when the rendezvous is given as an address; clients connect as usual.

`open_store(host, port, ...)` is that store for a rank (server or client); `hosted_store(host)` is a server
for a process that is not a rank (the online front end holds its workers' rendezvous, so that any worker may
be lost). Both take the same timeout as every other wait of the run.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: any free port) and listening; IPv4 or IPv6 as `host` resolves."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(host: str, port: int, *, world: int | None, is_server: bool, timeout_s: float,
               wait_for_workers: bool = True) -> Any:
    """This rank's end of the rendezvous at `host`:`port`: the server (bound to `host` only) or a client.

    Raises:
        OSError: the server cannot bind `host`:`port`.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if not is_server:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    if not _is_address(host):
        # A host name may resolve to another address on its own host than on its peers' (127.0.1.1 in many
        # /etc/hosts): only an address is bound; a name keeps the store's default of every interface.
        return dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=wait_for_workers)
    # The store's server takes the descriptor over: detached, Python never closes it under the store.
    fd = _inherited_listener(port)
    if fd is None:
        fd = listening_socket(host, port).detach()
    return dist.TCPStore(host, port, world, True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=fd)


def _inherited_listener(port: int) -> int | None:
    """The listening socket the launcher bound to `port` and passed to this rank (`STORE_FD_ENV`), or None; taken
    once (the variable is cleared)."""
    import os

    from mbridge_epoverlap.launch.ranks import STORE_FD_ENV

    value = os.environ.pop(STORE_FD_ENV, None)
    if value is None:
        return None
    try:
        sock = socket.socket(fileno=int(value))
    except (OSError, ValueError):
        return None
    if sock.getsockname()[1] != port:
        sock.detach()  # not ours to close
        return None
    return sock.detach()


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def hosted_store(host: str, *, timeout_s: float) -> tuple[Any, int]:
    """A store server at `host` on a free port, for a process that is not one of the ranks: (store, port)."""
    store = open_store(host, 0, world=None, is_server=True, timeout_s=timeout_s, wait_for_workers=False)
    return store, store.port
