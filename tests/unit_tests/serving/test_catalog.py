"""GPU and model catalogs."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning.catalog import GPUS, MODELS, get_gpu, get_model

REQUIRED_GPUS = {"A100-80G", "H100", "H200", "H20", "L40S", "B200", "B300", "GB200"}
REQUIRED_MODELS = {"Mixtral-8x22B", "DBRX", "Scaled-MoE", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3"}


def test_catalogs_cover_the_required_entries():
    assert REQUIRED_GPUS <= set(GPUS)
    assert REQUIRED_MODELS <= set(MODELS)


@pytest.mark.parametrize("name", sorted(REQUIRED_MODELS))
def test_model_shapes_add_up_to_the_published_size(name):
    model = MODELS[name]
    assert model.total_params / 1e9 == pytest.approx(model.published_params_b, rel=0.01)
    assert model.source


def test_paper_models_match_megascale_infer_table():
    shapes = {
        n: (MODELS[n].layers, MODELS[n].experts, MODELS[n].top_k) for n in ("Mixtral-8x22B", "DBRX", "Scaled-MoE")
    }
    assert shapes == {"Mixtral-8x22B": (56, 8, 2), "DBRX": (40, 16, 4), "Scaled-MoE": (48, 32, 4)}


def test_kv_cache_per_token_matches_the_gqa_formula():
    # 2 (K and V) * kv_heads * head_dim elements, i.e. 2*h/g with g the GQA group size.
    mixtral = MODELS["Mixtral-8x22B"]
    group = mixtral.heads // mixtral.kv_heads
    assert mixtral.kv_elems_per_token == 2 * mixtral.hidden // group
    # MLA caches the latent plus the rope key.
    assert MODELS["DeepSeek-V3"].kv_elems_per_token == 512 + 64


def test_gpu_figures_are_positive_and_consistent():
    for gpu in GPUS.values():
        assert min(gpu.tflops_bf16, gpu.hbm_tbs, gpu.hbm_gb, gpu.nic_gbps, gpu.scale_up_gbs, gpu.price) > 0
        assert gpu.scale_up in {"nvlink", "pcie"}
    # The heterogeneous pair of the paper: H20 is memory-rich, L40S compute-rich per cost.
    h20, l40s = GPUS["H20"], GPUS["L40S"]
    assert h20.hbm_tbs / h20.price > l40s.hbm_tbs / l40s.price
    assert l40s.tflops_bf16 / l40s.price > h20.tflops_bf16 / h20.price


def test_lookups_are_case_insensitive_and_prices_overridable():
    assert get_model("dbrx").name == "DBRX"
    assert get_gpu("h20").name == "H20"
    assert get_gpu("H20", prices={"h20": 2.5}).price == 2.5


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UsageError, match="known: .*Mixtral-8x22B.*DeepSeek-V3"):
        get_model("GPT-5")
    with pytest.raises(UsageError, match=r"did you mean H20\?.*known: .*L40S"):
        get_gpu("H2O")


def test_nonpositive_price_is_a_usage_error():
    with pytest.raises(UsageError, match="--price H20="):
        get_gpu("H20", prices={"H20": 0.0})
