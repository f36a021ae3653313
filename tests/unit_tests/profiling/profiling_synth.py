"""Builders of small synthetic traces with hand-computable figures."""

from __future__ import annotations

import gzip
import json
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

DEEPEP_DISPATCH = "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, int const*, int)"
DEEPEP_COMBINE = "void deep_ep::internode_ll::combine<false, 3, 7168>(void*, int*, long*, int)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float*)"

# (start, end, device, stream, name) per kernel.
Kernel = tuple[int, int, int, int, str]
# (start, end, eventType, text or None, textId-name or None, pid)
Nvtx = tuple[int, int | None, int, str | None, str | None, int]


def write_nsys(
    path: Path,
    kernels: Sequence[Kernel],
    *,
    pid_of_device: dict[int, int] | None = None,
    memcpy: Iterable[tuple[int, int, int]] = (),
    nvtx: Iterable[Nvtx] = (),
    global_pid: bool = True,
    nvtx_table: bool = True,
    kernel_table: bool = True,
) -> Path:
    """An Nsight-shaped SQLite export; column sets switch off to mimic older schemas."""
    pid_of_device = pid_of_device or {}
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings)
            con.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    gp_col = ", globalPid INTEGER" if global_pid else ""
    if kernel_table:
        con.execute(
            "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL, deviceId INTEGER,"
            f" streamId INTEGER, correlationId INTEGER{gp_col}, demangledName INTEGER, shortName INTEGER)"
        )
        for i, (start, end, dev, stream, name) in enumerate(kernels):
            short = name.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")
            row = [start, end, dev, stream, i]
            if global_pid:
                row.append(pid_of_device.get(dev, 1000 + dev) << 24)
            row += [sid(name), sid(short)]
            con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES ({','.join('?' * len(row))})", row)
    con.execute(
        "CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY "
        f"(start INTEGER, end INTEGER, deviceId INTEGER{gp_col}, bytes INTEGER)"
    )
    for start, end, dev in memcpy:
        row = [start, end, dev] + ([pid_of_device.get(dev, 1000 + dev) << 24] if global_pid else []) + [64]
        con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES ({','.join('?' * len(row))})", row)
    if nvtx_table:
        con.execute(
            "CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, "
            "text TEXT, globalTid INTEGER, textId INTEGER)"
        )
        for start, end, etype, text, by_id, pid in nvtx:
            con.execute(
                "INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?, ?)",
                (start, end, etype, text, (pid << 24) | 7, None if by_id is None else sid(by_id)),
            )
    con.commit()
    con.close()
    return path


def kineto_event(
    cat: str,
    name: str,
    pid: int | str,
    tid: int | str,
    ts_us: float | str,
    dur_us: float | str,
    *,
    reorder: bool = False,
) -> str:
    """One complete event in kineto's key order (or another order); numbers may be given as exact text."""
    fields = {
        "ph": '"X"',
        "cat": json.dumps(cat),
        "name": json.dumps(name),
        "pid": json.dumps(pid),
        "tid": json.dumps(tid),
        "ts": str(ts_us),
        "dur": str(dur_us),
        "args": '{"External id": 1, "grid": [1, 1, 1], "note": "{\\"ph\\": \\"X\\"}"}',
    }
    keys = sorted(fields) if reorder else list(fields)
    return "{" + ", ".join(f'"{k}": {fields[k]}' for k in keys) + "}"


def write_kineto(
    path: Path, events: Iterable[str], *, rank: int | None = 0, gz: bool = False, pretty: bool = False
) -> Path:
    """A Kineto trace with the given event texts (see `kineto_event`)."""
    sep = ",\n  " if pretty else ", "
    header = {"schemaVersion": 1}
    if rank is not None:
        header["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
    head = json.dumps(header)[:-1]
    text = f'{head}, "traceEvents": [{sep.join(events)}], "traceName": "synthetic"}}'
    data = text.encode()
    if gz:
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path
