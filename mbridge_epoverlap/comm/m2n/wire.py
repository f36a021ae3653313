"""The message format every M2N backend shares: a fixed-size header, then the tensors' bytes.

A message is several tensors (any dtype, any shape) sent as one unit. In a buffer it is laid out as
`HEADER_BYTES` of header (sequence number, tag, payload size, and per tensor its dtype, shape and offset)
followed by the payload, each tensor starting on a 64-byte boundary so typed views of it are aligned.
Writing a message is one copy per tensor straight into the destination buffer (strided sources are
copied element-wise, never staged); reading it is one copy per tensor into tensors the caller owns.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from mbridge_epoverlap.errors import UsageError

MAX_TENSORS = 16
MAX_DIMS = 8
ALIGN = 64
_FIXED = 4  # seq, tag, tensor count, payload bytes
_PER_TENSOR = 4 + MAX_DIMS  # dtype code, ndim, offset, nbytes, dims
HEADER_BYTES = 2048
# The header's last word is never written by `write_message`: a backend may put an arrival mark there.
MARK_OFFSET = HEADER_BYTES - 8
assert (_FIXED + MAX_TENSORS * _PER_TENSOR) * 8 <= MARK_OFFSET

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the tensors take in a message's payload (each one 64-byte aligned)."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def check_message(tensors: Sequence[torch.Tensor], slot_bytes: int) -> int:
    """Raise UsageError for a message this format cannot carry in `slot_bytes`; return its payload size."""
    if len(tensors) > MAX_TENSORS:
        raise UsageError(f"an M2N message carries at most {MAX_TENSORS} tensors, got {len(tensors)}: "
                         "concatenate some of them")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"M2N messages carry torch tensors, got {type(t).__name__}")
        if t.dtype not in _CODE:
            raise UsageError(f"dtype {t.dtype} cannot travel in an M2N message; supported: "
                             + ", ".join(str(d) for d in DTYPES))
        if t.dim() > MAX_DIMS:
            raise UsageError(f"a tensor of {t.dim()} dimensions cannot travel in an M2N message (at most {MAX_DIMS})")
    size = payload_bytes(tensors)
    if size > slot_bytes:
        raise UsageError(f"M2N message of {size} bytes does not fit slot_bytes={slot_bytes}: create the "
                         f"communicator with slot_bytes >= {size}")
    return size


def write_message(buf: memoryview, data: torch.Tensor, tensors: Sequence[torch.Tensor], *, seq: int,
                  tag: int) -> int:
    """Write a message into one slot; return its total size in bytes (header included).

    Args:
        buf: the slot as a writable byte memoryview (header first).
        data: the same slot as a uint8 tensor (for the payload copies).
        tensors: the message, already checked with `check_message`.
        seq: the message's sequence number on its channel.
        tag: the caller's tag.
    """
    words = [seq, tag, len(tensors), 0]
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        dims = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        words += [_CODE[t.dtype], t.dim(), offset, nbytes, *dims]
        if nbytes:
            start = HEADER_BYTES + offset
            dst = data[start:start + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t.detach())
        offset += _aligned(nbytes)
    words[3] = offset
    struct.pack_into(f"<{len(words)}q", buf, 0, *words)
    return HEADER_BYTES + offset


def payload_size(buf: memoryview) -> int:
    """Payload bytes of the message whose header is at the start of `buf`."""
    return struct.unpack_from("<q", buf, 24)[0]


def read_message(buf: memoryview, data: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """(sequence number, tag, tensors) of the message in a slot; the tensors are new (owned by the caller)."""
    seq, tag, count, _ = struct.unpack_from("<4q", buf, 0)
    if not 0 <= count <= MAX_TENSORS:
        raise RuntimeError(f"corrupt M2N message header (tensor count {count})")
    words = struct.unpack_from(f"<{count * _PER_TENSOR}q", buf, _FIXED * 8)
    out = []
    for i in range(count):
        code, ndim, offset, nbytes, *dims = words[i * _PER_TENSOR:(i + 1) * _PER_TENSOR]
        t = torch.empty(dims[:ndim], dtype=DTYPES[code])
        if nbytes:
            start = HEADER_BYTES + offset
            t.view(-1).view(torch.uint8).copy_(data[start:start + nbytes])
        out.append(t)
    return seq, tag, out
