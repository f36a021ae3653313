"""M2N settings and the wire format, without processes."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.comm.m2n import make_communicator, resolve_backend, wire
from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.comm.m2n.bench import parse_size
from mbridge_epoverlap.errors import UsageError


def test_m2n_names_shm_on_one_host_and_unknown_names_fail() -> None:
    assert resolve_backend("m2n") == "shm"
    assert resolve_backend("m2n", single_host=False) in ("mooncake", "torch")
    with pytest.raises(UsageError, match="unknown M2N backend 'nccl'"):
        resolve_backend("nccl")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"slot_bytes": 0}, "slot_bytes=0"),
    ({"slots": 0}, "slots=0"),
    ({"timeout_s": 0}, "timeout_s=0"),
    ({"peers": [0, 1]}, "rank 0 lists itself"),
])
def test_bad_settings_are_usage_errors_naming_the_setting(kwargs: dict, match: str) -> None:
    args = {"rank": 0, "peers": [1], "store": None, "slot_bytes": 1024, "timeout_s": 1.0, **kwargs}
    with pytest.raises(UsageError, match=match):
        make_communicator("shm", **args)


def test_wire_round_trip_is_bit_exact_and_owned() -> None:
    slot = torch.zeros(wire.HEADER_BYTES + 4096, dtype=torch.uint8)
    view = memoryview(slot.numpy())
    msg = [torch.randn(3, 4).to(torch.bfloat16), torch.arange(5).view(5, 1).expand(5, 2), torch.tensor(True),
           torch.empty(0, 7), torch.randn(2, 3).t()]
    size = wire.write_message(view, slot, msg, seq=7, tag=3)
    assert size == wire.HEADER_BYTES + wire.payload_bytes(msg) and wire.payload_size(view) == size - wire.HEADER_BYTES
    seq, tag, out = wire.read_message(view, slot)
    assert (seq, tag) == (7, 3)
    for a, b in zip(msg, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    slot.zero_()  # the received tensors do not alias the slot
    assert torch.equal(out[1], torch.arange(5).view(5, 1).expand(5, 2))


def test_messages_the_format_cannot_carry_are_refused() -> None:
    with pytest.raises(UsageError, match="slot_bytes >= 192"):
        wire.check_message([torch.zeros(100, dtype=torch.uint8), torch.zeros(1)], 100)
    with pytest.raises(UsageError, match="at most 16 tensors"):
        wire.check_message([torch.zeros(1)] * 17, 1 << 20)
    with pytest.raises(UsageError, match="dtype"):
        wire.check_message([torch.zeros(1, dtype=torch.uint16)], 1 << 20)


def test_peer_error_names_rank_and_role() -> None:
    err = PeerError(3, "process 42 exited", "expert worker")
    assert isinstance(err, RuntimeError) and err.peer == 3 and "expert worker rank 3" in str(err)


def test_sizes_parse_with_binary_suffixes() -> None:
    assert [parse_size(s) for s in ("2K", "256k", "8M", "300", "1KB")] == [2048, 262144, 8 << 20, 300, 1024]


@pytest.mark.parametrize("bad", ["", "x", "1.5", "-1K"])
def test_a_bad_size_names_the_flag(bad) -> None:
    with pytest.raises(UsageError, match="--sizes"):
        parse_size(bad)
