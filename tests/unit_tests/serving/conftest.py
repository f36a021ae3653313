"""Tiny real Hugging Face checkpoints for the serving tests, built once per session with `transformers`.

- `tiny_mixtral_dir`: `MixtralForCausalLM`, 2 layers, 4 experts top-2, GQA, untied head.
- `tiny_qwen3_moe_dir`: `Qwen3MoeForCausalLM`, 3 layers of which layer 1 is dense (`mlp_only_layers`,
  its own MLP width), q/k RMSNorm, head_dim != hidden/heads, 8 experts top-2 without renormalisation
  (`norm_topk_prob` false), tied embeddings.
- `tiny_qwen2_moe_dir`: `Qwen2MoeForCausalLM`, 3 layers of which layer 1 is dense, q/k/v biases, a shared
  expert scaled by sigmoid(`shared_expert_gate`), 8 experts top-2 without renormalisation.
- `tiny_olmoe_dir`: `OlmoeForCausalLM`, 2 layers, q/k RMSNorm over the whole projection, 8 experts top-2
  without renormalisation.
- `prompts`: token-id prompts of different lengths.
- `hf_greedy(directory, prompts, max_new_tokens, eos_token_id=...)`: `generate(do_sample=False)` of the
  checkpoint, one prompt at a time: the ground truth.

All models use eager attention and eager experts, the implementations the serving model follows step
by step (its logits then equal transformers' bit for bit). Initialisation std 0.1 (transformers' default
is 0.02) spreads the logits so no greedy choice is a near-tie that the order of a sum could flip; the
biases and norm weights, which transformers initialises to 0 and 1, are drawn too (`_draw_vectors`), so a
bias or norm weight read into the wrong place changes the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

TINY_VOCAB = 128
INIT_STD = 0.1


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run: tiny tensors gain nothing from more, and on a busy
    2-core machine OpenMP's thread hand-offs made each step ~15x slower. Restored after this package."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _save(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1234)
    config = MixtralConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=INIT_STD, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )
    return _save(MixtralForCausalLM(config).eval(), tmp_path_factory.mktemp("tiny_mixtral"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4321)
    config = Qwen3MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=256, initializer_range=INIT_STD,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=3,
    )
    return _save(Qwen3MoeForCausalLM(config).eval(), tmp_path_factory.mktemp("tiny_qwen3_moe"))


def _draw_vectors(model) -> None:
    """Biases ~ N(0, INIT_STD) and norm weights ~ 1 + N(0, INIT_STD) (transformers starts them at 0 and 1)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, INIT_STD)
            elif "norm" in name:
                param.normal_(1.0, INIT_STD)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(2468)
    config = Qwen2MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
        shared_expert_intermediate_size=36, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=256,
        initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3,
    )
    model = Qwen2MoeForCausalLM(config).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_qwen2_moe"))


@pytest.fixture(scope="session")
def tiny_olmoe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(1357)
    config = OlmoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=INIT_STD, pad_token_id=0, bos_token_id=None, eos_token_id=3,
    )
    model = OlmoeForCausalLM(config).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_olmoe"))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return [[5, 17, 42, 9, 100], [11], [77, 1, 2, 30, 4, 65, 6, 7, 8, 90, 10, 12, 13], [64, 31]]


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[..., list[list[int]]]:
    """transformers' greedy generation of a saved checkpoint: the new token ids of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def generate(directory: Path, prompts: list[list[int]], max_new_tokens: int, **kwargs: object) -> list[list[int]]:
        key = str(directory)
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(
                key, attn_implementation="eager", experts_implementation="eager").eval()
        model = models[key]
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=0, **kwargs)
                out.append(ids[0, len(prompt):].tolist())
        return out

    return generate
