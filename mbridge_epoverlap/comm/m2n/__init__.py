"""M2N communication: M sender ranks to N receiver ranks, non-blocking, with buffers set up once.

`make_communicator(backend, rank=..., peers=..., store=..., slot_bytes=..., timeout_s=...)` gives this rank's
end. Backends share one interface (`M2NCommunicator`: `isend`, `irecv`, `close`; `Work.wait`, `Work.done`):

- `shm`: shared memory between ranks of one host (the fastest here);
- `mooncake`: the Mooncake Transfer Engine's one-sided writes (TCP here, RDMA on a cluster), across hosts;
- `torch`: torch.distributed point-to-point on a process group of its own;
- `gloo`: `torch.distributed.batch_isend_irecv` on gloo, the baseline every comparison uses;
- `m2n`: the fastest backend available (`shm` when every rank is on one host).

Typical use (every rank of the job does the same with its own rank and peers; one communicator carries both
directions, e.g. dispatch to the expert ranks and combine back):

    store = torch.distributed.TCPStore(host, port, None, is_master=rank == 0)
    comm = make_communicator("m2n", rank=rank, peers=expert_ranks, store=store, slot_bytes=1 << 20,
                             timeout_s=60, roles={r: "expert worker" for r in expert_ranks})
    sends = [comm.isend(e, [tokens[e], expert_ids[e], gate_weights[e]], tag=layer) for e in expert_ranks]
    recvs = [comm.irecv(e, tag=layer) for e in expert_ranks]
    outputs = [w.wait() for w in recvs]   # list of tensors per expert rank; PeerError names a dead one
    for w in sends:
        w.wait()
    comm.close()

What a backend can do beyond the interface is an attribute of its class, `communicator_class(name)`:
`resumable_wait` (a wait that raised `PeerTimeout` can be waited on again) and `connects_late` (`connect` to a
process that starts later, e.g. a replacement worker); `backends_with(attribute)` lists the names that have it.

Sent tensors must not change until their send completed. Ranks should pass a barrier (e.g. on the store)
before closing, so that no peer still writes to a closed rank. Importing this package does not import torch
or mooncake; `make_communicator` imports the backend it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mbridge_epoverlap.errors import UsageError

if TYPE_CHECKING:
    from mbridge_epoverlap.comm.m2n.base import M2NCommunicator

BACKENDS: tuple[str, ...] = ("shm", "mooncake", "torch", "gloo", "m2n")
MOONCAKE_INSTALL = ("the mooncake backend needs the package mooncake-transfer-engine-non-cuda and Debian's "
                    "libibverbs1: run `make setup` (or `pip install mooncake-transfer-engine-non-cuda`) and "
                    "`bash scripts/setup_system_deps.sh` as root (or `apt-get install libibverbs1`)")


def resolve_backend(backend: str, *, single_host: bool = True) -> str:
    """The concrete backend `backend` names (`m2n` becomes the fastest available one).

    Raises:
        UsageError: an unknown name.
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown M2N backend '{backend}': choose one of {', '.join(BACKENDS)}")
    if backend == "m2n":
        return "shm" if single_host else ("mooncake" if mooncake_available() else "torch")
    return backend


def mooncake_available() -> bool:
    """True when the Mooncake Transfer Engine imports (the package and libibverbs1 are installed)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def communicator_class(backend: str, *, single_host: bool = True) -> type[M2NCommunicator]:
    """The communicator class of `backend` (`m2n` resolved as `resolve_backend` does), imported on demand; its
    class attributes say what the backend can do (`resumable_wait`, `connects_late`).

    Raises:
        UsageError: an unknown name.
    """
    name = resolve_backend(backend, single_host=single_host)
    if name == "shm":
        from mbridge_epoverlap.comm.m2n.shm import ShmCommunicator

        return ShmCommunicator
    if name == "mooncake":
        from mbridge_epoverlap.comm.m2n.mooncake import MooncakeCommunicator

        return MooncakeCommunicator
    from mbridge_epoverlap.comm.m2n.torch_p2p import GlooBatchCommunicator, TorchCommunicator

    return TorchCommunicator if name == "torch" else GlooBatchCommunicator


def make_communicator(backend: str, *, rank: int, peers: Sequence[int], store: Any, slot_bytes: int,
                      slots: int = 2, timeout_s: float, key_prefix: str = "m2n", single_host: bool = True,
                      roles: dict[int, str] | None = None, world_size: int | None = None,
                      host: str | None = None) -> M2NCommunicator:
    """Create this rank's end of an M2N exchange; every rank in `peers` must make one too (same settings).

    Args:
        backend: `shm`, `mooncake`, `torch`, `gloo` or `m2n` (the fastest available).
        rank: this rank's id (unique in the job).
        peers: the ranks this one sends to or receives from.
        store: a `torch.distributed.TCPStore` (or anything with `set`, `get`, `wait`), used once for the
            rendezvous.
        slot_bytes: the largest message payload (tensors' bytes, each rounded up to 64); buffers of this size
            are allocated once per peer and slot.
        slots: messages in flight per direction and peer before a send waits for the receiver.
        timeout_s: the limit of every wait (set-up included).
        key_prefix: namespace of the store keys (several communicators can share one store).
        single_host: whether every rank runs on this host (decides what `m2n` means).
        roles: optional names for peers ("expert worker"), used in error messages.
        world_size: the process-group size for `torch`/`gloo` (default: the largest rank seen + 1).
        host: the address `mooncake` listens on and publishes (default: `MBRIDGE_EPOVERLAP_M2N_HOST`, else
            127.0.0.1 on one host and this host's address otherwise).

    Raises:
        UsageError: a bad setting, an unknown backend, or mooncake missing.
        PeerError: a peer did not join in time.
    """
    name = resolve_backend(backend, single_host=single_host)
    if slot_bytes < 1:
        raise UsageError(f"slot_bytes={slot_bytes}: must be at least 1 (the largest message in bytes)")
    if slots < 1:
        raise UsageError(f"slots={slots}: must be at least 1")
    if timeout_s <= 0:
        raise UsageError(f"timeout_s={timeout_s}: must be positive")
    if rank in peers:
        raise UsageError(f"rank {rank} lists itself among its peers {list(peers)}")
    common: dict[str, Any] = dict(rank=rank, peers=peers, store=store, slot_bytes=slot_bytes, slots=slots,
                                  timeout_s=timeout_s, key_prefix=key_prefix, roles=roles)
    if name == "mooncake" and not mooncake_available():
        raise UsageError(MOONCAKE_INSTALL)
    cls = communicator_class(name)
    if name == "mooncake":
        if host is None:
            import os
            import socket

            host = os.environ.get("MBRIDGE_EPOVERLAP_M2N_HOST") or (
                "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname()))
        return cls(**common, host=host)
    if name == "shm":
        return cls(**common)
    return cls(**common, world_size=world_size)


def __getattr__(name: str) -> Any:
    # The interface types, without importing torch at package import.
    if name in ("M2NCommunicator", "Work", "PeerError", "PeerTimeout"):
        from mbridge_epoverlap.comm.m2n import base

        return getattr(base, name)
    raise AttributeError(name)
