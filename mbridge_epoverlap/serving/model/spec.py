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
class RopeScaling:
    """A scaled rope, the fields of a config's `rope_parameters`. `kind` "yarn" (`transformers`'
    `_compute_yarn_parameters` reads the same): interpolated frequencies `factor` times slower, blended into the
    original ones over the dimensions between the `beta_fast` and `beta_slow` rotation counts of
    `original_max_position_embeddings` (bounds floored / ceiled when `truncate`), cos and sin scaled by
    `attention_factor`. `kind` "llama3" (`_compute_llama3_parameters`): the frequencies whose wavelength exceeds
    original / `low_freq_factor` `factor` times slower, those shorter than original / `high_freq_factor` kept, a
    blend between (the YaRN fields then unused: beta 0, no truncation, attention factor 1)."""

    kind: str
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    truncate: bool
    attention_factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3 / GLM-4.5 routing (`moe.router.GroupedSigmoidRouter`): sigmoid scores, a per-expert correction
    bias added for the choice only, the experts split into `n_group` groups of which the `topk_group` best (by
    the sum of each group's two best scores) are eligible, top-k within those, the chosen scores renormalised
    when `norm_topk_prob`, then multiplied by `routed_scaling_factor`. `logits_in_model_dtype`: the router's product
    runs in the model dtype (MiniMax-M2), not fp32."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    logits_in_model_dtype: bool = False

    def check(self, num_experts: int, top_k: int) -> None:
        """The grouping can route: equal groups of at least two experts (a group ranks by its two best scores),
        `topk_group` of them holding at least `top_k` experts. Raises ValueError naming the sizes."""
        g, eligible = self.n_group, self.topk_group
        if g < 1 or num_experts % g or num_experts // g < 2:
            raise ValueError(f"{num_experts} experts cannot form {g} equal groups of at least 2 experts")
        if not 1 <= eligible <= g:
            raise ValueError(f"topk_group {eligible} must be between 1 and n_group {g}")
        if eligible * (num_experts // g) < top_k:
            raise ValueError(f"{eligible} groups of {num_experts // g} experts hold fewer than the {top_k} experts "
                             "each token needs")


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5; `latent.indexer`): per token `num_heads`
    small queries of `head_dim` (from the query bottleneck) and one key of `head_dim` (cached beside the latent);
    a query scores each earlier token as sum_h w_h * relu(q_h . k / sqrt(head_dim)) and attends only to the `topk`
    best. The first `qk_rope_head_dim` dimensions of its queries and keys turn, in pairs (x0, x1), ... when
    `rope_interleave` (GLM-5), else as two halves (DeepSeek-V3.2). `shared_layers`: the layers that reuse the
    selection of the indexed layer before them instead of running their own indexer (GLM-5's `indexer_types`)."""

    num_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool
    shared_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, `layers.MultiLatentAttention`): queries from `hidden` directly or
    through a `q_lora_rank` bottleneck; keys and values from one compressed latent of `kv_lora_rank` values per
    token plus a `qk_rope_head_dim` rotary key shared by every head; per head a query/key of
    `qk_nope_head_dim + qk_rope_head_dim` and a value of `v_head_dim`. `rope_interleave`: the rotary dimensions
    are pairs (x0, x1), (x2, x3), ... rather than two halves. `softmax_scale`: the scores' scale (1/sqrt of the
    query width, times YaRN's mscale squared where the config asks). `indexer`: DeepSeek Sparse Attention's, where each
    query attends only to the tokens it selects (None: every earlier token)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float
    indexer: SparseIndexer | None = None


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE; `linear.delta_net.GatedDeltaNetAttention`): per token,
    `num_key_heads` query and key heads of `key_head_dim` and `num_value_heads` value heads of `value_head_dim`
    (each query/key head serving num_value_heads / num_key_heads value heads), a causal depthwise convolution of
    `conv_kernel` taps over the concatenated q, k, v, and per value head a [key_head_dim, value_head_dim] state
    decayed and corrected by the gated delta rule. A sequence carries no keys or values, only that state and the
    convolution's last inputs (`linear.state_cache.StateCache`). `grouped`: the checkpoint's input projections hold,
    per key head, its q, its k, then the v and z of the value heads it serves (Qwen3-Next's `in_proj_qkvz` and
    `in_proj_ba`); else q, k, v, z, b and a each side by side over all heads (Qwen3.5's four projections)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    grouped: bool = True

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 layers (Nemotron-H; `linear.mamba2.Mamba2Mixer`): `num_heads` heads of `head_dim` channels, each with
    a [head_dim, state_size] state and a scalar decay; B and C of `state_size` shared by the heads of each of
    `n_groups` groups; a causal depthwise convolution of `conv_kernel` taps (with a bias when `conv_bias`) over x, B
    and C; the chunked scan in blocks of `chunk_size` with the time step clamped to `time_step_limit`; a gated
    RMSNorm over groups of channels; `proj_bias`: biases on the input and output projections."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def inner(self) -> int:
        """Channels of the scan: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class CompressedAttention:
    """DeepSeek-V4's attention and residual streams (`compressed`): per layer a sliding window of `sliding_window`
    positions over one shared key = value head, plus, where `layer_rates[i]` > 0, entries pooled from every
    `layer_rates[i]` tokens (overlapping windows and a lightning indexer choosing `index_topk` of them per query where
    `indexed[i]`: compressed sparse attention; non-overlapping, all seen: heavily compressed attention). Queries come
    through a `q_lora_rank` bottleneck; the trailing `rope_dim` of each head turn in interleaved pairs by
    `rope_theta` on sliding layers and `compress_rope_theta` on the others, and the output turns back; the heads'
    output goes through `o_groups` groups of `o_lora_rank`. The residual is `hc_mult` streams mixed by
    hyper-connections (`hc_sinkhorn_iters`, `hc_eps`). Router scores are `scoring` ("sqrtsoftplus" or "sigmoid")
    of the logits; `hash_layers` take their experts from a token-id table instead of the top-k. `rope_scaling` /
    `compress_rope_scaling`: YaRN on the main / compress rope (None: the default rope)."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_dim: int
    rope_theta: float
    compress_rope_theta: float
    sliding_window: int
    layer_rates: tuple[int, ...]
    indexed: tuple[bool, ...]
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[int, ...]
    scoring: str
    routed_scaling_factor: float
    rope_scaling: RopeScaling | None = None
    compress_rope_scaling: RopeScaling | None = None


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
        layer_windows: per layer, its own sliding window or None (GPT-OSS's `layer_types`); empty: every layer
            has `sliding_window`.
        attention_sinks: each query head has a learned logit (`attention.sinks` [heads]) that joins its softmax
            denominator and is then dropped, so a head may attend to nothing (GPT-OSS).
        attention_out_bias: the output projection has a bias (GPT-OSS; the q, k, v biases are `qkv_bias`).
        norm_round_after_weight: the norm weight multiplies the fp32 normalised input and the product is rounded
            to `dtype` (GPT-OSS); else the normalised input is rounded first and multiplied in `dtype`. Only bf16
            tells the two apart.
        router_bias: the router has a bias (`router.bias` [experts]).
        router_softmax_after_topk: the k largest router logits are chosen first and a softmax over those k
            (in the logits' dtype) gives the weights (GPT-OSS); else a softmax over all experts, then top-k.
        expert_bias: each expert's gate/up and down projections have biases (`b1` [2*ffn], `b2` [hidden]).
        expert_activation: "swiglu" (silu(gate) * up), "relu2" (relu(up)^2, experts without a gate projection:
            Nemotron-H) or "clamped_swiglu" (GPT-OSS: gate clamped above at
            `swiglu_limit`, up to +-`swiglu_limit`, then (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)) or
            "limited_swiglu" (DeepSeek-V4: the same clamps, then silu(gate) * up).
        swiglu_limit, swiglu_alpha: the clamped SwiGLU's clamp and sigmoid gain.
        expert_weights_in_out: `transformers` multiplies by the experts' weights stored [in, out] (GPT-OSS's fused
            `gate_up_proj` / `down_proj`); the reference model runs that product on an [in, out] copy, because
            an fp32 GEMM of a few rows rounds differently with the weight transposed (`docs/numerics.md`).
        rope_scaling: the rotary embedding's scaling (`RopeScaling`, YaRN) or None for the plain rope.
        expert_quantization: how the checkpoint stores the experts' weights: None (floats) or "mxfp4" (blocks and
            scales, dequantized when an expert is loaded: `serving.model.architectures.formats.mxfp4`).
        fp8_block: the checkpoint stores its projection weights as FP8 in blocks of [rows, columns] with a
            `weight_scale_inv` each (`architectures.formats.fp8`); they are dequantized as they are read. None: floats.
        clip_qkv: the q, k and v projections are clamped to [-clip_qkv, clip_qkv] (DBRX); None: not clamped.
        router_softmax_in_dtype: the softmax over all experts runs in the logits' dtype, not fp32 (DBRX); only
            bf16 tells the two apart.
        fused_qkv: `transformers` projects q, k and v with one GEMM (DBRX's `Wqkv`), so the reference model does
            too (a GEMM of a row or two rounds differently with fewer output columns).
        expert_gate_up_separate: `transformers` runs an expert's gate and up projections as two GEMMs (DBRX's
            `w1`, `v1`), so the reference model does too.
        topk_norm_p: the k chosen probabilities are divided by their p-norm (`torch.norm`, DBRX's
            `moe_normalize_expert_weights`) instead of `norm_topk_prob`'s sum; None: not this way.
        rotary_dim: the rotary embedding turns only the first `rotary_dim` dimensions of each query and key head
            (GLM-4.5's `partial_rotary_factor`); 0: the whole head (`rope_dim` reads it).
        grouped_routing: DeepSeek-V3 / GLM-4.5 routing (`GroupedRouting`) instead of a softmax; None: not so.
        mla: multi-head latent attention (`LatentAttention`, DeepSeek-V3) instead of q/k/v projections; None: not.
        linear_attention: the sizes of the gated DeltaNet layers of a hybrid model (`GatedDeltaNet`); None: none.
        linear_layers: for each layer, whether it is a gated DeltaNet layer (else softmax attention); empty: none.
        mamba: the sizes of the Mamba-2 layers of a hybrid model (`Mamba2`); None: none.
        mamba_layers: for each layer, whether its token mixer is a Mamba-2 layer; empty: none.
        blocks: for each layer, the checkpoint's (mixer block, MLP block) indices where its layers are single
            blocks (Nemotron-H's `layers_block_type`); -1: the layer has none (an MLP block after an MLP block makes
            a layer without a mixer, a mixer block after a mixer block one without an MLP); empty: layer i is block
            i, with both.
        mlp_activation: the dense MLPs' and shared experts' activation: "swiglu", or "relu2" (relu(up(x))^2, no gate
            projection: Nemotron-H).
        rope: whether attention turns queries and keys by a rotary embedding (Nemotron-H's attention has none).
        rope_layers: per layer, whether its attention turns queries and keys (Llama 4's `no_rope_layers`: its NoPE
            layers do not); empty: every layer as `rope` says (`rope_of` reads it).
        rope_pairs: the rotary embedding turns adjacent pairs (x0, x1), (x2, x3), ... as complex numbers (Llama 4)
            rather than the head's two halves.
        qk_l2_norm: on the layers that turn them, queries and keys are divided by their root mean square per head
            (no weight, the norm's epsilon), after the rotary embedding (Llama 4's `use_qk_norm`).
        attn_temperature: (floor_scale, attn_scale): on the layers without rope, the query at position p is
            multiplied by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 (Llama 4's
            `attn_temperature_tuning`); None: not.
        layer_chunks: per layer, its attention chunk or None (Llama 4's chunked attention): a query sees only the
            earlier keys of its own chunk of positions, floor(position / chunk) equal; empty: no layer is chunked
            (`chunk_of` reads it).
        router_sigmoid_after_topk: the k largest router logits (in the model dtype) are chosen, and each chosen
            expert's score is the sigmoid of its logit, taken in fp32 and rounded to the model dtype (Llama 4).
        router_scales_input: the router's score multiplies the expert's input, not its output (Llama 4: the
            attention side scales the rows it sends, `AttnOut.tokens`, and the outputs are added with weight 1).
        attention_output_gate: the q projection also yields a per-head gate; the attention output is multiplied by
            its sigmoid before the output projection (Qwen3-Next's full-attention layers).
        norm_zero_centred: every RMSNorm but the DeltaNet's gated one scales by (1 + weight), the product taken in
            fp32 and rounded once (Qwen3-Next's zero-centred RMSNorm).
        compressed: DeepSeek-V4's compressed attention, hyper-connections and routing (`CompressedAttention`);
            None: not that model.
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
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False
    attention_out_bias: bool = False
    norm_round_after_weight: bool = False
    router_bias: bool = False
    router_softmax_after_topk: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    expert_weights_in_out: bool = False
    rope_scaling: RopeScaling | None = None
    expert_quantization: str | None = None
    fp8_block: tuple[int, int] | None = None
    clip_qkv: float | None = None
    router_softmax_in_dtype: bool = False
    topk_norm_p: float | None = None
    fused_qkv: bool = False
    expert_gate_up_separate: bool = False
    rotary_dim: int = 0
    grouped_routing: GroupedRouting | None = None
    mla: LatentAttention | None = None
    linear_attention: GatedDeltaNet | None = None
    linear_layers: tuple[bool, ...] = ()
    mamba: Mamba2 | None = None
    mamba_layers: tuple[bool, ...] = ()
    blocks: tuple[tuple[int, int], ...] = ()
    mlp_activation: str = "swiglu"
    rope: bool = True
    rope_layers: tuple[bool, ...] = ()
    rope_pairs: bool = False
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    layer_chunks: tuple[int | None, ...] = ()
    router_sigmoid_after_topk: bool = False
    router_scales_input: bool = False
    attention_output_gate: bool = False
    norm_zero_centred: bool = False
    compressed: CompressedAttention | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    seed: int = 0
    tensor_files: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # (logical prefix, stored prefix) of the tensor names, where a checkpoint keeps the text model under another
    # prefix than the architecture reads (a vision-language release: `model.language_model.`)
    tensor_prefixes: tuple[tuple[str, str], ...] = ()

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

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a gated DeltaNet layer (its sequence state lives in a `StateCache`, not the KV cache)."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    def is_mamba(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is a Mamba-2 layer (its state lives in a `StateCache`)."""
        return bool(self.mamba_layers) and self.mamba_layers[layer]

    def has_mixer(self, layer: int) -> bool:
        return not self.blocks or self.blocks[layer][0] >= 0

    def has_ffn(self, layer: int) -> bool:
        return not self.blocks or self.blocks[layer][1] >= 0

    @property
    def expert_gated(self) -> bool:
        """Whether an expert has a gate projection beside its up projection (w1 holds both)."""
        return self.expert_activation != "relu2"

    @property
    def expert_w1_rows(self) -> int:
        """Rows of an expert's first weight w1: its gate and up projections, or the up projection alone."""
        return (2 if self.expert_gated else 1) * self.expert_ffn

    @property
    def linear_layer_ids(self) -> list[int]:
        """The gated DeltaNet layers, ascending."""
        return [i for i in range(self.num_layers) if self.is_linear(i)]

    @property
    def state_layer_ids(self) -> list[int]:
        """The layers that keep a state per sequence (gated DeltaNet and Mamba-2), ascending."""
        return [i for i in range(self.num_layers) if self.is_linear(i) or self.is_mamba(i)]

    @property
    def attention_layer_ids(self) -> list[int]:
        """The softmax-attention layers (the ones with keys and values in the KV cache), ascending."""
        return [i for i in range(self.num_layers)
                if self.has_mixer(i) and not self.is_linear(i) and not self.is_mamba(i)]

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of a query or key head the rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def chunk_of(self, layer: int) -> int | None:
        """The attention chunk of `layer` (None: its queries see keys across chunks)."""
        return self.layer_chunks[layer] if self.layer_chunks else None

    def rope_of(self, layer: int) -> bool:
        """Whether `layer`'s attention turns its queries and keys by the rotary embedding."""
        return self.rope_layers[layer] if self.rope_layers else self.rope

    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def file_of(self) -> dict[str, str]:
        """Tensor name -> safetensors file name (relative to `source`)."""
        return dict(self.tensor_files)

    def describe(self) -> str:
        """One line for logs and command output."""
        moe = len(self.moe_layer_ids)
        linear = f", {len(self.linear_layer_ids)} linear attention" if self.linear_layers else ""
        linear += f", {sum(self.mamba_layers)} Mamba-2" if self.mamba_layers else ""
        return (f"{self.architecture} from {self.source}: {self.num_layers} layers ({moe} MoE{linear}), hidden "
                f"{self.hidden_size}, {self.num_heads}/{self.num_kv_heads} heads x {self.head_dim}, "
                f"{self.num_experts} experts top-{self.top_k} (FFN {self.expert_ffn}), vocab {self.vocab_size}, "
                f"{self.dtype}")
