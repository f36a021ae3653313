"""A server's life under signals, limits and faults: each test starts its own server and always stops it.

SIGTERM drains (503 for new requests, the running ones finish, exit 0 whatever the server survived before,
nothing left behind); `--max-waiting`
answers 503 at once; `--api-key` guards `/v1/*`; an expert worker SIGKILLed under live streams fails them
naming the worker and ends the server (exit 1), or, with `--elastic`, no stream fails and each greedy
output equals the one before the fault; so too when an attention worker dies (its streams go on from a
survivor, which re-prefills each prompt with the tokens generated so far).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.unit_tests.serving.engine_runs import leftovers
from tests.unit_tests.serving.frontend.conftest import MODEL_NAME

openai = pytest.importorskip("openai")

WAIT_S = 120.0


def _client(server, key: str = "unused"):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=WAIT_S, max_retries=0)


def _get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{server.url}{path}", timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _until(condition, what: str, timeout_s: float = WAIT_S):
    """Poll `condition` until it answers something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _worker_pids(server) -> dict[str, list[int]]:
    _, health = _get(server, "/health")
    pids: dict[str, list[int]] = {}
    for w in health["workers"]:
        pids.setdefault(w["role"], []).append(w["pid"])
    return pids


def _stream(client, prompt, max_tokens: int):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})


def test_sigterm_drains_then_exits_0_leaving_nothing(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--drain-timeout", "60")
    pids = [p for group in _worker_pids(server).values() for p in group]
    stream = iter(_stream(_client(server), [5, 6, 7], 120))
    first = next(stream)
    server.signal(signal.SIGTERM)
    _until(lambda: _get(server, "/health")[0] == 503, "/health to answer 503 while draining")
    assert _get(server, "/health")[1]["status"] == "draining"
    with pytest.raises(openai.APIStatusError) as refused:
        _client(server).completions.create(model=MODEL_NAME, prompt=[1], max_tokens=2)
    assert refused.value.status_code == 503
    rest = list(stream)
    assert len(first.choices) + sum(len(e.choices) for e in rest) >= 2
    assert [c.finish_reason for e in rest for c in e.choices if c.finish_reason] == ["length"]
    assert server.wait(WAIT_S) == 0
    assert leftovers(pids) == ([], [])


def test_max_waiting_answers_503_at_once_and_the_api_key_guards_v1(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--max-batch", "1", "--max-waiting", "0", "--api-key", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    assert _get(server, "/health")[0] == 200  # /health and /metrics stay open
    assert _get(server, "/v1/models")[0] == 401
    client = _client(server, "s3cret")
    stream = iter(_stream(client, [5, 6, 7], 200))
    next(stream)  # it holds the only slot
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=[1], max_tokens=2)
    assert refused.value.status_code == 503 and "--max-waiting 0" in refused.value.message
    assert time.monotonic() - started < WAIT_S  # answered, not queued behind the running request
    stream.close()
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        assert 'mbe_requests_total{outcome="rejected"} 1.0' in answer.read().decode()


def test_a_killed_expert_worker_fails_the_streams_naming_it_and_ends_the_server(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--expert-workers", "2", "--timeout", "10")
    pids = _worker_pids(server)
    every = [p for group in pids.values() for p in group]
    stream = iter(_stream(_client(server), [5, 6, 7], 240))
    next(stream)
    os.kill(pids["expert"][0], signal.SIGKILL)
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pass
    assert "expert worker 0 (rank 1)" in str(failed.value.body or failed.value.message)
    assert server.wait(WAIT_S) != 0
    assert "expert worker 0 (rank 1)" in "".join(server.stderr)
    assert leftovers(every) == ([], [])


def _streams_survive_a_kill(server, role: str, index: int, streams: int) -> None:
    """`streams` live greedy streams; SIGKILL worker `index` of `role` once each is at a worker (its answer
    started; a stream's first text may be held back until its characters complete); every stream finishes
    with the text of the same request before the fault, and the answers after it too."""
    client = _client(server)
    TOKENS = 160  # noqa: N806 - one length for every request below
    prompts = [[1 + i, 2 + (i * 7) % 300, 3 + (i * 13) % 300] for i in range(streams)]
    # Long enough that no stream can finish before the kill.
    baseline = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected = [c.model_extra["token_ids"] for c in baseline.choices]
    pids = _worker_pids(server)
    texts = [""] * len(prompts)
    errors: list[BaseException] = []
    started = threading.Barrier(len(prompts) + 1, timeout=WAIT_S)

    def follow(i: int) -> None:
        try:
            stream = _stream(client, prompts[i], TOKENS)  # returns once the request is at a worker
            started.wait()
            for event in stream:
                texts[i] += "".join(c.text for c in event.choices)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            started.abort()

    threads = [threading.Thread(target=follow, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait()  # every stream is live
    os.kill(pids[role][index], signal.SIGKILL)
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    assert texts == [c.text for c in baseline.choices]
    again = client.completions.create(model=MODEL_NAME, prompt=prompts[:4], max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in again.choices] == expected[:4]
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    if role == "expert":
        # Counted once before anyone asked /health: the first step after the kill detected the loss, and the
        # attention worker's report of it came before the later tokens of `again` (the front end may have seen
        # the process gone as well).
        lost = [line for line in metrics.splitlines() if line.startswith("mbe_elastic_workers_lost_total")]
        assert lost == ["mbe_elastic_workers_lost_total 1.0"]
    assert 'mbe_expert_layer_load_imbalance{layer="0"}' in metrics
    assert 'mbe_expert_layer_load_imbalance{layer="1"}' in metrics
    code, health = _get(server, "/health")
    assert code == 200 and health["status"] == "degraded"
    assert [w["pid"] for w in health["workers"] if not w["alive"]] == [pids[role][index]]
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    assert "mbe_elastic_workers_lost_total 1.0" in metrics
    assert 'mbe_requests_total{outcome="failed"} 0.0' in metrics
    if role == "attention":
        assert "mbe_requests_moved_total 0.0" not in metrics


def test_elastic_serving_survives_a_killed_expert_worker_under_live_streams(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--expert-workers", "2", "--elastic", "--redundant-experts", "4",
                          "--max-batch", "32", "--timeout", "30")
    _streams_survive_a_kill(server, "expert", 0, streams=32)


def test_a_killed_attention_worker_s_streams_go_on_from_a_survivor(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--attn-workers", "2", "--expert-workers", "2", "--elastic",
                          "--redundant-experts", "4", "--max-batch", "16", "--timeout", "30")
    _streams_survive_a_kill(server, "attention", 1, streams=16)


@pytest.mark.netns
def test_a_server_on_two_emulated_hosts_answers_as_on_one(start_server, chat_mixtral_dir):
    """`--emulate-hosts 2`: the workers in two network namespaces behind a shaped link, the front end reaching
    them on the link's gateway; the same greedy tokens as a server on one host; nothing left afterwards."""
    from mbridge_epoverlap.launch.netns import existing_namespaces
    from tests.unit_tests.requirements import require_or_skip

    if os.geteuid() != 0 or not all(map(shutil.which, ("ip", "tc"))):
        require_or_skip("netns", "link emulation needs root and iproute2 (ip, tc)")
    before = set(existing_namespaces())
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    local = start_server(chat_mixtral_dir, "--expert-workers", "2", "--backend", "torch")
    expected = [c.model_extra["token_ids"] for c in _client(local).completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}).choices]
    local.stop()
    server = start_server(chat_mixtral_dir, "--expert-workers", "2", "--backend", "torch", "--emulate-hosts", "2",
                          "--emulate-link-gbps", "10")
    created = set(existing_namespaces()) - before
    assert len(created) == 2, created  # the attention host and the expert host
    answer = _client(server).completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    streamed = "".join(c.text for e in _stream(_client(server), prompts[0], 12) for c in e.choices)
    assert streamed == answer.choices[0].text
    pids = [p for group in _worker_pids(server).values() for p in group]
    server.signal(signal.SIGTERM)
    assert server.wait(WAIT_S) == 0
    assert leftovers(pids) == ([], [])
    assert set(existing_namespaces()) - before == set()


def _listening(pid: int) -> list[str]:
    """The TCP addresses process `pid` listens on ("127.0.0.1:41234", "0.0.0.0:80", "[::]:5000")."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            # /proc prints the address as 32-bit words in host order (little-endian here)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            address = ipaddress.ip_address(raw)
            found.append(f"{address}:{int(port, 16)}" if width == 4 else f"[{address}]:{int(port, 16)}")
    return found


def test_a_drained_stop_exits_0_whatever_the_server_survived(start_server, chat_mixtral_dir):
    """An attention worker SIGKILLed under live streams (every stream goes on from the survivor), then SIGTERM:
    the drain sees every request finish and the process exits 0 (the survivor leaving as asked is no loss); the
    loss stays in /metrics (counted by `_streams_survive_a_kill`) and in the log."""
    server = start_server(chat_mixtral_dir, "--attn-workers", "2", "--expert-workers", "2", "--elastic",
                          "--redundant-experts", "4", "--max-batch", "16", "--timeout", "30")
    pids = [p for group in _worker_pids(server).values() for p in group]
    _streams_survive_a_kill(server, "attention", 1, streams=8)
    server.signal(signal.SIGTERM)
    assert server.wait(WAIT_S) == 0, "".join(server.stderr)
    log = "".join(server.stderr)
    assert "warning: attention worker 1 " in log and "was lost" in log
    assert "error:" not in log
    assert leftovers(pids) == ([], [])


def test_the_first_attention_worker_may_die_too_when_the_front_end_holds_the_rendezvous(start_server,
                                                                                         chat_mixtral_dir):
    """With `--elastic` and two attention workers the front end holds the workers' rendezvous: attention worker
    0's streams go on from the survivor too. No worker and no socket of the front end but the HTTP one listens
    anywhere but on loopback."""
    server = start_server(chat_mixtral_dir, "--attn-workers", "2", "--expert-workers", "2", "--elastic",
                          "--redundant-experts", "4", "--max-batch", "16", "--timeout", "30")
    workers = [p for group in _worker_pids(server).values() for p in group]
    for pid in workers:
        assert all(a.startswith("127.0.0.1:") for a in _listening(pid)), (pid, _listening(pid))
    front = _listening(server.proc.pid)
    assert f"127.0.0.1:{server.port}" in front and all(a.startswith("127.0.0.1:") for a in front), front
    assert len(front) >= 4  # HTTP, the rendezvous, the events inbox and a request socket per attention worker
    _streams_survive_a_kill(server, "attention", 0, streams=16)


def test_the_first_attention_worker_may_die_with_layout_epochs_too(start_server, chat_mixtral_dir):
    """`--rebalance-every`: the attention workers agree at step boundaries; the survivor stops waiting for the
    lost one (an expert worker posts the loss) and decides the epochs from then on."""
    server = start_server(chat_mixtral_dir, "--attn-workers", "2", "--expert-workers", "2", "--elastic",
                          "--redundant-experts", "4", "--max-batch", "16", "--timeout", "30",
                          "--rebalance-every", "2")
    _streams_survive_a_kill(server, "attention", 0, streams=16)


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"/metrics has no {name}")


def test_elastic_metrics_count_a_loss_the_rejoin_and_the_moved_copies(start_server, chat_mixtral_dir):
    # The replacement of a killed expert worker joins two steps after the loss (the idle engine keeps stepping),
    # with the experts of its share moved to it from the survivors; the attention worker reports each event.
    server = start_server(chat_mixtral_dir, "--expert-workers", "4", "--elastic", "--redundant-experts", "4",
                          "--rejoin-after-steps", "2", "--max-batch", "8", "--timeout", "60")
    client = _client(server)
    prompts = [[1 + i, 2 + (i * 7) % 300, 3 + (i * 13) % 300] for i in range(8)]
    baseline = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True})
    pids = _worker_pids(server)
    stream = iter(_stream(client, prompts[0], 96))
    next(stream)
    os.kill(pids["expert"][0], signal.SIGKILL)
    for _ in stream:
        pass
    _until(lambda: _metric(server, "mbe_elastic_workers_rejoined_total") >= 1, "the replacement's admission")
    again = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in baseline.choices]
    assert _metric(server, "mbe_elastic_workers_rejoined_total") == 1
    assert _metric(server, "mbe_elastic_workers_lost_total") == 1
    assert _metric(server, "mbe_elastic_expert_copies_moved_total") >= 2  # the newcomer's two slots at least
    assert _metric(server, "mbe_elastic_rebalances_total") == 0  # no --rebalance-every


@pytest.mark.parametrize("replicated", [False, True], ids=["ep", "replicated-experts"])
def test_a_server_on_two_colocated_processes_answers_as_transformers(start_server, chat_mixtral_dir, hf_greedy,
                                                                     replicated):
    """`--colocated 2`: each process attends to its own requests and holds half the experts (EP over shared
    memory), or with `--replicate-experts` all of them (no exchange); requests spread over both give
    `generate`'s tokens, and SIGTERM leaves nothing behind."""
    server = start_server(chat_mixtral_dir, "--colocated", "2", "--max-batch", "4",
                          *(["--replicate-experts"] if replicated else []))
    pids = _worker_pids(server)
    assert sorted(pids) == ["colocated"] and len(pids["colocated"]) == 2
    client = _client(server)
    prompts = [[5, 6, 7], [11, 3], [40, 41, 42, 43], [9]]
    answers: dict[int, list[int]] = {}  # concurrent, so the two processes both serve

    def ask(i: int) -> None:
        answer = client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        answers[i] = answer.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [answers.get(i) for i in range(len(prompts))] == hf_greedy(chat_mixtral_dir, prompts, 8, eos_token_id=None)
    # Log-probabilities in this layout too, from the prompt's first prefill and from its cached blocks after it.
    long_prompt = [(7 * i) % 300 + 3 for i in range(40)]
    scored = client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=0, echo=True, logprobs=1)
    _assert_logprobs_equal_transformers(chat_mixtral_dir, long_prompt, scored.choices[0].logprobs.token_logprobs)
    twice = [client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True}).choices[0] for _ in range(2)]
    assert twice[0].model_extra["token_ids"] == twice[1].model_extra["token_ids"] == hf_greedy(
        chat_mixtral_dir, [long_prompt], 4, eos_token_id=None)[0]
    assert twice[0].logprobs.token_logprobs == pytest.approx(twice[1].logprobs.token_logprobs, abs=2e-4)
    server.signal(signal.SIGTERM)
    assert server.wait(WAIT_S) == 0
    assert leftovers([p for group in pids.values() for p in group]) == ([], [])


def _assert_logprobs_equal_transformers(directory, prompt: list[int], served: list[float | None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    expected = [None] + [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert served[0] is None and served[1:] == pytest.approx(expected[1:], abs=2e-4)


def test_a_server_without_layout_flags_measures_its_layout(start_server, chat_mixtral_dir, tmp_path):
    """Trial runs of the candidates, the choice in the ready line and in /health, cached for the next start; the
    chosen layout serves (greedy text equal to the fixed layout's)."""
    cache = {"XDG_CACHE_HOME": str(tmp_path)}
    # --frontend-cores 0: every core to the workers, so that a 2-core machine has candidates to try
    server = start_server(chat_mixtral_dir, "--max-batch", "8", "--frontend-cores", "0", choose_layout=True,
                          env=cache)
    log = "".join(server.stderr)
    assert "layout trial 1/" in log and "layout (measured; no layout flag given" in log
    status, health = _get(server, "/health")
    layout = health["layout"]
    assert status == 200 and layout["source"] == "measured" and layout["chosen"] in layout["candidates"]
    assert all(rate > 0 for rate in layout["candidates"].values()) and f"layout {layout['chosen']}" in log
    fixed = start_server(chat_mixtral_dir, "--max-batch", "8")
    asked = dict(model=MODEL_NAME, prompt="def main(", max_tokens=6, temperature=0)
    assert _client(server).completions.create(**asked).choices[0].text == \
        _client(fixed).completions.create(**asked).choices[0].text
    server.stop()
    entries = json.loads((tmp_path / "mbridge-epoverlap" / "online-layouts.json").read_text())
    assert [e["chosen"] for e in entries.values()] == [layout["chosen"]]
    # The next start of the same server reads it (no trial run: this one would fail).
    from mbridge_epoverlap.serving.engine.choice.online import choose_online_layout
    from mbridge_epoverlap.serving.engine.plan import available_cores
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    def no_trial(*args):
        raise AssertionError("measured again")
    again = choose_online_layout(load_spec(chat_mixtral_dir), max_batch=8, max_model_len=256,
                                 cores=available_cores(),
                                 cache_dir=tmp_path / "mbridge-epoverlap", trial=no_trial)
    assert again["source"] == "cached" and again["chosen"] == layout["chosen"]


def test_a_request_after_an_idle_step_wakes_every_attention_worker_at_once(start_server, chat_mixtral_dir):
    """Idle attention workers block on their sockets up to `online.idle_wait_s`, and each engine step needs all of
    them: the request goes to one and the other is told the engine is busy (`online.Busy`), so the request is not
    held until the other's next empty step. Each request is sent just after an empty step (when a worker reports
    it), the other's wait then just begun."""
    from mbridge_epoverlap.serving.workers import online

    wait_s = online.idle_wait_s(60.0)
    server = start_server(chat_mixtral_dir, "--attn-workers", "2", "--expert-workers", "1", "--timeout", "60")
    client = _client(server)

    def idle_steps() -> float:  # 0 until the worker's first report
        with contextlib.suppress(AssertionError):
            return _metric(server, 'mbe_engine_idle_steps{worker="1"}')
        return 0.0

    for _ in range(3):
        seen = _until(idle_steps, "an empty step of attention worker 1")
        _until(lambda seen=seen: idle_steps() > seen, "the next empty step of attention worker 1", wait_s * 4)
        started = time.monotonic()
        answer = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=2, temperature=0)
        assert answer.choices[0].finish_reason == "length"
        assert time.monotonic() - started < wait_s / 2  # held for the other's idle wait, it takes ~wait_s


def test_independent_processes_block_while_idle_and_lend_their_core(start_server, chat_mixtral_dir):
    """Colocated processes that each hold every expert are engines of their own: while one decodes, the other
    blocks on its socket (an empty step every `online.idle_wait_s`, not one after another), and its core is lent
    to the busy one (`online.Cores`); a request alone on its process gets the tokens it gets beside another."""
    from mbridge_epoverlap.serving.workers import online

    wait_s = online.idle_wait_s(60.0)
    server = start_server(chat_mixtral_dir, "--colocated", "2", "--replicate-experts", "--timeout", "60")
    client = _client(server)

    def idle_steps() -> float:  # 0 until the worker's first report
        with contextlib.suppress(AssertionError):
            return _metric(server, 'mbe_engine_idle_steps{worker="1"}')
        return 0.0

    asked = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    before = _until(idle_steps, "a report of attention worker 1")
    started = time.monotonic()
    alone = client.completions.create(**asked).choices[0].text  # worker 0, worker 1 idle
    busy_s = time.monotonic() - started
    time.sleep(wait_s + 0.5)  # worker 1's next empty step reports
    # spinning through empty steps while worker 0 decodes ran hundreds
    assert idle_steps() - before <= (busy_s + wait_s + 0.5) / wait_s + 2
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one on each process: each on its own core
        beside = [f.result().choices[0].text for f in [pool.submit(client.completions.create, **asked)
                                                       for _ in range(2)]]
    assert beside == [alone, alone]
