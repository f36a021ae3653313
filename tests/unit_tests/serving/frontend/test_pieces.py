"""The front end's pieces without a server: text that streams, request checks, sampling, the online messages."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.frontend.openai_api import ApiError, ModelInfo, parse_chat, parse_completion
from mbridge_epoverlap.serving.frontend.text import TextCodec, TextStream
from mbridge_epoverlap.serving.model.sampling import SamplingParams, sample
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


def test_sampling_narrowed_to_one_token_is_greedy_and_a_seed_repeats():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    assert sample(logits, SamplingParams(1.0, top_k=1), torch.Generator()) == best
    assert sample(logits, SamplingParams(1.0, top_p=1e-6), torch.Generator()) == best
    params = SamplingParams(2.0, seed=11)
    draws = [[sample(logits, params, g) for _ in range(20)] for g in (params.generator(), params.generator())]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_online_messages_round_trip():
    for message in (online.Submit("r1", [1, 2], 5, True, 0.5, 0.9, 3, 7), online.Abort("r1"), online.Shutdown(),
                    online.Done(1),
                    online.Ready(0, 123), online.Tokens(1, [("r1", 4, None), ("r2", 2, "stop")]),
                    online.Stats(0, 1, 2, 30, [1, 0], ["moved"])):
        assert online.decode(online.encode(message)) == message
    with pytest.raises(ValueError, match="unknown online message"):
        online.decode({"kind": "nonsense"})
