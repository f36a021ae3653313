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


# Qwen3-Next online: `test_a_hybrid_model_fed_in_chunks_beside_others_equals_transformers` below.
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


def test_a_hybrid_model_fed_in_chunks_beside_others_equals_transformers(tiny_qwen3_next_dir, tmp_path, start_server,
                                                                         hf_greedy):
    """Qwen3-Next disaggregated (two expert workers) with a prefill budget of 4 tokens a step: a 100-token prompt is
    fed in 25 chunks, each continuing the DeltaNet states the last left, while two short prompts decode beside it;
    all three equal `transformers`. /metrics reports the state bytes per sequence, and no prompt token goes through
    a prefix cache (a hybrid model keeps none)."""
    import random
    import urllib.request

    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from mbridge_epoverlap.serving.model.linear.state_cache import state_bytes_per_sequence

    server = start_server(tiny_qwen3_next_dir, "--expert-workers", "2", "--max-prefill-tokens", "4", "--timeout", "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    rng = random.Random(3)
    batch = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (100, 3, 6)]
    answer = client.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    got = sorted(answer.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in got] == hf_greedy(tiny_qwen3_next_dir, batch, MAX_TOKENS)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
    assert value["mbe_state_cache_bytes_per_sequence"] == state_bytes_per_sequence(load_spec(tiny_qwen3_next_dir))
    assert value["mbe_prefix_cache_queries_total"] == 0


def test_llama4_prompts_fed_across_attention_chunks_equal_transformers(tiny_llama4_dir, start_server, hf_greedy):
    """Llama 4 disaggregated (two expert workers) with a prefill budget of 3 tokens a step, against its attention
    chunks of 4: a 30-token prompt is fed in pieces that start inside chunks (the workers' `prompt_attention` from a
    later position, masked to the chunks), while two short prompts decode beside it; all three equal
    `transformers`."""
    import random

    server = start_server(tiny_llama4_dir, "--expert-workers", "2", "--max-prefill-tokens", "3", "--timeout", "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    rng = random.Random(3)
    batch = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (30, 3, 6)]
    answer = client.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    got = sorted(answer.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in got] == hf_greedy(tiny_llama4_dir, batch, MAX_TOKENS)


def test_deepseek_v4_prompts_fed_across_its_pools_equal_transformers(tiny_deepseek_v4_dir, start_server, hf_greedy):
    """DeepSeek-V4 disaggregated (two expert workers) with a prefill budget of 3 tokens a step, against its pools of 4
    and 8 tokens and its window of 8: a 40-token prompt is fed in pieces that cut the pools' windows (each continuing
    from the buffered tokens, overlap and entries the last left), while two short prompts decode beside it; all three
    equal `transformers`, and no prompt token goes through a prefix cache (the windows and pools are not in it)."""
    import random
    import urllib.request

    server = start_server(tiny_deepseek_v4_dir, "--expert-workers", "2", "--max-prefill-tokens", "3", "--timeout",
                          "60")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60.0, max_retries=0)
    rng = random.Random(3)
    batch = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (40, 3, 6)]
    answer = client.completions.create(model=MODEL_NAME, prompt=batch, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    got = sorted(answer.choices, key=lambda c: c.index)
    assert [c.model_extra["token_ids"] for c in got] == hf_greedy(tiny_deepseek_v4_dir, batch, MAX_TOKENS)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    value = {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
    assert value["mbe_prefix_cache_queries_total"] == 0
