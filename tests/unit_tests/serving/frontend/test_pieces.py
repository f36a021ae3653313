"""The front end's pieces without a server: text that streams, request checks, sampling, the online messages."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.decoding.sampling import SamplingParams, sample
from mbridge_epoverlap.serving.frontend.openai_api import (
    ApiError,
    ModelInfo,
    parse_chat,
    parse_completion,
    parse_json,
)
from mbridge_epoverlap.serving.frontend.text import TextCodec, TextStream
from mbridge_epoverlap.serving.workers import online


class _Bytes:
    """A codec whose tokens are bytes (decoded with replacement), as a byte-level BPE's single bytes are."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text_ids, stops=()):
    stream = TextStream(_Bytes(), stops)
    deltas = [stream.add(t) for t in text_ids]
    return stream, deltas


def test_an_unfinished_character_is_held_back_until_it_completes():
    stream, deltas = _stream(list("aé".encode()))
    assert deltas == ["a", "", "é"]
    assert stream.finish() == ""


def test_a_stop_string_ends_the_text_before_it_and_is_never_sent():
    stream, deltas = _stream(list(b"hello END more"), stops=["END"])
    assert stream.stopped and "".join(deltas) == "hello " and stream.text == "hello "
    assert not any("E" in d for d in deltas)


def test_without_a_stop_the_deltas_add_up_to_the_text():
    stream, deltas = _stream(list(b"abc def"), stops=["zz"])
    assert "".join(deltas) + stream.finish() == "abc def"


def test_chat_without_a_template_is_a_400_naming_it(plain_mixtral_dir):
    model = ModelInfo("m", 384, 256, TextCodec(plain_mixtral_dir))
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, model)
    assert err.value.status == 400 and "no chat template" in err.value.message and "chat_template" in err.value.message


def test_completion_checks_defaults_and_lists_of_prompts(chat_mixtral_dir):
    model = ModelInfo("m", 384, 256, TextCodec(chat_mixtral_dir))
    parsed = parse_completion({"model": "m", "prompt": [[1, 2], "def f"], "stop": "x", "seed": 3}, model)
    assert parsed.prompts[0] == [1, 2] and parsed.prompts[1][0] == 1  # the BOS the post-processor adds
    g = parsed.generation
    assert (g.max_tokens, g.temperature, g.stop, g.seed) == (16, 1.0, ("x",), 3)
    with pytest.raises(ApiError, match="'top_k'"):
        parse_completion({"model": "m", "prompt": [1], "top_k": -2}, model)
    with pytest.raises(ApiError, match="'stop'"):
        parse_completion({"model": "m", "prompt": [1], "stop": [1]}, model)


@pytest.mark.parametrize(("raw", "words"), [
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"top_p": 1e999}', "1e999 is out of range"),
    (b'{"seed": ' + b"9" * 4301 + b"}", "4301 digits"),
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (b'{"prompt": "\xff"}', "not valid JSON"),
    (b'{"a": 1', "not valid JSON"),
])
def test_a_body_is_strict_json(raw, words):
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and words in err.value.message


def test_every_string_of_a_body_is_text_and_a_refusal_says_where():
    assert parse_json('{"prompt": "é \\ud83d\\ude00"}'.encode()) == {"prompt": "é 😀"}  # a surrogate pair is text
    with pytest.raises(ApiError) as err:
        parse_json(b'{"model": "m", "messages": [{"role": "user"}, {"role": "user", "content": "a\\udc00"}]}')
    assert err.value.param == "messages" and err.value.message.startswith("messages[1].content is not valid")
    with pytest.raises(ApiError) as err:
        parse_json(b'{"stop": ["x"], "\\ud800": 1}')
    assert err.value.param is None and err.value.message.startswith("the key '\\ud800' is not valid")


def test_unsupported_fields_take_only_their_neutral_value_and_no_boolean_for_a_number(chat_mixtral_dir):
    model = ModelInfo("m", 384, 256, TextCodec(chat_mixtral_dir))
    for fields in ({"n": 1}, {"n": None}, {"echo": False}, {"suffix": None}):
        parse_completion({"model": "m", "prompt": [1], **fields}, model)
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for fields in ({"service_tier": "auto"}, {"store": False}, {"modalities": ["text"]}, {"audio": None}):
        parse_chat({**chat, **fields}, model)
    for fields in ({"suffix": ""}, {"suffix": "x"}):
        with pytest.raises(ApiError) as err:
            parse_completion({"model": "m", "prompt": [1], **fields}, model)
        assert err.value.param == next(iter(fields)) and "not supported" in err.value.message
    for fields in ({"store": True}, {"store": 0}, {"audio": {"voice": "x"}}, {"modalities": ["audio"]},
                   {"function_call": "auto"}):
        with pytest.raises(ApiError) as err:
            parse_chat({**chat, **fields}, model)
        assert err.value.param == next(iter(fields)) and "not supported" in err.value.message
    # implemented now, but a boolean is not a number here, as in JSON
    for fields in ({"n": True}, {"n": 1.0}, {"echo": 0}, {"best_of": "1"}, {"logprobs": False}):
        with pytest.raises(ApiError) as err:
            parse_completion({"model": "m", "prompt": [1], **fields}, model)
        assert err.value.param == next(iter(fields)) and "must be" in err.value.message


def test_generation_settings_past_the_engine_s_types_are_mapped_or_refused(chat_mixtral_dir):
    model = ModelInfo("m", 384, 256, TextCodec(chat_mixtral_dir))
    g = parse_completion({"model": "m", "prompt": [1], "temperature": 1e-300, "top_p": 5e-324, "top_k": 10**30,
                          "seed": 2**64 - 1}, model).generation
    assert (g.temperature, g.top_k, g.seed) == (0.0, 0, 2**64 - 1) and 0 < g.top_p <= 1e-9
    with pytest.raises(ApiError, match="'seed'"):
        parse_completion({"model": "m", "prompt": [1], "seed": 2**64}, model)
    with pytest.raises(ApiError, match="'temperature' = 1000") as err:
        parse_completion({"model": "m", "prompt": [1], "temperature": 10**400}, model)
    assert err.value.message.endswith("is out of range (a finite number)") and len(err.value.message) < 200
    # chat: every limit given is checked, and one of the default needs room left in the context
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": messages, "max_tokens": -1, "max_completion_tokens": 4}, model)
    assert err.value.param == "max_tokens"
    assert parse_chat({"model": "m", "messages": messages, "max_tokens": 9, "max_completion_tokens": 4},
                      model).generation.max_tokens == 4
    long = [{"role": "user", "content": "def f(x): return x\n" * 80}]
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "m", "messages": long}, model)
    assert err.value.param == "messages" and "leaving none for the completion" in err.value.message


def test_sampling_narrowed_to_one_token_is_greedy_and_a_seed_repeats():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    assert sample(logits, SamplingParams(1.0, top_k=1), torch.Generator()) == best
    assert sample(logits, SamplingParams(1.0, top_p=1e-6), torch.Generator()) == best
    params = SamplingParams(2.0, seed=11)
    draws = [[sample(logits, params, g) for _ in range(20)] for g in (params.generator(), params.generator())]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_draw_follows_the_probabilities_never_a_zero_one_and_refuses_no_mass():
    from mbridge_epoverlap.serving.decoding.sampling import draw

    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(2 * torch.randn(12, generator=gen), dim=-1)
    probs[[0, 5, 11]] = 0.0  # the first, a middle and the last token cannot be drawn
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(20_000)]), minlength=12)
    assert counts[[0, 5, 11]].tolist() == [0, 0, 0]
    # within 4 standard errors of each token's share (the share over the mass left: draw takes unnormalised ones)
    share, drawn = probs / probs.sum(), counts / 20_000
    assert bool(((drawn - share).abs() <= 4 * (share * (1 - share) / 20_000).sqrt() + 1e-9).all()), (drawn, share)
    for empty in (torch.zeros(12), torch.full((12,), float("nan"))):
        with pytest.raises(ValueError, match="no token to draw"):
            draw(empty, gen)


def test_online_messages_round_trip():
    for message in (online.Submit("r1", [1, 2], 5, True, 0.5, 0.9, 3, 7), online.Abort("r1"), online.Shutdown(),
                    online.Done(1), online.Failed(0, "r3", "its prompt is not a non-empty list of token ids"),
                    online.Ready(0, 123),
                    online.Tokens(1, [("r1", 4, None, None), ("r2", 2, "stop", {"logprob": [-0.5, [[2, -0.5]]]})]),
                    online.Stats(0, 1, 2, 30, [[1, 0], [0, 1]], [{"event": "rebalanced", "moved": 2}])):
        assert online.decode(online.encode(message)) == message
    with pytest.raises(ValueError, match="unknown online message"):
        online.decode({"kind": "nonsense"})


def _samples(metrics) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    body, _ = metrics.render()
    return {s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_count_each_lost_process_once_and_each_epoch_once():
    from mbridge_epoverlap.serving.frontend.metrics import ServerMetrics

    metrics = ServerMetrics([1, 3])
    lost_0 = {"event": "detected", "workers": [0]}
    rebalanced = {"event": "rebalanced", "moved": 3, "epoch": 1}
    # Both attention workers detect expert worker 0 and enter epoch 1; the lead sees the loss again when an epoch
    # announced with it alive is entered; the front end also sees its process gone: one loss, one epoch.
    metrics.worker_stats(online.Stats(0, 1, 0, 5, [], [lost_0, rebalanced, lost_0]), [])
    metrics.worker_stats(online.Stats(1, 1, 0, 5, [], [lost_0, rebalanced]), [])
    metrics.worker_lost("expert", 0)
    # Its replacement joins (4 copies move to it), then dies too: a second loss; attention worker 0 dies: a third.
    for attention in (0, 1):
        metrics.worker_stats(online.Stats(attention, 1, 0, 5, [], [
            {"event": "rejoined", "joined": [0], "moved": 4, "epoch": 2}, {"event": "detected", "workers": [0]}]), [])
    metrics.worker_lost("attention", 0)
    metrics.worker_lost("attention", 0)
    # The survivor enters epoch 3 alone: still counted.
    metrics.worker_stats(online.Stats(1, 1, 0, 5, [], [{"event": "rebalanced", "moved": 2, "epoch": 3}]), [])
    got = _samples(metrics)
    assert got["mbe_elastic_workers_lost_total"] == 3
    assert got["mbe_elastic_rebalances_total"] == 2
    assert got["mbe_elastic_workers_rejoined_total"] == 1
    assert got["mbe_elastic_expert_copies_moved_total"] == 3 + 4 + 2


def test_metrics_sum_the_reported_expert_load_per_layer_and_expert():
    from mbridge_epoverlap.serving.frontend.metrics import ServerMetrics

    metrics = ServerMetrics([1, 3], expert_metrics="full")
    metrics.worker_stats(online.Stats(0, 1, 0, 5, [[6, 2, 0, 0], [1, 1, 1, 1]]), [])
    metrics.worker_stats(online.Stats(1, 1, 0, 5, [[2, 2, 0, 4], [0, 0, 0, 0]]), [])
    got = _samples(metrics)
    assert got["mbe_expert_tokens_total|expert=0|layer=1"] == 8
    assert got["mbe_expert_tokens_total|expert=3|layer=1"] == 4
    assert got["mbe_expert_tokens_total|expert=2|layer=3"] == 1
    assert got["mbe_expert_layer_load_imbalance|layer=1"] == 8 / (16 / 4)  # both reports are in the window
    assert got["mbe_expert_layer_load_imbalance|layer=3"] == 1.0
    assert got["mbe_expert_load_imbalance"] == 9 / (20 / 4)  # expert 0 over both layers: 8 + 1
    assert got["mbe_expert_layer_tokens_total|layer=1"] == 16
    assert got["mbe_expert_layer_tokens_total|layer=3"] == 4


def _series(metrics) -> dict[str, int]:
    """Series per metric family in `/metrics` (histograms and counters count each sample line)."""
    from prometheus_client.parser import text_string_to_metric_families

    body, _ = metrics.render()
    return {family.name: len(family.samples) for family in text_string_to_metric_families(body.decode())}


@pytest.mark.parametrize("mode", ["top", "full"])
def test_expert_metrics_stay_bounded_by_default_and_complete_when_asked(mode):
    """256 experts in 58 MoE layers (DeepSeek-V3): by default the expert load costs a bounded number of series
    (per-layer imbalance and token counts, and the HOT_EXPERTS hottest experts per layer); `full` adds a counter
    per layer and expert."""
    from mbridge_epoverlap.serving.frontend.metrics import HOT_EXPERTS, ServerMetrics

    layers, experts = list(range(3, 61)), 256
    metrics = ServerMetrics(layers, expert_metrics=mode)
    for worker in range(2):
        load = [[(layer * 7 + expert * (worker + 3)) % 11 + 1 for expert in range(experts)] for layer in layers]
        metrics.worker_stats(online.Stats(worker, 1, 0, 5, load), [])
    metrics.worker_stats(online.Stats(0, 1, 0, 5, [[0] * experts for _ in layers]), [])  # an idle report
    series = _series(metrics)
    expert_series = sum(n for name, n in series.items() if name.startswith("mbe_expert"))
    # imbalance: 1 + one per layer; tokens per layer; the hot experts' counts and ids
    bounded = 1 + len(layers) + len(layers) + 2 * HOT_EXPERTS * len(layers)
    if mode == "top":
        assert "mbe_expert_tokens" not in series
        assert expert_series <= bounded + len(layers), series  # + the per-layer counter's _created samples
        assert expert_series < 1000
    else:
        assert expert_series >= bounded + len(layers) * experts
    got = _samples(metrics)
    for layer in layers:
        totals = [sum((layer * 7 + expert * (worker + 3)) % 11 + 1 for worker in range(2))
                  for expert in range(experts)]
        hottest = sorted(range(experts), key=lambda e: (-totals[e], e))[:HOT_EXPERTS]
        assert [got[f"mbe_expert_hot_expert|layer={layer}|rank={rank}"] for rank in range(HOT_EXPERTS)] == hottest
        assert [got[f"mbe_expert_hot_tokens|layer={layer}|rank={rank}"] for rank in range(HOT_EXPERTS)] == \
            [totals[e] for e in hottest]
        assert got[f"mbe_expert_layer_tokens_total|layer={layer}"] == sum(totals)
        if mode == "full":
            assert [got[f"mbe_expert_tokens_total|expert={e}|layer={layer}"] for e in range(experts)] == totals
