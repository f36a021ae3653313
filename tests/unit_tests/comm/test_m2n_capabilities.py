"""What an M2N backend can do is an attribute of its communicator class, and a wait that runs out of time raises
`PeerTimeout` (a `PeerError`, a `CommError`) on every backend."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.errors import CommError
from mbridge_epoverlap.comm.m2n import BACKENDS, communicator_class, resolve_backend
from mbridge_epoverlap.comm.m2n.base import M2NCommunicator, PeerError, PeerTimeout, Work
from mbridge_epoverlap.comm.m2n.shm import ShmCommunicator
from mbridge_epoverlap.comm.m2n.torch_p2p import GlooBatchCommunicator, TorchCommunicator


def test_capabilities_are_class_attributes_of_each_backend() -> None:
    resumable = {name: communicator_class(name).resumable_wait for name in BACKENDS}
    late = {name: communicator_class(name).connects_late for name in BACKENDS}
    assert resumable == {"shm": True, "mooncake": True, "torch": True, "gloo": False, "m2n": True}
    assert late == {"shm": True, "mooncake": True, "torch": True, "gloo": False, "m2n": True}
    assert communicator_class("torch") is TorchCommunicator and communicator_class("gloo") is GlooBatchCommunicator
    # `m2n` is whatever it resolves to, on one host and across hosts.
    assert communicator_class("m2n", single_host=False).__name__.lower().startswith(
        resolve_backend("m2n", single_host=False))


def test_a_backend_that_connects_late_implements_connect() -> None:
    for name in BACKENDS:
        cls = communicator_class(name)
        assert (cls.connect is not M2NCommunicator.connect) == cls.connects_late, name


def test_a_timed_out_wait_is_a_peer_timeout_and_a_comm_error() -> None:
    work = Work(3, "receive (tag 0) from rank 3", lambda: False, lambda deadline: False, lambda: None, 0.01,
                "expert worker")
    with pytest.raises(PeerTimeout, match="expert worker rank 3: .*did not complete within") as caught:
        work.wait(0.001)
    assert isinstance(caught.value, PeerError) and isinstance(caught.value, CommError)
    assert caught.value.peer == 3 and "expert worker rank 3" in str(caught.value)


class _Handle:
    """A torch work handle that fails its wait with `error` (what gloo raises)."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: object = None) -> None:
        raise self.error


class _NoGroupTorch(TorchCommunicator):
    """The torch backend without a process group: every operation gets a handle failing with `error`, and its
    waits are gloo's own (as `gloo`'s: a polled wait would see no arrival mark and no process to watch)."""

    error = RuntimeError("")
    resumable_wait = False

    def _make_group(self, store: object, key_prefix: str) -> None:
        return None

    def _submit(self, op: object, buf: torch.Tensor, peer: int, tag: int) -> list[_Handle]:
        return [_Handle(self.error)]


@pytest.mark.parametrize("message, timeout", [("Timed out waiting 10ms for recv", True),
                                              ("Connection closed by peer", False)])
def test_the_torch_backend_tells_a_timeout_from_a_dead_peer(message: str, timeout: bool) -> None:
    comm = _NoGroupTorch(rank=0, peers=[1], store=None, slot_bytes=64, timeout_s=1.0)
    comm.error = RuntimeError(message)
    expected = "did not complete within" if timeout else "Connection closed by peer"
    with pytest.raises(PeerError, match=expected) as caught:
        comm.irecv(1).wait(0.01)
    assert isinstance(caught.value, PeerTimeout) is timeout


def test_shm_wait_resumes_after_a_timeout() -> None:
    store = dist.HashStore()
    comms: dict[int, ShmCommunicator] = {}

    def make(rank: int) -> None:
        comms[rank] = ShmCommunicator(rank=rank, peers=[1 - rank], store=store, slot_bytes=1024, timeout_s=10.0,
                                      key_prefix="capabilities")

    other = threading.Thread(target=make, args=(1,))
    other.start()
    make(0)
    other.join()
    try:
        work = comms[0].irecv(1, tag=5)
        with pytest.raises(PeerTimeout, match="did not complete within"):
            work.wait(0.01)  # nothing sent yet; the peer is alive
        comms[1].isend(0, [torch.arange(4)], tag=5).wait()
        (got,) = work.wait(10.0)  # the same wait, resumed
        assert got.tolist() == [0, 1, 2, 3]
    finally:
        for comm in comms.values():
            comm.close()


def test_torch_wait_resumes_after_a_timeout() -> None:
    # gloo closes a connection whose own wait timed out: the torch backend's short waits must not let it.
    store = dist.HashStore()
    comms: dict[int, TorchCommunicator] = {}

    def make(rank: int) -> None:
        comms[rank] = TorchCommunicator(rank=rank, peers=[1 - rank], store=store, slot_bytes=1024, timeout_s=10.0,
                                        key_prefix="capabilities")

    other = threading.Thread(target=make, args=(1,))
    other.start()
    make(0)
    other.join()
    try:
        work = comms[0].irecv(1, tag=5)
        assert not work.done()
        with pytest.raises(PeerTimeout, match="did not complete within"):
            work.wait(0.01)  # nothing sent yet; the peer is alive
        # One thread plays both ranks: a gloo send completes once the receiver took it, so wait for it after.
        sent = comms[1].isend(0, [torch.arange(4)], tag=5)
        (got,) = work.wait(10.0)  # the same wait, resumed
        sent.wait(10.0)
        assert got.tolist() == [0, 1, 2, 3]
        later = comms[0].irecv(1, tag=6)  # and the channel still carries the next message
        sent = comms[1].isend(0, [torch.arange(3) * 2], tag=6)
        assert later.wait(10.0)[0].tolist() == [0, 2, 4]
        sent.wait(10.0)
    finally:
        for comm in comms.values():
            comm.close()
