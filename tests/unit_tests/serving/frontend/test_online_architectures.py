"""`serve --http` on the other architectures' checkpoints: text through the tokenizer, greedy, via the `openai`
client, equals `transformers`' greedy tokens (and their decoded text).

The serving fixtures (`tiny_{family}_dir`, vocabulary of 128) get a small BPE tokenizer of their own (the
front-end's byte-level one needs 256 ids for its alphabet alone). One server per architecture, two prompts of a
few tokens each, 5 new tokens, the single-process engine (`--colocated 1`: the quickest to start).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.unit_tests.serving.conftest import TINY_VOCAB
from tests.unit_tests.serving.frontend.conftest import MODEL_NAME

openai = pytest.importorskip("openai")

PROMPTS = ["def serve(args):", "return x + y"]
MAX_TOKENS = 5
CORPUS = ["def serve(args):\n    return run(args)\n", "import torch\nclass Worker:\n    pass\n",
          "return x + y if x else y\n", "for i in range(10):\n    print(i, args)\n"]


def _with_tokenizer(source: Path, directory: Path) -> Path:
    """A copy of the checkpoint beside a BPE tokenizer with fewer ids than its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, processors, trainers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(source, directory)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return directory


# Qwen3-Next online: `test_prompts_fed_in_chunks_beside_others_equal_transformers` below.
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "dbrx", "gpt_oss", "glm4_moe", "deepseek_v3", "minimax_m2",
                                    "nemotron_h", "glm_moe_dsa", "llama4"])
def test_text_prompts_equal_transformers_greedy(family, request, tmp_path, start_server, hf_greedy):
    from transformers import AutoTokenizer

    directory = _with_tokenizer(request.getfixturevalue(f"tiny_{family}_dir"), tmp_path / family)
    server = start_server(directory, "--colocated", "1", "--max-batch", "2", "--timeout", "60")  # one process: quick
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert all(max(ids) < TINY_VOCAB and tokenizer.unk_token_id not in ids for ids in prompt_ids)
    expected = hf_greedy(directory, prompt_ids, MAX_TOKENS)
    assert [c.model_extra["token_ids"] for c in answer.choices] == expected
    assert [c.text for c in answer.choices] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompt_ids)


def test_an_fp8_checkpoint_served_online_equals_transformers_on_its_dequantized_weights(
        tiny_deepseek_v3_fp8, tmp_path, start_server, hf_greedy):
    """The sharded FP8 DeepSeek-V3 (`test_fp8_checkpoints.py`) through the OpenAI API, disaggregated; the ready line
    and `/health` say what its two workers hold (FP8 tiles where the tiled GEMMs run)."""
    import httpx
    from transformers import AutoTokenizer

    from mbridge_epoverlap.serving.model.kernels import small_gemm

    quantized, reference = tiny_deepseek_v3_fp8
    directory = _with_tokenizer(quantized, tmp_path / "deepseek_v3_fp8")
    server = start_server(directory, "--max-batch", "2", "--timeout", "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    prompt_ids = [AutoTokenizer.from_pretrained(str(directory))(p).input_ids for p in PROMPTS]
    assert [c.model_extra["token_ids"] for c in answer.choices] == hf_greedy(reference, prompt_ids, MAX_TOKENS)
    held = httpx.get(f"{server.url}/health", timeout=10).json()["memory"]
    assert [p["rank"] for p in held["processes"]] == [0, 1] and held["weights"]["fp32"] > 0
    assert (held["weights"]["fp8"] > 0) == small_gemm.available()
    assert held["kv_cache"] > 0 and all(p["rss"] > p["runtime"] > 0 for p in held["processes"])
    ready = next(line for line in server.stderr if "ready at http://" in line)
    assert re.search(r"weights [\d.]+ [KMG]iB fp32 \+ [\d.]+ [KMG]iB fp8, KV cache" if small_gemm.available()
                     else r"weights [\d.]+ [KMG]iB fp32, KV cache", ready) and "peak RSS" in ready, ready


# (family, the long prompt's tokens, prefill tokens a step): what the scheduler's chunks cut, with two short prompts
# decoding beside: Qwen3-Next's DeltaNet states (25 chunks of 4), Llama 4's attention chunks of 4 (pieces of 3 that
# start inside them: the workers' `prompt_attention` from a later position, masked to the chunks), DeepSeek-V4's
# pools of 4 and 8 and its window of 8 (each piece continuing from the buffered tokens, overlap and entries).
CHUNKED = [("qwen3_next", 100, 4), ("llama4", 30, 3), ("deepseek_v4", 40, 3)]


@pytest.mark.parametrize(("family", "long", "budget"), CHUNKED, ids=[c[0] for c in CHUNKED])
def test_prompts_fed_in_chunks_beside_others_equal_transformers(family, long, budget, request, start_server,
                                                                hf_greedy):
    """Disaggregated (two expert workers) with a small prefill budget: all three prompts equal `transformers`.
    /metrics reports each sequence's state bytes, and a model that keeps state beside its KV cache (DeltaNet, the
    V4 windows and pools) answers no prompt token from a prefix cache."""
    import random
    import urllib.request

    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from mbridge_epoverlap.serving.model.linear.state_cache import state_bytes_per_sequence

    directory = request.getfixturevalue(f"tiny_{family}_dir")
    server = start_server(directory, "--expert-workers", "2", "--max-prefill-tokens", str(budget), "--timeout", "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    rng = random.Random(3)
    batch = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (long, 3, 6)]
    answer = client.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    got = sorted(answer.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in got] == hf_greedy(directory, batch, MAX_TOKENS)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
    spec = load_spec(directory)
    assert value["mbe_state_cache_bytes_per_sequence"] == state_bytes_per_sequence(spec)
    if spec.state_layer_ids or spec.compressed is not None:
        assert value["mbe_prefix_cache_queries_total"] == 0
