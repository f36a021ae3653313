"""The Hugging Face MoE architectures the serving engine loads, one module each, and their registry.

- `base`: `Architecture` (the shared checkpoint layout; a module overrides only what differs),
  `ConfigFields` (typed config.json reads) and `Source` (the tensors one parameter is built from).
- `mixtral`, `olmoe`, `dbrx`, `gpt_oss`, `glm4_moe`, `minimax_m2`, `nemotron_h`, `llama4` (Llama 4's text model),
  `deepseek` (DeepSeek-V3, DeepSeek-V3.2 and GLM-5, DeepSeek-V4) and `qwen` (Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
  Qwen3.5-MoE): one `Architecture` each: the config defaults, what its config.json means for the `ModelSpec`, and
  its tensor names (a family that extends another inherits from it: MiniMax-M2 from Mixtral, Qwen3-Next from Qwen2-MoE,
  Qwen3.5-MoE from Qwen3-Next, DeepSeek-V3.2 from DeepSeek-V3).
- `grouped_moe`: DeepSeek-V3's MoE layers as configs state them (grouped sigmoid routing, shared experts, dense
  first layers), read by GLM-4.5, DeepSeek-V3 and the families built on them.
- `rope`: the rotary settings every family's config states alike (the rotated part of a head, YaRN's parameters).
- `formats`: the quantized weight formats checkpoints store (`fp8`: FP8 block-scaled weights; `mxfp4`: GPT-OSS's
  MXFP4 experts), dequantized as they are read.

Adding an architecture is one module here, its entry in `_ARCHITECTURES` and its tests. The arithmetic is
not here: the spec's fields select the shared pieces of `serving.model.layers`.
"""

from __future__ import annotations

from mbridge_epoverlap.serving.model.architectures.base import Architecture
from mbridge_epoverlap.serving.model.architectures.dbrx import Dbrx
from mbridge_epoverlap.serving.model.architectures.deepseek.deepseek_v3 import DeepseekV3
from mbridge_epoverlap.serving.model.architectures.deepseek.deepseek_v4 import DeepseekV4
from mbridge_epoverlap.serving.model.architectures.deepseek.deepseek_v32 import DeepseekV32, GlmMoeDsa
from mbridge_epoverlap.serving.model.architectures.glm4_moe import Glm4Moe
from mbridge_epoverlap.serving.model.architectures.gpt_oss import GptOss
from mbridge_epoverlap.serving.model.architectures.llama4 import Llama4, Llama4Vision
from mbridge_epoverlap.serving.model.architectures.minimax_m2 import MiniMaxM2
from mbridge_epoverlap.serving.model.architectures.mixtral import Mixtral
from mbridge_epoverlap.serving.model.architectures.nemotron_h import NemotronH
from mbridge_epoverlap.serving.model.architectures.olmoe import Olmoe
from mbridge_epoverlap.serving.model.architectures.qwen.qwen2_moe import Qwen2Moe
from mbridge_epoverlap.serving.model.architectures.qwen.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeVision
from mbridge_epoverlap.serving.model.architectures.qwen.qwen3_moe import Qwen3Moe
from mbridge_epoverlap.serving.model.architectures.qwen.qwen3_next import Qwen3Next

_ARCHITECTURES: tuple[Architecture, ...] = (Mixtral(), Qwen3Moe(), Qwen2Moe(), Olmoe(), Dbrx(), GptOss(), Glm4Moe(),
                                              DeepseekV3(), Qwen3Next(), Qwen3_5Moe(), Qwen3_5MoeVision(), MiniMaxM2(),
                                              NemotronH(),
                                              DeepseekV32(), GlmMoeDsa(), Llama4(), Llama4Vision(), DeepseekV4())
REGISTRY: dict[str, Architecture] = {a.name: a for a in _ARCHITECTURES}
NAMES: tuple[str, ...] = tuple(REGISTRY)


def get(name: str) -> Architecture:
    """The architecture registered as `name` (a config.json `architectures` entry)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"architecture {name!r} is not supported; supported: {', '.join(NAMES)}") from None

