"""Chunked prefill on the online server: a prompt longer than the step's prefill budget (`--max-prefill-tokens`) is
fed over several engine steps, gives `transformers`' greedy tokens, and the sequences decoding beside it get a
token at every one of those steps instead of waiting for the whole prompt.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest

from tests.unit_tests.serving.frontend.conftest import MODEL_NAME, VOCAB

openai = pytest.importorskip("openai")

BUDGET = 4  # prompt tokens an engine step feeds
LONG = 240  # a prompt of 60 budgets (the context is 256)


def _stream(client: openai.OpenAI, prompt_ids: list[int], max_tokens: int, on_text: Callable[[], None]) -> None:
    """Stream a greedy completion of token ids; `on_text()` at each event with text (a byte-level tokenizer holds
    back a token that ends inside a character, so there may be fewer events than tokens)."""
    for event in client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
        if event.choices:
            on_text()


def _hits_reach(server, tokens: int, timeout_s: float = 15.0) -> bool:
    """Whether /metrics counts `tokens` prefix-cache hits within `timeout_s` (an idle worker reports its counts at
    its next empty step, up to 2 s after its last token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
            lines = answer.read().decode().splitlines()
        hits = sum(float(line.split()[1]) for line in lines if line.startswith("mbe_prefix_cache_hits_total "))
        if hits >= tokens or time.monotonic() > deadline:
            return hits >= tokens
        time.sleep(0.25)


@pytest.mark.numerics  # prefill in chunks beside decoding: arithmetic only the server's chunked admission runs
@pytest.mark.parametrize("layout", [("--colocated", "1"), ("--attn-workers", "1", "--expert-workers", "1")],
                         ids=["one-process", "disaggregated"])
def test_a_long_prompt_is_fed_in_chunks_that_equal_transformers_while_others_decode(start_server, plain_mixtral_dir,
                                                                                   hf_greedy, layout):
    from transformers import AutoTokenizer

    server = start_server(plain_mixtral_dir, *layout, "--max-prefill-tokens", str(BUDGET), "--timeout", "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)
    rng = random.Random(11)
    long_prompt = [rng.randrange(3, VOCAB) for _ in range(LONG)]
    short_prompt = [rng.randrange(3, VOCAB) for _ in range(5)]

    # Greedy text equals transformers' for prompts of several budgets, one budget, and less; the long prompt
    # again starts from the 14 blocks its first prefill left in the prefix cache and feeds the rest in chunks.
    tokenizer = AutoTokenizer.from_pretrained(str(plain_mixtral_dir))
    for prompt in (long_prompt, long_prompt[:BUDGET], short_prompt, long_prompt[:BUDGET + 1], long_prompt):
        expected = tokenizer.decode(hf_greedy(plain_mixtral_dir, [prompt], 8)[0], skip_special_tokens=True)
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected, f"a prompt of {len(prompt)} tokens"
    assert _hits_reach(server, (LONG - 1) // 16 * 16)

    # A decoding stream gets tokens while the long prompt's chunks are fed, one per engine step.
    short_tokens, at_long_first = [0], []
    short_started, short_done = threading.Event(), threading.Event()

    def short_token() -> None:
        short_tokens[0] += 1
        short_started.set()

    def short_stream() -> None:
        _stream(client, short_prompt, 150, short_token)
        short_done.set()

    short = threading.Thread(target=short_stream)
    short.start()
    assert short_started.wait(60)
    before = short_tokens[0]
    fresh_prompt = [rng.randrange(3, VOCAB) for _ in range(LONG)]  # nothing of it cached: every chunk is fed
    _stream(client, fresh_prompt, 2, lambda: at_long_first.append(short_tokens[0]) if not at_long_first else None)
    short.join(120)
    assert short_done.is_set()
    # 60 chunks: the short stream decodes in each of those steps, a text event for most of its tokens (without
    # chunks the whole prompt is one step: 1 or 2 events)
    assert at_long_first[0] - before >= 15, (before, at_long_first)
