"""One rank of the M2N tests, as its own process: `python m2n_peer.py SCENARIO BACKEND RANK WORLD SENDERS PORT OUT`.

Scenarios:
- exchange: every sender sends every receiver a few messages (mixed dtypes and shapes, sizes varying, tags out
  of order), receivers check them bit for bit and answer each sender; senders also check that an oversize
  message is refused and receivers that a receive nobody answers times out naming the peer.
- victim / survivor: rank 0 (victim) sets up and blocks until killed; rank 1 (survivor) posts a receive
  from it, says so (OUT/receiving), waits on it and reports the error it gets, then the errors of three
  sends to it.
- host / victim1 / newcomer: rank 0 (host) and rank 1 (victim1) set up; the test kills rank 1; the host
  notices, `connect`s the channel again, and exchanges a message each way with a new rank-1 process
  (newcomer) that created its communicator later, in the namespace "rejoin/1".
Each rank writes its outcome as JSON to OUT/rank{RANK}.json. A process the test kills blocks reading its
stdin (a pipe from the test): it never goes on by itself, and it exits should the test die first.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.m2n import make_communicator
from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.errors import UsageError

SLOT_BYTES = 64 * 1024


def message(src: int, dst: int, i: int) -> list[torch.Tensor]:
    """The i-th message from src to dst: deterministic, mixed dtypes and shapes, size varying with i."""
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + i)
    rows = 1 + 7 * i
    base = torch.randn(rows, 5, generator=g)
    return [
        base.to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (rows, 2), generator=g, dtype=torch.int64),
        torch.randn(4, 3, generator=g).t(),  # not contiguous
        torch.tensor(float(i)),  # zero dimensions
        torch.empty(0, 3, dtype=torch.float16),  # no elements
        torch.rand(rows, generator=g) > 0.5,
        torch.randn(2, 3, 2, generator=g, dtype=torch.float64),
    ]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def _until_killed() -> int:
    """Block until the test kills this process; exit with 1 if its stdin closes first (the test is gone)."""
    sys.stdin.buffer.read()
    return 1


def main() -> int:
    scenario, backend = sys.argv[1], sys.argv[2]
    rank, world, senders, port = (int(x) for x in sys.argv[3:7])
    out = Path(sys.argv[7])
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0 and scenario != "newcomer",
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    result: dict[str, object] = {"rank": rank}
    if scenario == "exchange":
        is_sender = rank < senders
        peers = list(range(senders, world)) if is_sender else list(range(senders))
        roles = {p: "receiver" if p >= senders else "sender" for p in peers}
        comm = make_communicator(backend, rank=rank, peers=peers, store=store, slot_bytes=SLOT_BYTES,
                                 timeout_s=20, roles=roles, world_size=world)
        with comm:
            if is_sender:
                works = []
                for i in range(3):  # tag 1 before tag 0: the receiver asks for tag 0 first
                    for p in peers:
                        works.append(comm.isend(p, message(rank, p, i), tag=1 if i == 0 else 0))
                for w in works:
                    assert w.wait() is None
                replies = {p: comm.irecv(p, tag=2) for p in peers}
                result["replies_ok"] = all(same(replies[p].wait(), [torch.full((3,), p * 100 + rank)])
                                           for p in peers)
                try:
                    comm.isend(peers[0], [torch.zeros(SLOT_BYTES + 1, dtype=torch.uint8)])
                    result["oversize"] = "accepted"
                except UsageError as exc:
                    result["oversize"] = str(exc)
            else:
                ok = True
                for p in peers:
                    got0 = [comm.irecv(p, tag=0).wait(), comm.irecv(p, tag=0).wait()]
                    work1 = comm.irecv(p, tag=1)
                    got1 = work1.wait()
                    ok &= same(got0[0], message(p, rank, 1)) and same(got0[1], message(p, rank, 2))
                    ok &= same(got1, message(p, rank, 0)) and work1.done()
                result["messages_ok"] = bool(ok)
                for w in [comm.isend(p, [torch.full((3,), rank * 100 + p)], tag=2) for p in peers]:
                    w.wait()
                try:
                    comm.irecv(peers[-1], tag=7).wait(timeout_s=0.5)
                    result["timeout"] = "no error"
                except PeerError as exc:
                    result["timeout"] = str(exc)
                    result["timeout_peer"] = exc.peer
            # Nobody closes while a peer may still write to it; rank 0 hosts the store and leaves last.
            store.set(f"done/{rank}", "1")
            store.wait([f"done/{r}" for r in range(world)], timedelta(seconds=30))
            if rank:
                store.set(f"left/{rank}", "1")
            else:
                store.wait([f"left/{r}" for r in range(1, world)], timedelta(seconds=30))
    elif scenario in ("victim", "survivor"):
        comm = make_communicator(backend, rank=rank, peers=[1 - rank], store=store, slot_bytes=1024, timeout_s=20,
                                 roles={1 - rank: "victim" if rank else "survivor"})
        if rank == 0:
            (out / "ready").write_text("1")
            return _until_killed()
        start = time.monotonic()
        try:
            work = comm.irecv(0)
            (out / "receiving").write_text("1")  # the test kills the victim now
            work.wait()
            result["error"] = "none"
        except PeerError as exc:
            result.update(error=str(exc), peer=exc.peer, seconds=time.monotonic() - start)
        result["sends"] = []  # sends to the dead peer afterwards (several, as a pipeline has queued)
        for tag in range(3):
            try:
                comm.isend(0, [torch.arange(4)], tag=tag).wait()
                result["sends"].append("none")
            except PeerError as exc:
                result["sends"].append(str(exc))
        comm.close()
    elif scenario in ("host", "victim1"):
        comm = make_communicator(backend, rank=rank, peers=[1 - rank], store=store, slot_bytes=1024, timeout_s=20,
                                 world_size=2)
        if rank == 1:
            (out / "ready").write_text("1")
            return _until_killed()
        try:
            comm.irecv(1).wait()
        except PeerError as exc:
            result["lost"] = str(exc)
        try:
            comm.connect(1, store, "rejoin/1")
        except UsageError as exc:
            result["connect"] = str(exc)
        else:
            comm.isend(1, [torch.arange(5)], tag=3).wait()
            result["reply"] = comm.irecv(1, tag=4).wait()[0].tolist()
            store.wait(["left/1"], timedelta(seconds=30))
        comm.close()
    elif scenario == "newcomer":
        with make_communicator(backend, rank=1, peers=[0], store=store, slot_bytes=1024, timeout_s=20,
                               key_prefix="rejoin/1") as comm:
            got = comm.irecv(0, tag=3).wait()[0]
            comm.isend(0, [got * 10], tag=4).wait()
            result["got"] = got.tolist()
        store.set("left/1", "1")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
