"""The OpenAI-compatible server against `transformers`, through the `openai` client: one server for the module.

Greedy text and token-id prompts equal `generate`, decoded the same way; streaming equals non-streaming; chat
equals the template applied by `transformers`; bad requests answer OpenAI's error bodies naming the field; a
client that goes away frees its KV rows.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.unit_tests.serving.frontend.conftest import CONTEXT, MODEL_NAME, VOCAB

openai = pytest.importorskip("openai")

PROMPTS = ["def serve(args):", "import torch\n", "class Worker:"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(chat_mixtral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_mixtral_dir))


def _greedy_text(hf_greedy, directory, tokenizer, prompt_ids, max_tokens):
    ids = hf_greedy(directory, [prompt_ids], max_tokens)[0]
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_text_prompts_equal_transformers_greedy(client, chat_mixtral_dir, hf_tokenizer, hf_greedy):
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    total_prompt = 0
    for prompt, choice in zip(PROMPTS, answer.choices, strict=True):
        prompt_ids = hf_tokenizer(prompt).input_ids
        total_prompt += len(prompt_ids)
        ids, text = _greedy_text(hf_greedy, chat_mixtral_dir, hf_tokenizer, prompt_ids, 12)
        assert choice.text == text
        assert choice.model_extra["token_ids"] == ids
        assert choice.finish_reason == ("stop" if len(ids) < 12 else "length")
    assert answer.usage.prompt_tokens == total_prompt
    assert answer.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in answer.choices)


def test_token_id_prompts_equal_transformers_greedy(client, chat_mixtral_dir, hf_tokenizer, hf_greedy):
    prompts = [[5, 17, 42, 9, 100], [300, 11]]
    one = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    both = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    expected = hf_greedy(chat_mixtral_dir, prompts, 10, eos_token_id=None)
    assert one.choices[0].model_extra["token_ids"] == expected[0]
    assert [c.model_extra["token_ids"] for c in both.choices] == expected
    assert all(c.finish_reason == "length" for c in both.choices)
    assert both.choices[1].text == hf_tokenizer.decode(expected[1], skip_special_tokens=True)


def test_streaming_equals_non_streaming_with_usage(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    texts, finishes, usage = ["", ""], [None, None], None
    for event in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=16, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert finishes == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 32 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_ends_with_done(server):
    body = json.dumps({"model": MODEL_NAME, "prompt": [7, 8, 9], "max_tokens": 3, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        events = [line for line in answer.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-1])


def test_chat_equals_the_template_applied_by_transformers(client, chat_mixtral_dir, hf_tokenizer, hf_greedy):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "a worker"}]
    prompt_ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 answers a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    ids, text = _greedy_text(hf_greedy, chat_mixtral_dir, hf_tokenizer, prompt_ids, 9)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == len(prompt_ids) and answer.usage.completion_tokens == len(ids)
    streamed = "".join(event.choices[0].delta.content or "" for event in client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=9, temperature=0, stream=True) if event.choices)
    assert streamed == text


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # Two characters from the middle on, neither of them blank (a blank stop would also cut at earlier spaces).
    at = next((i for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip() == full[i:i + 2]), None)
    assert at is not None, f"pick another prompt: {full!r}"
    stop = full[at:at + 2]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        answer = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                           stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            events = list(answer)
            text = "".join(c.text for e in events for c in e.choices)
            finish = [c.finish_reason for e in events for c in e.choices if c.finish_reason][-1]
        else:
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert (text, finish) == (cut, "stop")


def test_seeded_sampling_repeats_and_differs_from_greedy(client):
    kwargs = dict(model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=24, temperature=1.5, top_p=0.95,
                  extra_body={"ignore_eos": True, "top_k": 50})
    first = client.completions.create(seed=7, **kwargs).choices[0].model_extra["token_ids"]
    again = client.completions.create(seed=7, **kwargs).choices[0].model_extra["token_ids"]
    greedy = client.completions.create(model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].model_extra["token_ids"]
    assert first == again
    assert first != greedy
    assert all(0 <= t < VOCAB for t in first)


def test_models_health_and_metrics(client, server, chat_mixtral_dir):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as answer:
        health = json.loads(answer.read())
    assert health["status"] == "ok"
    assert sorted((w["role"], w["alive"]) for w in health["workers"]) == [("attention", True), ("expert", True)]
    # --dtype auto on a checkpoint saved in float32: float32, and why
    assert health["dtype"]["dtype"] == "float32" and health["dtype"]["requested"] == "auto"
    assert health["dtype"]["checkpoint_dtype"] == "float32" and "checkpoint's dtype" in health["dtype"]["reason"]
    assert any("ready at" in line and "dtype float32" in line for line in server.stderr)
    metrics = _metrics(server)
    assert metrics['mbe_requests_total{outcome="finished"}'] >= 1
    for name in ("mbe_time_to_first_token_seconds_count", "mbe_time_per_output_token_seconds_count",
                 "mbe_e2e_request_latency_seconds_count", "mbe_requests_running", "mbe_requests_waiting",
                 "mbe_kv_cache_tokens", "mbe_expert_load_imbalance", "mbe_elastic_workers_lost_total",
                 "mbe_elastic_workers_rejoined_total", "mbe_elastic_rebalances_total"):
        assert name in metrics
    assert metrics["mbe_expert_load_imbalance"] >= 1.0
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec(chat_mixtral_dir)  # a GQA model in float32: each layer's keys and values of its KV heads
    assert metrics["mbe_kv_cache_bytes_per_token"] == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


def test_an_idle_server_runs_almost_no_engine_steps_and_wakes_for_a_request(client, server):
    """Idle, the attention worker blocks on its socket: one empty step (what proves the workers alive) every
    `online.idle_wait_s` at most, not one every 50 ms; a request wakes it at once."""
    from mbridge_epoverlap.serving.workers import online

    idle_s, wait_s = 4.0, online.idle_wait_s(60.0)  # the module's server runs with --timeout 60
    before = _idle_metrics(server)
    time.sleep(idle_s)
    after = _metrics(server)
    steps = after['mbe_engine_steps{worker="0"}'] - before['mbe_engine_steps{worker="0"}']
    idle = after['mbe_engine_idle_steps{worker="0"}'] - before['mbe_engine_idle_steps{worker="0"}']
    # each empty step follows a full idle wait; a report may lag its step by one wait
    assert idle == steps and steps <= idle_s / wait_s + 2, (steps, idle)  # polling every 50 ms ran ~80
    started = time.monotonic()
    answer = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert time.monotonic() - started < wait_s  # not held until the next empty step


def _per_layer(metrics: dict[str, float], name: str) -> dict[str, float]:
    """`{layer: sum of name's samples of that layer}` (`name{layer="L",...} value` lines)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(name + "{"):
            layer = key.split('layer="', 1)[1].split('"', 1)[0]
            out[layer] = out.get(layer, 0.0) + value
    return out


def _idle_metrics(server) -> dict[str, float]:
    """`/metrics` once no request runs or waits (the workers' last report, with its expert load, has arrived) and
    the attention worker has reported at least once (a server just started shows zeros before its first report)."""
    deadline = time.monotonic() + 60
    while True:
        metrics = _metrics(server)
        reported = 'mbe_engine_steps{worker="0"}' in metrics
        if reported and metrics["mbe_requests_running"] == 0 and metrics["mbe_requests_waiting"] == 0:
            return metrics
        assert time.monotonic() < deadline, "the server did not report itself idle"
        time.sleep(0.05)


def test_step_histograms_count_every_step_and_every_token_row_it_fed(client, server):
    """A request of 3 prompt tokens and 4 new ones: a prefill step feeding 3 rows, then 3 decoding steps of 1 row
    (the last token is sampled, never fed), each timed in `mbe_engine_step_seconds`."""
    before = _idle_metrics(server)
    answer = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 30
    while True:  # the last step's report follows the request's end
        after = _idle_metrics(server)
        steps = sum(after.get(f'mbe_engine_step_seconds_count{{worker="{w}"}}', 0)
                    - before.get(f'mbe_engine_step_seconds_count{{worker="{w}"}}', 0) for w in range(4))
        if steps >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rows = sum(after.get(f'mbe_iteration_tokens_sum{{worker="{w}"}}', 0)
               - before.get(f'mbe_iteration_tokens_sum{{worker="{w}"}}', 0) for w in range(4))
    assert (steps, rows) == (4, 3 + 3)
    seconds = sum(after.get(f'mbe_engine_step_seconds_sum{{worker="{w}"}}', 0)
                  - before.get(f'mbe_engine_step_seconds_sum{{worker="{w}"}}', 0) for w in range(4))
    assert 0 < seconds < 60


def test_metrics_count_every_routed_token_per_layer(client, server, chat_mixtral_dir):
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec(chat_mixtral_dir)
    layers = [str(layer) for layer in spec.moe_layer_ids]
    before = _per_layer(_idle_metrics(server), "mbe_expert_tokens_total")
    answer = client.completions.create(model=MODEL_NAME, prompt=[40, 41, 42, 43, 44], max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    after_metrics = _idle_metrics(server)
    after = _per_layer(after_metrics, "mbe_expert_tokens_total")
    # The worker's router sent each token the model ran (the prompt, then each new token but the last) to top_k
    # experts in every MoE layer.
    fed = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1
    assert {layer: after[layer] - before.get(layer, 0.0) for layer in layers} == \
        {layer: float(fed * spec.top_k) for layer in layers}
    per_layer = _per_layer(after_metrics, "mbe_expert_layer_tokens_total")
    assert {layer: per_layer[layer] for layer in layers} == {layer: after[layer] for layer in layers}
    imbalance = _per_layer(after_metrics, "mbe_expert_layer_load_imbalance")
    assert sorted(imbalance) == sorted(layers)
    assert all(1.0 <= value <= spec.num_experts for value in imbalance.values())


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"model": "other", "prompt": "x"}, 404, "model", "`other` does not exist"),
    ({"prompt": "x"}, 400, "model", "'model' is required"),
    ({"model": MODEL_NAME, "prompt": [1, VOCAB + 5]}, 400, "prompt", "outside the vocabulary"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": -0.5}, 400, "temperature", "at least 0"),
    ({"model": MODEL_NAME, "prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs", "--max-logprobs"),
    ({"model": MODEL_NAME, "prompt": [], "max_tokens": 2}, 400, "prompt", "'prompt' must be"),
    ({"model": MODEL_NAME, "prompt": [3] * 250, "max_tokens": 10}, 400, "max_tokens",
     f"maximum context length is {CONTEXT} tokens. However, you requested 260 tokens"),
])
def test_bad_requests_answer_openai_errors_naming_the_field(server, body, status, param, words):
    code, error = _post(server, "/v1/completions", json.dumps(body).encode())
    assert code == status
    assert error["error"]["param"] == param
    assert words in error["error"]["message"]


def test_malformed_json_and_oversized_bodies(server):
    code, error = _post(server, "/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in error["error"]["message"]
    # A body declared too large is refused from its headers, before it is sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2097152\r\n\r\n")
        answer = conn.makefile("rb").readline()
    assert answer.split()[1] == b"413"
    # A streamed body (chunked, no length given) is refused once what arrived passes the limit.
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):  # the server may answer and close before every chunk is sent
            for _ in range(40):  # 2.5 MiB, over the 1 MiB limit
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.sendall(b"0\r\n\r\n")
        status_line = conn.makefile("rb").readline()
    assert status_line.split()[1] == b"413", status_line
    code, error = _post(server, "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": "hi"}).encode())
    assert code == 400 and error["error"]["param"] == "messages"


def test_a_client_that_goes_away_frees_its_kv_rows(client, server):
    before = _metrics(server)['mbe_requests_total{outcome="aborted"}']
    stream = client.completions.create(model=MODEL_NAME, prompt=[9, 9, 9], max_tokens=CONTEXT - 3, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 60
    while True:  # the abort reaches the worker at its next step boundary; its stats follow
        metrics = _metrics(server)
        if metrics['mbe_requests_total{outcome="aborted"}'] > before and metrics["mbe_kv_cache_tokens"] == 0 \
                and metrics["mbe_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.1)
    # The slot is free: a next request still completes.
    assert client.completions.create(model=MODEL_NAME, prompt=[1, 2], max_tokens=2, temperature=0).choices


def test_a_plain_request_whose_connection_closes_is_aborted(server):
    def wait_for(condition, what):
        deadline = time.monotonic() + 60
        while not condition(_metrics(server)):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    before = _metrics(server)['mbe_requests_total{outcome="aborted"}']
    body = json.dumps({"model": MODEL_NAME, "prompt": [4, 4, 4], "max_tokens": CONTEXT - 3, "temperature": 0,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(head + body)
        wait_for(lambda m: m["mbe_kv_cache_tokens"] > 0, "the request to decode")
    wait_for(lambda m: m['mbe_requests_total{outcome="aborted"}'] > before and m["mbe_kv_cache_tokens"] == 0,
             "the abort to free the KV rows")


def _post(server, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.url}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
