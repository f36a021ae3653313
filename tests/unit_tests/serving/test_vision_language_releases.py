"""The released checkpoints of Qwen3.5-MoE and Llama 4 are vision-language models (`...ForConditionalGeneration`):
the text model's config under `text_config`, its tensors under another prefix (`model.language_model.`,
`language_model.`), a vision tower beside it. The engine serves their language model on text prompts through the
architecture's prefix map (`Architecture.tensor_prefixes`), reading no vision tensor.

On the tiny text checkpoints of the serving fixtures repackaged as their families release them: the spec is the
text checkpoint's, greedy tokens equal `transformers`' vision-language model's `generate` on text (reference model
and disaggregated engine), and a release without its `text_config` is refused before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from mbridge_epoverlap.serving.model.checkpoint import load_spec, stored_name
from mbridge_epoverlap.serving.model.hf_layout import all_sources
from mbridge_epoverlap.serving.model.parts import generate_reference
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, requests_of

MAX_NEW = 6
RELEASES = {"qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "llama4": "Llama4ForConditionalGeneration"}


def _hf_generate(directory, prompts, max_new):
    import torch
    import transformers

    cls = getattr(transformers, json.loads((directory / "config.json").read_text())["architectures"][0])
    model = cls.from_pretrained(directory, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=0)[0,
                                                                                                          len(p):].tolist()
                for p in prompts]


@pytest.mark.parametrize("family", RELEASES)
def test_the_release_reads_as_its_text_model(family, request) -> None:
    text, release = (request.getfixturevalue(f"tiny_{family}{suffix}_dir") for suffix in ("", "_vl"))
    ours, theirs = load_spec(release), load_spec(text)
    assert ours.architecture == RELEASES[family] and ours.tensor_prefixes
    # every tensor read is the language model's, under the release's prefix; none of the vision tower's
    read = {stored_name(name, ours.tensor_prefixes) for source in all_sources(ours) for name, _ in source.parts}
    language = (*(stored for _, stored in ours.tensor_prefixes), "lm_head.")  # Qwen3.5 keeps its head at the top
    assert read and all(name.startswith(language) for name in read)
    same = {f.name for f in dataclasses.fields(ours)} - {"architecture", "source", "tensor_files", "tensor_prefixes"}
    assert {f: getattr(ours, f) for f in same} == {f: getattr(theirs, f) for f in same}


@pytest.mark.parametrize("family", RELEASES)
def test_greedy_tokens_equal_transformers_vision_language_model(family, request, prompts) -> None:
    release = request.getfixturevalue(f"tiny_{family}_vl_dir")
    expected = _hf_generate(release, prompts, MAX_NEW)
    assert generate_reference(load_spec(release), prompts, MAX_NEW) == expected
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine

    plan = make_plan(load_spec(release), requests_of(prompts), max_new_tokens=MAX_NEW, timeout_s=30,
                     micro_batches=2, expert_workers=2)
    assert [c["output_ids"] for c in run_engine(plan)["completions"]] == expected


def test_a_release_without_its_text_config_is_refused(tiny_llama4_vl_dir, tmp_path) -> None:
    directory = tmp_path / "no_text_config"
    directory.mkdir()
    config = json.loads((tiny_llama4_vl_dir / "config.json").read_text())
    del config["text_config"]
    (directory / "config.json").write_text(json.dumps(config))
    assert_refused_before_weights(directory, ["'text_config'", "Llama4ForConditionalGeneration"], tmp_path)
