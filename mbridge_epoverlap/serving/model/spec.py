"""`ModelSpec`: everything a serving process needs to know to build its part of a MoE model.

A spec is small, frozen and picklable, so the engine can hand it to every worker process; each worker
then loads only its own tensors (`serving.model.parts.load_attention_part` / `load_expert_part`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class ModelSpec:
    """Shape and semantics of a decoder-only MoE model, and where its weights come from.

    Attributes:
        architecture: a `serving.model.architectures` name (`MixtralForCausalLM`, ...), or `recipe` (a shrunk
            random model).
        source: the checkpoint directory (absolute) or the recipe name.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size: transformer shape.
        num_experts, top_k, expert_ffn: routed experts per MoE layer, experts per token, expert FFN width.
        moe_layers: for each layer, whether it is a MoE layer (else a dense SwiGLU MLP of `dense_ffn`).
        dense_ffn: FFN width of the dense layers (0 when there are none).
        shared_expert_ffn: width of an always-on shared expert in MoE layers (0: none).
        shared_expert_gate: the shared expert's output is scaled by sigmoid(a [1, hidden] projection of its
            input) (Qwen2-MoE).
        qkv_bias: the q, k and v projections have biases (Qwen2-MoE).
        qk_norm: RMSNorm on queries and keys, before the rotary embedding.
        qk_norm_scope: "head" (one weight of head_dim, every head alike: Qwen3) or "projection" (over the whole
            q or k projection, one weight of heads x head_dim: OLMoE).
        normalization: "RMSNorm" or "LayerNorm"; norm_eps its epsilon (also of the q/k norms).
        norm_topk_prob: renormalise the k chosen router probabilities to sum to one.
        router_weights_in_dtype: the chosen probabilities are rounded to `dtype` before they weight the expert
            outputs (Qwen3-MoE); else they stay fp32 (Mixtral). Only bf16 tells the two apart.
        rope_theta: the rotary base.
        sliding_window: attend only to the last `sliding_window` positions (None: all).
        tie_word_embeddings: the output head is the embedding matrix.
        eos_token_ids: generation stops after any of these (empty: only the token limit stops it).
        dtype: parameter and activation dtype ("float32" or "bfloat16").
        seed: initialisation seed of a recipe model (unused for checkpoints).
        tensor_files: (tensor name, safetensors file name) for every tensor of a checkpoint.
    """

    architecture: str
    source: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_ffn: int
    moe_layers: tuple[bool, ...]
    dense_ffn: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    normalization: str = "RMSNorm"
    norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    router_weights_in_dtype: bool = False
    rope_theta: float = 10000.0
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    seed: int = 0
    tensor_files: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def is_checkpoint(self) -> bool:
        """Whether the weights come from a checkpoint directory (else from the seed)."""
        return self.architecture != "recipe"

    @property
    def moe_layer_ids(self) -> list[int]:
        """The MoE layers, ascending."""
        return [i for i, moe in enumerate(self.moe_layers) if moe]

    def is_moe(self, layer: int) -> bool:
        return self.moe_layers[layer]

    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def file_of(self) -> dict[str, str]:
        """Tensor name -> safetensors file name (relative to `source`)."""
        return dict(self.tensor_files)

    def describe(self) -> str:
        """One line for logs and command output."""
        moe = len(self.moe_layer_ids)
        return (f"{self.architecture} from {self.source}: {self.num_layers} layers ({moe} MoE), hidden "
                f"{self.hidden_size}, {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}, "
                f"{self.num_experts} experts top-{self.top_k} (FFN {self.expert_ffn}), vocab {self.vocab_size}, "
                f"{self.dtype}")
