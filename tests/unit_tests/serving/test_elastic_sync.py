"""The attention workers' step agreement (`serving.elastic.sync.StepSync`) on a real TCPStore, one thread per
attention worker: a lost attention worker is not waited for, and a lost lead's decision passes to the next."""

from __future__ import annotations

import threading

import pytest
import torch

WAIT_S = 30.0


@pytest.fixture
def store():
    import torch.distributed as dist

    from mbridge_epoverlap.comm.store import hosted_store

    server, _ = hosted_store("127.0.0.1", timeout_s=WAIT_S)
    yield dist.PrefixStore("elastic", server)
    del server


def _run(targets: dict[int, callable]) -> dict[int, object]:
    """Each target in its own thread; their results (or exceptions) by key."""
    results: dict[int, object] = {}

    def call(key, fn):
        try:
            results[key] = fn()
        except BaseException as exc:  # noqa: BLE001 - compared by the test
            results[key] = exc

    threads = [threading.Thread(target=call, args=item, daemon=True) for item in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results


def test_a_lost_attention_worker_is_not_waited_for_and_a_record_it_posted_still_counts(store):
    from mbridge_epoverlap.serving.elastic.sync import StepSync, post_attention_lost

    syncs = [StepSync(store, i, 4, timeout_s=WAIT_S) for i in range(4)]
    # Worker 3 posted its record for step 5, then died; worker 1 died before posting. An expert worker posts both.
    syncs[3].store.set("sync/5/3", '{"dead": [2], "load": [0, 4], "active": true}')
    post_attention_lost(store, 3)
    loads = {0: torch.tensor([1, 0]), 2: torch.tensor([0, 2])}
    timer = threading.Timer(0.3, post_attention_lost, args=(store, 1))  # while the others wait for it
    timer.start()
    got = _run({i: (lambda i=i: syncs[i].gather(5, [i], loads[i])) for i in (0, 2)})
    timer.join()
    for i in (0, 2):
        dead, load, active = got[i]
        assert dead == {0, 2} and load.tolist() == [1, 6] and active
        assert syncs[i].lost == {1}  # 3's record came first: it is not counted lost (yet) by either
    assert syncs[0].is_lead and not syncs[2].is_lead


def test_the_decision_passes_to_the_next_attention_worker_when_the_lead_is_lost(store):
    from mbridge_epoverlap.serving.elastic.sync import StepSync, post_attention_lost

    syncs = [StepSync(store, i, 3, timeout_s=WAIT_S) for i in range(3)]
    timer = threading.Timer(0.3, post_attention_lost, args=(store, 0))  # the lead dies before it decides
    timer.start()
    got = _run({1: lambda: syncs[1].decide(7, lambda: [[4, 1]]),
                2: lambda: syncs[2].decide(7, lambda: pytest.fail("worker 2 is not the next lead"))})
    timer.join()
    assert got == {1: [[4, 1]], 2: [[4, 1]]}
    # Worker 1 saw the lead lost and decided; worker 2 read that decision (it may have come before the loss).
    assert syncs[1].is_lead and syncs[1].lost == {0} and syncs[2].lost <= {0}


def test_a_silent_attention_worker_that_is_not_posted_lost_fails_the_boundary_naming_it(store):
    from mbridge_epoverlap.errors import RunFailedError
    from mbridge_epoverlap.serving.elastic.sync import StepSync

    sync = StepSync(store, 0, 2, timeout_s=0.5)
    with pytest.raises(RunFailedError, match="attention worker 1 did not reach the elastic step boundary"):
        sync.gather(3, [], None)
    assert store.check(["sync/3/0"]) and not store.check(["sync/3/1"])

