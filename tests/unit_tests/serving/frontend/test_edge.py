"""One request cannot take the server down: every field checked at the edge, limits answered, failures kept to
their request. Real servers and a plain client (the standard library's), and, for what the edge lets through
by construction, a real engine driven by the front end's own `EngineClient`.

- values past what the engine honours (a seed past the generator's 64 bits, a lone UTF-16 surrogate, NaN,
  numbers past a float, JSON nested past the parser) answer 400 naming the field, and the server serves on;
  the values at the very edge are served;
- a request a worker still cannot serve (sent past the front end's checks) fails alone, naming the worker and
  why, and the worker serves the next one;
- a body over the limit answers a 413 a plain client reads, one that trickles in a 408; a silent connection
  is closed; past `--max-connections` a request answers 503 naming the flag; a stream nobody reads does not
  hold the worker's batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.unit_tests.serving.frontend.conftest import CONTEXT, MODEL_NAME, VOCAB

WAIT_S = 120.0


def _post(server, body: bytes, path: str = "/v1/completions", headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": [40, 41, 42], "max_tokens": 6, **fields}).encode()


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        lines = answer.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name and not name.startswith("#")}


def _until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _workers(server) -> list[dict]:
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as answer:
        return json.loads(answer.read())["workers"]


CHAT = "/v1/chat/completions"
BAD = [
    # (what, path, raw body, param, words in the message)
    ("seed 2**64", "/v1/completions", _completion(seed=2**64, temperature=1.0), "seed", "64-bit seed"),
    ("seed 10**30", "/v1/completions", _completion(seed=10**30, temperature=1.0), "seed", "64-bit seed"),
    ("seed below -2**63", "/v1/completions", _completion(seed=-(2**63) - 1), "seed", "64-bit seed"),
    ("a lone surrogate in the prompt", "/v1/completions",
     b'{"model": "tiny", "prompt": "hi \\ud800", "max_tokens": 4}', "prompt", "lone UTF-16 surrogate"),
    ("a lone surrogate in a message", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     "messages[0].content is not valid Unicode text"),
    ("a lone surrogate in the model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model",
     "lone UTF-16 surrogate"),
    ("NaN", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', None, "NaN is not"),
    ("a float past the largest", "/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 1e999}', None,
     "1e999 is out of range"),
    ("an integer past a float", "/v1/completions",
     b'{"model": "tiny", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature", "out of range"),
    ("an integer of 5000 digits", "/v1/completions",
     b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "5001 digits"),
    ("nesting past the parser", "/v1/completions", b"[" * 100_000, None, "nested too deeply"),
    ("n: true", "/v1/completions", _completion(n=True), "n", "must be an integer"),
    ("a bad max_tokens beside a good max_completion_tokens", CHAT,
     json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0,
                 "max_completion_tokens": 4}).encode(), "max_tokens", "at least 1"),
    ("messages that fill the context", CHAT,
     json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "def f(x): return x\n" * 80}]
                 }).encode(), "messages", "leaving none for the completion"),
    ("include_usage not a boolean", "/v1/completions", _completion(stream=True, stream_options={"include_usage": 1}),
     "stream_options", "include_usage"),
]


@pytest.mark.parametrize(("what", "path", "body", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_values_the_engine_cannot_honour_answer_400_naming_the_field(server, what, path, body, param, words):
    code, error = _post(server, body, path)
    assert code == 400, error
    assert error["error"]["param"] == param
    assert words in error["error"]["message"]
    assert "Traceback" not in error["error"]["message"]


def test_the_edges_of_what_the_engine_honours_are_served_and_nothing_dies(server):
    pids = {w["pid"] for w in _workers(server)}
    greedy = _post(server, _completion(temperature=0, ignore_eos=True))[1]["choices"][0]["token_ids"]
    for seed in (-(2**63), -1, 2**63 - 1, 2**64 - 1):
        code, answer = _post(server, _completion(temperature=1.0, seed=seed, ignore_eos=True))
        assert code == 200 and len(answer["choices"][0]["token_ids"]) == 6, (seed, answer)
    # A temperature too small to divide the logits by decodes greedily; a top_p too small for float32 keeps the
    # most likely token, as every top_p under 1/vocab does; a top_k past the vocabulary keeps every token.
    for fields in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324, "seed": 3},
                   {"temperature": 1.0, "top_p": 1e-12, "seed": 4}):
        code, answer = _post(server, _completion(ignore_eos=True, **fields))
        assert code == 200 and answer["choices"][0]["token_ids"] == greedy, (fields, answer)
    code, answer = _post(server, _completion(temperature=1.0, top_k=10**30, seed=5, ignore_eos=True))
    assert code == 200 and all(0 <= t < VOCAB for t in answer["choices"][0]["token_ids"])
    assert {w["pid"] for w in _workers(server) if w["alive"]} == pids


def test_a_request_a_worker_cannot_serve_fails_alone_and_the_worker_goes_on(chat_mixtral_dir):
    """Requests sent to the workers past the front end's checks, through the front end's own client: each one a
    worker cannot serve ends with a failure naming the worker and why; the others are served, and so is the
    next; the drain then stops the engine cleanly."""
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.frontend.engine_client import READY, STOPPED, EngineClient, Failure
    from mbridge_epoverlap.serving.frontend.metrics import ServerMetrics
    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from tests.unit_tests.serving.engine_runs import leftovers

    spec = load_spec(str(chat_mixtral_dir))

    def plan_for(endpoints: list[str], events: str):
        return make_plan(spec, [], attn_workers=1, expert_workers=1, max_batch=4, timeout_s=60.0,
                         online_requests=endpoints, online_events=events, max_model_len=64)

    async def outcome(stream) -> list[int] | Failure:
        tokens = []
        while True:
            item = await stream.queue.get()
            if isinstance(item, Failure):
                return item
            tokens.append(item[0])
            if item[1] is not None:
                return tokens

    async def scenario() -> tuple[dict, list[int], str]:
        engine = EngineClient(plan_for, attn_workers=1, max_batch=4, max_waiting=16,
                              metrics=ServerMetrics(spec.moe_layer_ids))
        engine.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while engine.state != READY:
                assert time.monotonic() < deadline and engine.state not in ("failed", "stopped"), engine.reason
                await asyncio.sleep(0.05)
            sample = dict(ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0)
            greedy = dict(ignore_eos=True, temperature=0.0, top_p=1.0, top_k=0, seed=None)
            streams = {
                "seed": engine.submit([5, 6, 7], max_tokens=4, seed=2**64, **sample),
                "vocabulary": engine.submit([5, VOCAB + 7], max_tokens=4, **greedy),
                "context": engine.submit([5] * 10, max_tokens=60, **greedy),
                # admitted (its settings look sound), then its own sampling fails in float32
                "sampling": engine.submit([5, 6, 7], max_tokens=4, **dict(sample, top_p=5e-324), seed=1),
                "good": engine.submit([5, 6, 7], max_tokens=6, **greedy),
            }
            got = {name: await asyncio.wait_for(outcome(s), WAIT_S) for name, s in streams.items()}
            again = await asyncio.wait_for(outcome(engine.submit([5, 6, 7], max_tokens=6, **greedy)), WAIT_S)
            alive = [pid for pid in engine.pids if leftovers([pid])[0]]
            assert alive == engine.pids
            await engine.drain(30.0)
            return got, again, engine.state
        finally:
            engine.stop_workers()
            engine.close()
            assert leftovers(engine.pids) == ([], [])

    got, again, state = asyncio.run(scenario())
    for name, words in (("seed", "does not seed the generator"), ("vocabulary", f"token ids in 0..{VOCAB - 1}"),
                        ("context", "pass the context of 64 tokens"), ("sampling", "its sampling failed")):
        assert isinstance(got[name], Failure), (name, got[name])
        assert got[name].reason.startswith("attention worker 0 could not serve it: ") and words in got[name].reason
    assert len(got["good"]) == 6 and again == got["good"]
    assert state == STOPPED


def test_a_body_over_the_limit_answers_a_413_a_plain_client_reads(server):
    body = b"x" * (10 << 20)
    # urllib says `Connection: close` and sends the whole body before it reads.
    request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=WAIT_S)
    assert refused.value.code == 413
    assert json.loads(refused.value.read())["error"]["type"] == "RequestTooLargeError"
    # http.client keeps the connection; so does the server, and it answers the next request on it.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 413 and "over the limit" in json.loads(answer.read())["error"]["message"]
        conn.request("POST", "/v1/completions", _completion(temperature=0), {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_stream_nobody_reads_does_not_hold_the_worker_s_batch(server):
    before = _metrics(server)['mbe_requests_total{outcome="finished"}']
    body = json.dumps({"model": MODEL_NAME, "prompt": [9, 8, 7], "max_tokens": CONTEXT - 3, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.socket() as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window the stream soon fills
        stalled.settimeout(WAIT_S)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        # Nothing is read from it: the request still runs to its end on the worker, and others are served.
        _until(lambda: _metrics(server)['mbe_requests_total{outcome="finished"}'] > before,
               "the unread stream's request to finish on the worker")
        assert _post(server, _completion(temperature=0))[0] == 200
        _until(lambda: _metrics(server)["mbe_requests_running"] == 0, "the worker's report of an empty batch")


def test_a_trickled_body_answers_408_and_a_silent_connection_is_closed(start_server, chat_mixtral_dir):
    server = start_server(chat_mixtral_dir, "--read-timeout", "2")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as trickle, \
            socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as silent:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 200\r\n\r\n{\"model\": ")
        answer = http.client.HTTPResponse(trickle)
        answer.begin()
        assert answer.status == 408
        error = json.loads(answer.read())["error"]
        assert error["type"] == "RequestTimeoutError" and "--read-timeout" in error["message"]
        assert silent.recv(1) == b""  # closed by the server, not left open
    assert _post(server, _completion(temperature=0))[0] == 200


def test_past_max_connections_a_request_answers_503_naming_the_flag(start_server, chat_mixtral_dir):
    # The held connections would be closed after --read-timeout (30 s by default) without a request head.
    server = start_server(chat_mixtral_dir, "--max-connections", "3")
    before = _metrics(server)['mbe_requests_total{outcome="rejected"}']
    with contextlib.ExitStack() as held:
        for _ in range(3):  # three open connections, each in the middle of a request head
            conn = held.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S))
            conn.sendall(b"GET /health HTTP/1.1\r\n")
        code, error = _post(server, _completion(temperature=0))
    assert code == 503 and "--max-connections 3" not in error["error"]["message"]
    assert "over its limit of 3 (--max-connections)" in error["error"]["message"], error
    # Once they are closed (the server sees it soon after), requests are served again.
    _until(lambda: _post(server, _completion(temperature=0))[0] == 200, "a request once the connections closed")
    assert _metrics(server)['mbe_requests_total{outcome="rejected"}'] >= before + 1
