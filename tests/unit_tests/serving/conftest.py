"""Tiny real Hugging Face checkpoints for the serving tests, built once per session with `transformers`.

- `tiny_mixtral_dir`: `MixtralForCausalLM`, 2 layers, 4 experts top-2, GQA, untied head.
- `tiny_qwen3_moe_dir`: `Qwen3MoeForCausalLM`, 3 layers of which layer 1 is dense (`mlp_only_layers`,
  its own MLP width), q/k RMSNorm, head_dim != hidden/heads, 8 experts top-2 without renormalisation
  (`norm_topk_prob` false), tied embeddings.
- `tiny_qwen2_moe_dir`: `Qwen2MoeForCausalLM`, 3 layers of which layer 1 is dense, q/k/v biases, a shared
  expert scaled by sigmoid(`shared_expert_gate`), 8 experts top-2 without renormalisation.
- `tiny_olmoe_dir`: `OlmoeForCausalLM`, 2 layers, q/k RMSNorm over the whole projection, 8 experts top-2
  without renormalisation.
- `tiny_dbrx_dir`: `DbrxForCausalLM`, 2 layers, GQA, fused `Wqkv` clamped by a `clip_qkv` the random
  projections exceed, bias-free LayerNorms, 8 experts top-2 stored fused per projection.
- `tiny_gpt_oss_dir`: `GptOssForCausalLM`, 3 layers (sliding, full, sliding attention with a window of 4, shorter
  than the longest prompt), attention sinks, q/k/v/o, router and expert biases, 8 experts top-2 stored fused
  with gate and up interleaved, a clamped SwiGLU whose `swiglu_limit` (0.8) the activations exceed, YaRN rope
  (factor 4 over an original context of 64).
- `tiny_qwen3_next_dir`: `Qwen3NextForCausalLM`, a hybrid: three gated DeltaNet layers and one gated full-attention
  layer (`qwen3_next_config`); `tiny_qwen3_5_moe_dir`: `Qwen3_5MoeForCausalLM`, the same sizes, every layer MoE.
- `tiny_minimax_m2_dir`: `MiniMaxM2ForCausalLM`, sigmoid routing with a correction bias, q/k RMSNorm over the
  projections, partial rotary.
- `tiny_nemotron_h_dir`: `NemotronHForCausalLM`, Mamba-2, attention and relu^2 MoE and MLP blocks.
- `tiny_llama4_dir`: `Llama4ForCausalLM`, chunked attention on its rope layers (chunks of 4), a NoPE layer with the
  attention temperature, MoE and dense layers interleaved, top-1 routing scaling the experts' input.
- `tiny_qwen3_5_moe_vl_dir`, `tiny_llama4_vl_dir`: the Qwen3.5-MoE and Llama 4 text models as their families release
  them (`...ForConditionalGeneration`: the language model under another prefix, a vision tower beside it).
- `tiny_deepseek_v32_dir`, `tiny_glm_moe_dsa_dir`: `DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM`, DeepSeek-V3's
  latent attention with DeepSeek Sparse Attention choosing 4 tokens per query (GLM-5: a layer sharing the choice).
- `tiny_deepseek_v4_dir`: `DeepseekV4ForCausalLM` (`deepseek_v4_config`): compressed sparse, heavily compressed and
  sliding-window attention layers, three residual streams, a hash-routed first layer.
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

import shutil
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
            elif "norm" in name.split(".")[-2]:  # the module's own name (DBRX's `norm_attn_norm` holds attention)
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
def tiny_dbrx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import DbrxConfig, DbrxForCausalLM

    torch.manual_seed(8642)
    config = DbrxConfig(
        vocab_size=TINY_VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=256, initializer_range=INIT_STD,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.3, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 8, "moe_top_k": 2},
        bos_token_id=None, eos_token_id=3,
    )
    model = DbrxForCausalLM(config).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_dbrx"))


GPT_OSS_SWIGLU_LIMIT = 0.8


@pytest.fixture(scope="session")
def tiny_gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(97)
    config = GptOssConfig(  # widths multiples of 32: MXFP4 blocks (test_gpt_oss quantizes these experts)
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        initializer_range=INIT_STD, swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=3,
    )
    model = GptOssForCausalLM(config).eval()
    _draw_vectors(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj_bias"):  # the experts' fused biases (transformers starts them at 0)
                param.normal_(0.0, INIT_STD)
            elif name.endswith(".sinks"):  # large enough that a sink takes a real share of some softmax
                param.normal_(0.0, 1.0)
    return _save(model, tmp_path_factory.mktemp("tiny_gpt_oss"))


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


# --- GLM-4.5 and DeepSeek-V3 (grouped sigmoid routing, shared experts, dense first layers) --------------------------

GLM4_MOE_SCALING = 1.7


def _draw_correction_bias(model) -> None:
    """Each router's `e_score_correction_bias` (a buffer transformers starts at 0) ~ N(0, 0.5): comparable to the
    sigmoid scores' spread, so it changes which experts are chosen but not their weights."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`Glm4MoeForCausalLM`: 3 layers, the first dense; GQA with head_dim 16 != hidden/heads, half of each head
    rotated, q/k RMSNorm, q/k/v biases; 8 experts top-2 in 4 groups of which 2 are eligible, a shared expert,
    `routed_scaling_factor` 1.7; the correction bias drawn."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(3141)
    config = Glm4MoeConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True,
        attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=GLM4_MOE_SCALING, norm_topk_prob=True,
        max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3,
    )
    model = Glm4MoeForCausalLM(config).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    return _save(model, tmp_path_factory.mktemp("tiny_glm4_moe"))


def qwen3_next_config():
    """The tiny Qwen3-Next of `tiny_qwen3_next_dir`: 4 layers, three gated DeltaNet layers then a full-attention one
    (the released 3:1 pattern), layer 1 dense; 2 key heads serving 4 value heads (GQA-like grouping) of 8, a
    4-tap convolution; full attention with GQA, head_dim 16, a quarter of each head rotated and an output gate;
    8 experts top-2 renormalised and a gated shared expert."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`Qwen3NextForCausalLM` (`qwen3_next_config`), its norm weights and biases drawn."""
    import torch
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(2025)
    model = Qwen3NextForCausalLM(qwen3_next_config()).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_qwen3_next"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`Qwen3_5MoeForCausalLM`: `qwen3_next_config`'s sizes (every layer MoE, as Qwen3.5 has no dense layers), its
    DeltaNet projections stored apart; norm weights drawn."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = qwen3_next_config().to_dict()
    sizes = {k: fields[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                                    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                    "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings",
                                    "initializer_range", "bos_token_id", "eos_token_id")}
    torch.manual_seed(2026)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**sizes)).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_qwen3_5_moe"))


@pytest.fixture(scope="session")
def tiny_minimax_m2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`MiniMaxM2ForCausalLM`: 2 layers, GQA, q/k RMSNorm over the projections, half of each head rotated (MiniMax's
    own `rotary_dim`), 8 experts top-2 chosen by sigmoid scores with a drawn correction bias."""
    import torch
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    torch.manual_seed(2718)
    config = MiniMaxM2Config(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3,
    )
    model = MiniMaxM2ForCausalLM(config).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    return _save(model, tmp_path_factory.mktemp("tiny_minimax_m2"))


NEMOTRON_H_BLOCKS = ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "linear_attention", "mlp",
                     "moe"]


@pytest.fixture(scope="session")
def tiny_nemotron_h_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`NemotronHForCausalLM` of 8 blocks (`NEMOTRON_H_BLOCKS`): Mamba-2 (4 heads of 8 in 2 groups, state 16, a 4-tap
    convolution with a bias, chunks of 16 tokens), attention without rope, relu^2 experts (8, top-2, 2 groups of which
    1 is eligible, a drawn correction bias) with a shared expert, a relu^2 MLP; as engine layers: Mamba-2 + MoE,
    attention + MoE, Mamba-2 alone, Mamba-2 + MLP, MoE alone."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(1618)
    config = NemotronHConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, layers_block_type=NEMOTRON_H_BLOCKS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=40, mamba_num_heads=4, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=20, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None,
        eos_token_id=3,
    )
    model = NemotronHForCausalLM(config).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    return _save(model, tmp_path_factory.mktemp("tiny_nemotron_h"))


LLAMA4_CHUNK = 4  # shorter than three of the four prompts: queries of their later chunks see only their own chunk


def llama4_config(**changes: object):
    """A tiny `Llama4TextConfig`: 4 layers, the last without rope (`no_rope_layer_interval` 4) and the three others
    chunked by `LLAMA4_CHUNK`; GQA with head_dim 16 != hidden/heads, q/k RMS norm on the rope layers; the attention
    temperature from position 3 on (`floor_scale` 4, `attn_scale` 0.5: the released 8192 and 0.1 never fire within
    the prompts); layers 1 and 3 MoE (`interleave_moe_layer_step` 2) with 8 experts top-1 and a shared expert of
    24, layers 0 and 2 dense of 40."""
    from transformers import Llama4TextConfig

    sizes = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                 num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=LLAMA4_CHUNK, floor_scale=4,
                 attn_scale=0.5, max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None,
                 eos_token_id=3, pad_token_id=None)
    return Llama4TextConfig(**{**sizes, **changes})


@pytest.fixture(scope="session")
def tiny_llama4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`Llama4ForCausalLM` (`llama4_config`), its norm weights drawn."""
    import torch
    from transformers import Llama4ForCausalLM

    torch.manual_seed(4004)
    model = Llama4ForCausalLM(llama4_config()).eval()
    _draw_vectors(model)
    return _save(model, tmp_path_factory.mktemp("tiny_llama4"))


DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def deepseek_v3_config(q_lora_rank: int | None):
    """A tiny `DeepseekV3Config`: 3 layers, the first dense; 4 heads of latent attention (queries through a
    `q_lora_rank` bottleneck or not, a 16-wide latent, 8 + 8 query/key and 12 value dimensions per head, the rotary
    part interleaved); YaRN over an original context of 64 whose `mscale_all_dim` scales the softmax; 8 experts top-2
    in 4 groups of which 2 are eligible, a shared expert, `routed_scaling_factor` 2.5."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(DEEPSEEK_V3_ROPE), rope_interleave=True, max_position_embeddings=256,
        initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3,
    )


def _tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory, q_lora_rank: int | None, seed: int) -> Path:
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(q_lora_rank)).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    return _save(model, tmp_path_factory.mktemp(f"tiny_deepseek_v3_q{q_lora_rank}"))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`DeepseekV3ForCausalLM` with a 16-wide query bottleneck (`deepseek_v3_config`)."""
    return _tiny_deepseek_v3(tmp_path_factory, 16, 2718)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_direct_q_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`DeepseekV3ForCausalLM` with queries projected directly (`q_lora_rank` null)."""
    return _tiny_deepseek_v3(tmp_path_factory, None, 1618)


# --- vision-language releases: the text models above under another prefix, a vision tower beside ------------------

TINY_VISION = {"Qwen3_5MoeForCausalLM": dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=32),
               "Llama4ForCausalLM": dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14, projector_input_dim=16,
                                         projector_output_dim=32, vision_output_dim=16)}


def _released_with_vision(text_dir: Path, directory: Path) -> Path:
    """The text checkpoint in `text_dir` as its family releases it: a `...ForConditionalGeneration` whose language
    model holds the same weights (`text_config`, its tensors under the release's prefix), and a tiny vision tower."""
    import torch
    from transformers import AutoModelForCausalLM

    text = AutoModelForCausalLM.from_pretrained(text_dir).eval()
    vision = TINY_VISION[text.config.architectures[0]]
    torch.manual_seed(7)
    if text.config.architectures[0] == "Llama4ForCausalLM":
        from transformers import Llama4Config, Llama4ForConditionalGeneration

        model = Llama4ForConditionalGeneration(Llama4Config(text_config=text.config.to_dict(), vision_config=vision,
                                                            image_token_index=TINY_VOCAB - 1)).eval()
        model.language_model.load_state_dict(text.state_dict())
    else:
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text.config.to_dict(),
                                                                    vision_config=vision)).eval()
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    return _save(model, directory)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_vl_dir(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_moe_dir: Path) -> Path:
    """`Qwen3_5MoeForConditionalGeneration` around `tiny_qwen3_5_moe_dir`'s weights (`model.language_model.`)."""
    return _released_with_vision(tiny_qwen3_5_moe_dir, tmp_path_factory.mktemp("tiny_qwen3_5_moe_vl"))


@pytest.fixture(scope="session")
def tiny_llama4_vl_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama4_dir: Path) -> Path:
    """`Llama4ForConditionalGeneration` around `tiny_llama4_dir`'s weights (`language_model.`)."""
    return _released_with_vision(tiny_llama4_dir, tmp_path_factory.mktemp("tiny_llama4_vl"))


# --- DeepSeek Sparse Attention: DeepSeek-V3.2 and GLM-5 -----------------------------------------------------------

DSA_TOPK = 4  # shorter than three of the four prompts and every continuation: the indexer's choice matters


def dsa_config(cls, **changes: object):
    """DeepSeek-V3.2's or GLM-5's config at `deepseek_v3_config`'s sizes (16-wide query bottleneck), with an
    indexer of 8 heads of 16 (the first 8 turned) choosing `DSA_TOPK` tokens."""
    sizes = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                 n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                 norm_topk_prob=True, index_topk=DSA_TOPK, index_n_heads=8, index_head_dim=16,
                 max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=3)
    return cls(**{**sizes, **changes})


def _tiny_dsa(tmp_path_factory: pytest.TempPathFactory, model_cls, config, name: str, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    return _save(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="session")
def tiny_deepseek_v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`DeepseekV32ForCausalLM` (`dsa_config`), YaRN as `deepseek_v3_config`'s; the indexer turns its rotary half
    by halves."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = dsa_config(DeepseekV32Config, rope_parameters=dict(DEEPSEEK_V3_ROPE))
    return _tiny_dsa(tmp_path_factory, DeepseekV32ForCausalLM, config, "tiny_deepseek_v32", 3141)


@pytest.fixture(scope="session")
def tiny_glm_moe_dsa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`GlmMoeDsaForCausalLM` (`dsa_config`, GLM-5's RMSNorm epsilon), its indexer in interleaved pairs; layer 1
    reuses layer 0's choice (`index_topk_pattern` "FSF")."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    config = dsa_config(GlmMoeDsaConfig, index_topk_pattern="FSF")
    return _tiny_dsa(tmp_path_factory, GlmMoeDsaForCausalLM, config, "tiny_glm_moe_dsa", 2236)


# --- FP8 block-scaled checkpoints (`architectures.formats.fp8`) -----------------------------------------------------

def _fp8_pair(tmp_path_factory: pytest.TempPathFactory, source: Path, name: str, block: tuple[int, int],
              shard_bytes: int | None) -> tuple[Path, Path]:
    """(`source` quantized as the FP8 releases are, a float checkpoint of what it dequantizes to): the second is
    `transformers`' reference for the first. Its weights are computed here from the stored FP8 values and scales,
    block by block, not by the engine's dequantizer."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mbridge_epoverlap.serving.model.architectures.formats.fp8 import quantize_checkpoint

    quantized = tmp_path_factory.mktemp(f"{name}_fp8")
    quantize_checkpoint(source, quantized, block=block, max_shard_bytes=shard_bytes)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(quantized.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({n: handle.get_tensor(n) for n in handle.keys()})  # noqa: SIM118
    floats = {}
    for n, t in tensors.items():
        if n.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[n + "_scale_inv"].repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            t = t.float() * scale[:t.shape[0], :t.shape[1]]
        floats[n] = t.contiguous()
    reference = Path(shutil.copytree(source, tmp_path_factory.mktemp(f"{name}_dequantized"), dirs_exist_ok=True))
    save_file(floats, str(reference / "model.safetensors"), metadata={"format": "pt"})
    return quantized, reference


@pytest.fixture(scope="session")
def tiny_deepseek_v3_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny DeepSeek-V3 (`deepseek_v3_config`, experts 32 wide so that decode reads them as FP8 tiles) in FP8
    blocks of [16, 16] (partial last blocks: 24, 40 and 80 rows), in shards of at most 16 KiB with an index:
    (FP8 checkpoint, its dequantized fp32 twin)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(2236)
    config = deepseek_v3_config(16)
    config.moe_intermediate_size = 32
    model = DeepseekV3ForCausalLM(config).eval()
    _draw_vectors(model)
    _draw_correction_bias(model)
    source = _save(model, tmp_path_factory.mktemp("tiny_deepseek_v3_wide_experts"))
    return _fp8_pair(tmp_path_factory, source, "deepseek_v3", (16, 16), 16384)


@pytest.fixture(scope="session")
def tiny_glm4_moe_fp8(tmp_path_factory: pytest.TempPathFactory, tiny_glm4_moe_dir: Path) -> tuple[Path, Path]:
    """The tiny GLM-4.5 in FP8 blocks of [128, 128] as released (every weight one partial block), one file."""
    return _fp8_pair(tmp_path_factory, tiny_glm4_moe_dir, "glm4_moe", (128, 128), None)


# --- DeepSeek-V4: compressed attention, hyper-connections, hash routing --------------------------------------------

V4_TOPK = 2  # pooled entries each query of the compressed sparse attention layer reads: fewer than a long prompt has


def deepseek_v4_config(**changes: object):
    """A tiny `DeepseekV4Config`: 3 layers (compressed sparse attention pooling every 4 tokens with an indexer of 4
    heads of 12 choosing `V4_TOPK`, heavily compressed attention pooling every 8, sliding window alone), a window of
    8, 4 heads of 16 of which the last 8 dimensions turn, a 16-wide query bottleneck, 2 output groups of 8, 3 residual
    streams, 8 experts top-2 (the first layer hash-routed) with a SwiGLU clamped at 0.6 and a shared expert."""
    from transformers import DeepseekV4Config

    sizes = dict(vocab_size=TINY_VOCAB, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5,
                 num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5,
                 layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
                 mlp_layer_types=["hash_moe", "moe", "moe"],
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=3,
                 sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=4, index_head_dim=12, index_topk=V4_TOPK,
                 swiglu_limit=0.6, initializer_range=INIT_STD, max_position_embeddings=256, bos_token_id=None,
                 eos_token_id=3)
    return DeepseekV4Config(**{**sizes, **changes})


def _draw_v4(model, seed: int) -> None:
    """What transformers leaves at 0 or 1 drawn too: norm weights ~ 1 + N(0, INIT_STD); sinks, position biases and
    the streams' biases ~ N(0, 0.5); the streams' scales ~ U(0.5, 1.5); correction biases ~ N(0, 0.5); each token
    id's hash experts two distinct random ones."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.split(".")[-1]
            if "norm" in name.split(".")[-2]:
                param.normal_(1.0, INIT_STD)
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                param.normal_(0.0, 0.5)
            elif leaf in ("scale", "hc_scale"):
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
            elif name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                buffer.copy_(torch.stack([torch.randperm(experts, generator=generator)[:buffer.shape[1]]
                                          for _ in range(buffer.shape[0])]))


@pytest.fixture(scope="session")
def tiny_deepseek_v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`DeepseekV4ForCausalLM` (`deepseek_v4_config`)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(4096)
    model = DeepseekV4ForCausalLM(deepseek_v4_config()).eval()
    _draw_v4(model, 4097)
    return _save(model, tmp_path_factory.mktemp("tiny_deepseek_v4"))
