"""Loading model specs: checkpoint validation (every bad input named by file and field), recipe models,
parts that read only their own tensors, and the optional tokenizer."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model import checkpoint as checkpoint_module
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.parts import (
    ExpertPart,
    generate_reference,
    load_attention_part,
    load_expert_part,
)
from mbridge_epoverlap.serving.model.tokenizer import load_tokenizer, require_tokenizer


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def _edit_config(directory: Path, **changes: object) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


_DROP = object()


def _rewrite_tensors(directory: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _raises(source: Path | str, first: str, *needles: str) -> str:
    """load_spec(source) raises a UsageError whose message names `first` and every one of `needles`."""
    import re

    with pytest.raises(UsageError, match=re.escape(first)) as info:
        load_spec(source)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# --- checkpoint validation --------------------------------------------------------------------------

def test_spec_reads_the_semantics_of_each_architecture(tiny_mixtral_dir, tiny_qwen3_moe_dir) -> None:
    mixtral, qwen = load_spec(tiny_mixtral_dir), load_spec(tiny_qwen3_moe_dir)
    assert (mixtral.architecture, mixtral.qk_norm, mixtral.norm_topk_prob, mixtral.sliding_window) == (
        "MixtralForCausalLM", False, True, None)
    assert (mixtral.rope_theta, mixtral.norm_eps, mixtral.head_dim, mixtral.eos_token_ids) == (10000.0, 1e-5, 8, (2,))
    assert (qwen.qk_norm, qwen.norm_topk_prob, qwen.tie_word_embeddings, qwen.head_dim) == (True, False, True, 16)
    assert qwen.moe_layers == (True, False, True) and (qwen.dense_ffn, qwen.expert_ffn) == (64, 24)
    assert pickle.loads(pickle.dumps(qwen)) == qwen


def test_missing_config(tiny_mixtral_dir, tmp_path) -> None:
    directory = _copy(tiny_mixtral_dir, tmp_path)
    (directory / "config.json").unlink()
    _raises(directory, str(directory / "config.json"), "missing")


def test_malformed_config(tiny_mixtral_dir, tmp_path) -> None:
    directory = _copy(tiny_mixtral_dir, tmp_path)
    (directory / "config.json").write_text('{"architectures": ["MixtralForCausalLM"], "hidden_size": 32,,}')
    _raises(directory, str(directory / "config.json"), "not valid JSON", "line 1")


def test_unknown_architecture(tiny_mixtral_dir, tmp_path) -> None:
    path = _edit_config(_copy(tiny_mixtral_dir, tmp_path), architectures=["LlamaForCausalLM"])
    _raises(path.parent, str(path), "'architectures'", "LlamaForCausalLM", "Qwen3MoeForCausalLM")


@pytest.mark.parametrize(("changes", "field"), [
    ({"hidden_size": _DROP}, "'hidden_size'"),
    ({"num_local_experts": _DROP}, "'num_local_experts' (or 'num_experts')"),
    ({"num_experts_per_tok": "two"}, "'num_experts_per_tok'"),
    ({"num_experts_per_tok": 5}, "'num_experts_per_tok'"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads'"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps'"),
    ({"hidden_act": "gelu"}, "'hidden_act'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "'rope_parameters.rope_type'"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings'"),
])
def test_bad_mixtral_field(tiny_mixtral_dir, tmp_path, changes, field) -> None:
    path = _edit_config(_copy(tiny_mixtral_dir, tmp_path), **changes)
    _raises(path.parent, str(path), field)


@pytest.mark.parametrize(("changes", "field"), [
    ({"mlp_only_layers": [5]}, "'mlp_only_layers'"),
    ({"attention_bias": True}, "'attention_bias'"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step'"),
    ({"num_experts": 4}, "'num_experts'"),  # disagrees with num_local_experts
])
def test_bad_qwen3_field(tiny_qwen3_moe_dir, tmp_path, changes, field) -> None:
    path = _edit_config(_copy(tiny_qwen3_moe_dir, tmp_path), **changes)
    _raises(path.parent, str(path), field)


def test_directory_without_safetensors(tiny_mixtral_dir, tmp_path) -> None:
    directory = _copy(tiny_mixtral_dir, tmp_path)
    (directory / "model.safetensors").unlink()
    _raises(directory, str(directory), "no *.safetensors")


def test_unreadable_safetensors(tiny_mixtral_dir, tmp_path) -> None:
    directory = _copy(tiny_mixtral_dir, tmp_path)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    _raises(directory, str(directory / "model.safetensors"), "not a readable safetensors file")


def test_missing_tensor(tiny_mixtral_dir, tmp_path) -> None:
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    directory = _copy(tiny_mixtral_dir, tmp_path)
    _rewrite_tensors(directory, lambda tensors: tensors.pop(name))
    _raises(directory, str(directory), name, "lack 1 tensor")


def test_untied_head_needs_lm_head(tiny_qwen3_moe_dir, tmp_path) -> None:
    path = _edit_config(_copy(tiny_qwen3_moe_dir, tmp_path), tie_word_embeddings=False)
    _raises(path.parent, str(path.parent), "lm_head.weight")


def test_mismatched_shape(tiny_mixtral_dir, tmp_path) -> None:
    directory = _copy(tiny_mixtral_dir, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    file = _rewrite_tensors(directory, lambda tensors: tensors.update({name: torch.zeros(8, 32)}))
    _raises(directory, str(file), name, "[8, 32]", "[16, 32]", "'num_key_value_heads'")


def test_config_sizes_that_disagree_with_the_tensors(tiny_mixtral_dir, tmp_path) -> None:
    path = _edit_config(_copy(tiny_mixtral_dir, tmp_path), intermediate_size=50)
    _raises(path.parent, str(path.parent / "model.safetensors"), "experts.0.w1.weight", "[48, 32]", "[50, 32]",
            "'intermediate_size'")


def test_neither_directory_nor_recipe(tmp_path) -> None:
    _raises(str(tmp_path / "nowhere"), "nowhere", "neither a checkpoint directory nor a recipe", "qwen3_30b_a3b")
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    _raises(file, str(file), "is a file")


# --- parts read only their tensors ------------------------------------------------------------------

def test_parts_read_only_their_own_tensors(tiny_qwen3_moe_dir, monkeypatch) -> None:
    spec = load_spec(tiny_qwen3_moe_dir)
    read: list[str] = []
    original = checkpoint_module.CheckpointReader.get

    def spy(self, name):
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(checkpoint_module.CheckpointReader, "get", spy)
    load_expert_part(spec, [5, 2])
    assert read and all(".experts.5." in n or ".experts.2." in n for n in read)
    assert {n.split(".")[2] for n in read} == {"0", "2"}  # the two MoE layers, not the dense one
    read.clear()
    load_attention_part(spec)
    assert read and not any(".experts." in n for n in read)


def test_expert_part_rejects_experts_it_does_not_hold(tiny_mixtral_dir) -> None:
    spec = load_spec(tiny_mixtral_dir)
    part = load_expert_part(spec, [1, 2])
    with pytest.raises(ValueError, match=r"experts \[3\] are not in this part"):
        part(0, torch.zeros(2, spec.hidden_size), torch.tensor([1, 3]))
    with pytest.raises(UsageError, match="distinct"):
        ExpertPart(spec, [1, 1])


# --- recipe models ----------------------------------------------------------------------------------

def test_recipe_models_are_shrunk_seeded_and_split_like_checkpoints() -> None:
    spec = load_spec("qwen3_30b_a3b", num_layers=1)
    assert (spec.architecture, spec.qk_norm, spec.top_k, spec.num_layers) == ("recipe", True, 8, 1)
    assert spec.num_experts % spec.top_k == 0 and spec.rope_theta == 1e6
    prompts = [[1, 2, 3], [200, 7]]
    tokens = generate_reference(spec, prompts, 4)
    assert tokens == generate_reference(spec, prompts, 4, expert_groups=[
        range(0, spec.num_experts, 2), range(1, spec.num_experts, 2)])
    assert tokens != generate_reference(load_spec("qwen3_30b_a3b", num_layers=1, seed=1), prompts, 4)
    assert all(len(t) == 4 for t in tokens)


def test_recipe_with_dense_prefix_and_shared_expert() -> None:
    spec = load_spec("deepseek_v3", num_layers=1)
    assert spec.moe_layers == (False, True) and spec.shared_expert_ffn > 0 and spec.dense_ffn > 0
    assert len(generate_reference(spec, [[5, 6, 7]], 3)[0]) == 3


def test_recipe_rejects_a_layer_override_for_a_checkpoint(tiny_mixtral_dir) -> None:
    with pytest.raises(UsageError, match="layer override"):
        load_spec(tiny_mixtral_dir, num_layers=3)


# --- tokenizer --------------------------------------------------------------------------------------

def test_tokenizer_json_gives_text_prompts(tiny_mixtral_dir, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = _copy(tiny_mixtral_dir, tmp_path)
    words = ["<unk>", "<s>", "</s>", "hello", "world", "experts", "serve"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))

    spec = load_spec(directory)
    loaded = load_tokenizer(spec)
    assert loaded is not None
    ids = loaded.encode("hello experts world")
    assert ids == [3, 5, 4] and loaded.decode(ids) == "hello experts world"
    assert len(generate_reference(spec, [ids], 2)[0]) == 2

    assert load_tokenizer(load_spec(tiny_mixtral_dir)) is None
    with pytest.raises(UsageError, match="prompt_ids"):
        require_tokenizer(load_spec(tiny_mixtral_dir))
    (directory / "tokenizer.json").write_text("{broken")
    with pytest.raises(UsageError, match="tokenizer.json"):
        load_tokenizer(spec)


def test_sharded_checkpoint_loads_across_files(tiny_mixtral_dir, tmp_path, prompts) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir).save_pretrained(sharded, max_shard_size="40KB")
    spec = load_spec(sharded)
    assert len(set(spec.file_of().values())) > 1
    assert generate_reference(spec, prompts, 6) == generate_reference(load_spec(tiny_mixtral_dir), prompts, 6)


def test_transformers_4_config_layout_reads_the_same(tiny_qwen3_moe_dir, tmp_path) -> None:
    """Published checkpoints (saved by transformers 4.x) keep `rope_theta` at the top level with
    `rope_scaling: null`, and Qwen3-MoE names its expert count `num_experts`."""
    directory = _copy(tiny_qwen3_moe_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.update(rope_theta=theta, rope_scaling=None, num_experts=config.pop("num_local_experts"))
    (directory / "config.json").write_text(json.dumps(config))
    legacy, current = load_spec(directory), load_spec(tiny_qwen3_moe_dir)
    assert (legacy.rope_theta, legacy.num_experts) == (current.rope_theta, current.num_experts) == (theta, 8)
    assert legacy == dataclasses.replace(current, source=legacy.source)
    (directory / "generation_config.json").unlink()
    _edit_config(directory, eos_token_id=[3, 5])
    assert load_spec(directory).eos_token_ids == (3, 5)  # without generation_config.json, config.json's
    _edit_config(directory, eos_token_id="end")
    _raises(directory, str(directory / "config.json"), "'eos_token_id'")
