"""The OpenAI API's decoding fields against `transformers`, through the `openai` client, on one server.

Log-probabilities (generated and prompt tokens, `echo`, chat) equal `transformers`' log-softmax of the same
logits; `n` choices equal the same request sent once per choice with seed + j; `best_of` keeps the sequence of
highest cumulative log-probability; penalties, logit bias, minimum tokens and stop token ids choose what a
reference loop over `transformers`' logits chooses; structured output and tool calls parse and validate against
their schemas (`jsonschema`); each bad value answers 400 naming its field.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.unit_tests.serving.frontend.conftest import MODEL_NAME, VOCAB

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PROMPT = "def serve(args):"
TOLERANCE = 2e-4  # fp32 log-softmax of logits computed in another order (the engine's kernels, transformers')
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog", "none"]}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120.0, max_retries=0)


@pytest.fixture(scope="module")
def hf_model(chat_mixtral_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(chat_mixtral_dir), attn_implementation="eager",
                                                experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def tokenizer(chat_mixtral_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_mixtral_dir))


def _log_softmax(hf_model, ids: list[int]):
    """transformers' log-probabilities of every next token of `ids`: [len(ids), vocab], fp32."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _top(row, k: int) -> list[tuple[int, float]]:
    import torch

    values, ids = torch.topk(row, k)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def test_generated_logprobs_equal_transformers(client, hf_model, tokenizer):
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    prompt_ids = tokenizer(PROMPT).input_ids
    generated = choice.token_ids
    expected = _log_softmax(hf_model, prompt_ids + generated)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, token in enumerate(generated):
        row = expected[len(prompt_ids) - 1 + i]
        assert abs(lp.token_logprobs[i] - float(row[token])) < TOLERANCE
        assert lp.tokens[i] == tokenizer.decode([token])
        shown: dict[str, float] = {}
        for t, v in _top(row, 3):  # keyed by text: of two tokens that read the same, the likelier
            shown[tokenizer.decode([t])] = max(v, shown.get(tokenizer.decode([t]), -math.inf))
        for text, value in shown.items():
            assert abs(lp.top_logprobs[i][text] - value) < TOLERANCE
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_scores_the_prompt_alone_with_max_tokens_0(client, hf_model, tokenizer):
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    choice = answer.choices[0]
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = _log_softmax(hf_model, prompt_ids)
    assert choice.text == tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert answer.usage.completion_tokens == 0 and choice.token_ids == []
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[i] - float(expected[i - 1][prompt_ids[i]])) < TOLERANCE


def test_echo_with_generation_puts_the_prompt_first_in_stream_and_whole(client, tokenizer):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(stream=True, **body))
    streamed_text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    n_prompt = len(tokenizer(PROMPT).input_ids)
    assert whole.text.startswith(tokenizer.decode(tokenizer(PROMPT).input_ids, skip_special_tokens=True))
    assert streamed_text == whole.text
    assert streamed == whole.logprobs.token_logprobs and len(streamed) == n_prompt + 4


def test_chat_logprobs_equal_transformers(client, hf_model, tokenizer):
    messages = [{"role": "user", "content": "name a queue"}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    content = answer.choices[0].logprobs.content
    generated = tokenizer(answer.choices[0].message.content, add_special_tokens=False).input_ids
    assert len(content) == 4
    expected = _log_softmax(hf_model, list(prompt_ids) + [tokenizer.convert_tokens_to_ids(
        tokenizer.convert_ids_to_tokens(t)) for t in generated][:3])
    first = expected[len(prompt_ids) - 1]
    assert abs(content[0].logprob - float(first.max())) < TOLERANCE
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx([v for _, v in _top(first, 2)],
                                                                          abs=TOLERANCE)
    assert bytes(content[0].bytes).decode() == content[0].token


def test_n_choices_equal_the_same_request_per_seed(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    together = client.completions.create(n=3, seed=41, **body)
    assert [c.index for c in together.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=41 + j, **body).choices[0].token_ids for j in range(3)]
    assert [c.token_ids for c in together.choices] == alone
    assert len({tuple(ids) for ids in alone}) > 1  # the seeds differ, so do the samples


def test_best_of_keeps_the_highest_cumulative_logprob(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    best = client.completions.create(best_of=3, n=1, seed=7, **body).choices
    assert len(best) == 1 and best[0].logprobs is None
    alone = [client.completions.create(seed=7 + j, logprobs=0, **body).choices[0] for j in range(3)]
    totals = [sum(c.logprobs.token_logprobs) for c in alone]
    assert best[0].token_ids == alone[totals.index(max(totals))].token_ids


def _reference_greedy(hf_model, prompt_ids, steps, adjust):
    """transformers' logits, changed by `adjust(logits, generated)`, then argmax: the reference decode loop."""
    import torch

    generated: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + generated])).logits[0, -1].float()
        generated.append(int(torch.argmax(adjust(logits, generated))))
    return generated


def test_penalties_and_logit_bias_choose_what_the_reference_loop_chooses(client, hf_model, tokenizer):
    import torch

    prompt_ids = tokenizer(PROMPT).input_ids
    body = dict(model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0, presence_penalty=1.5,
                frequency_penalty=0.7, logit_bias={"5": 3.0, "17": -100},
                extra_body={"repetition_penalty": 1.3, "ignore_eos": True})

    def adjust(logits, generated):
        logits = logits.clone()
        logits[5] += 3.0
        logits[17] -= 100
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        seen[torch.tensor(prompt_ids + generated)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
        if generated:
            counts = torch.bincount(torch.tensor(generated), minlength=VOCAB).float()
            logits -= 0.7 * counts + 1.5 * (counts > 0).float()
        return logits

    expected = _reference_greedy(hf_model, prompt_ids, 8, adjust)
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].token_ids
    assert client.completions.create(**body).choices[0].token_ids == expected != plain


def test_stop_token_ids_end_and_min_tokens_hold_them_back(client):
    body = dict(model=MODEL_NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(max_tokens=6, **body).choices[0].token_ids
    stop = plain[2]
    first = plain.index(stop)  # the first time greedy decoding meets it
    stopped = client.completions.create(max_tokens=6, model=MODEL_NAME, prompt=PROMPT, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [stop]}).choices[0]
    assert stopped.token_ids == plain[:first + 1] and stopped.finish_reason == "stop"
    held = client.completions.create(max_tokens=6, model=MODEL_NAME, prompt=PROMPT, temperature=0,
                                     extra_body={"stop_token_ids": [stop], "min_tokens": 6}).choices[0]
    assert stop not in held.token_ids and len(held.token_ids) == 6 and held.finish_reason == "length"


def test_json_schema_outputs_validate_100_of_100(client):
    outputs = []
    for seed in range(5):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "a person"}], n=20, seed=1000 * seed,
            temperature=1.0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        outputs += [c.message.content for c in answer.choices]
    assert len(outputs) == 100
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_tool_calls_parse(client):
    messages = [{"role": "user", "content": "weather?"}]
    # Any object: a random model's strings may run past max_tokens; each one that ends is an object, and each
    # one cut short is one begun.
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=10, seed=1, temperature=1.0,
                                            max_tokens=64, response_format={"type": "json_object"})
    ended = [c.message.content for c in answer.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    assert all(c.message.content.startswith("{") for c in answer.choices)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": PERSON}},
             {"type": "function", "function": {"name": "noop", "parameters": {
                 "type": "object", "properties": {}, "additionalProperties": False}}}]
    named = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=64,
                                           tools=tools, tool_choice={"type": "function",
                                                                     "function": {"name": "weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and named.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), PERSON)
    required = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=1.0, seed=3,
                                              max_tokens=96, tools=tools, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        assert call.function.name in ("weather", "noop")
        if call.function.name == "weather":
            jsonschema.validate(json.loads(call.function.arguments), PERSON)
    streamed = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, temperature=0, max_tokens=64, tools=tools, stream=True,
        tool_choice={"type": "function", "function": {"name": "weather"}}))
    calls = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.arguments for c in calls] == [call.function.arguments for call in
                                                     named.choices[0].message.tool_calls]


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 3, "best_of": 2}, "best_of"),
    ("completions", {"best_of": 2, "stream": True}, "best_of"),
    ("completions", {"n": 10_000}, "n"),
    ("completions", {"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"3": 101}}, "logit_bias"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"repetition_penalty": 5e-324}, "repetition_penalty"),  # a seen logit over it: infinite
    ("completions", {"min_tokens": 17}, "min_tokens"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": {}}}}, "tool_choice"),
    ("chat", {"audio": {"voice": "alloy"}}, "audio"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_decoding_fields_answer_400_naming_the_field(client, route, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "completions":
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, extra_body=fields)
        else:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=16, extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body
    assert math.isfinite(len(caught.value.body["message"]))


def _metric(server, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + " "))


def test_prompts_sharing_a_prefix_reuse_its_cached_blocks_and_still_equal_transformers(
        client, server, chat_mixtral_dir, tokenizer, hf_greedy):
    import time

    system = "You are a queue of workers. " * 8  # ~60 tokens: several full 16-token blocks
    prompts = [tokenizer(system + tail).input_ids for tail in ("Name one.", "Name two.", "Name one.")]
    hits_before = _metric(server, "mbe_prefix_cache_hits_total")
    answers = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].token_ids for p in prompts]
    assert answers == hf_greedy(chat_mixtral_dir, prompts, 6)
    shared = len(tokenizer(system).input_ids) // 16 * 16
    # the second reuses the shared blocks, the third its whole prompt's but its last token's block
    wanted = shared + (len(prompts[2]) - 1) // 16 * 16
    deadline = time.monotonic() + 15  # an idle worker reports its counts at its next empty step (<= 2 s)
    while _metric(server, "mbe_prefix_cache_hits_total") - hits_before < wanted and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _metric(server, "mbe_prefix_cache_hits_total") - hits_before >= wanted


def test_the_n_choices_of_a_prompt_prefill_it_once(client, server):
    import random
    import time

    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(60)]  # 3 full blocks before its last token
    hits_before = _metric(server, "mbe_prefix_cache_hits_total")
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, n=4, seed=9, max_tokens=4, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    assert len(answer.choices) == 4
    wanted = 3 * 48  # the other three start from the first's blocks instead of prefilling beside it
    deadline = time.monotonic() + 15
    while _metric(server, "mbe_prefix_cache_hits_total") - hits_before < wanted and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _metric(server, "mbe_prefix_cache_hits_total") - hits_before >= wanted
