"""Helpers of the serving tests: requests from prompts, the engine's tokens in a layout (and with an expert worker
lost), what a run left behind, the reference model's prefill logits beside `transformers`', and a checkpoint's
config alone, edited, refused before any weight is read."""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

from mbridge_epoverlap.serving.workers.requests import Request


def requests_of(prompts):
    """One request per prompt, ids p0, p1, ..."""
    return [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]


def engine_tokens(directory, prompts, max_new_tokens, **layout):
    """The disaggregated engine's greedy tokens for `prompts` on the checkpoint in `directory`, in the layout
    `make_plan` takes as keywords; every completion must end "ok"."""
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    plan = make_plan(load_spec(directory), requests_of(prompts), max_new_tokens=max_new_tokens, timeout_s=30,
                     **layout)
    completions = run_engine(plan)["completions"]
    assert all(c["status"] == "ok" for c in completions), [c["status"] for c in completions]
    return [c["output_ids"] for c in completions]


def tokens_after_a_lost_expert_worker(directory, prompts, max_new_tokens, *, kill_step=3):
    """Elastic serving's greedy tokens with expert worker 0 of 4 (m = 2, 4 redundant experts) SIGKILLed at decode
    step `kill_step`: the loss must be seen, no request fail, and no process or shared-memory segment be left."""
    from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    plan = make_plan(load_spec(directory), requests_of(prompts), expert_workers=4, micro_batches=2,
                     max_new_tokens=max_new_tokens, timeout_s=20)
    plan = make_elastic(plan, redundant=4, kill=1, kill_step=kill_step)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert result["elastic"]["lost_workers"] == [0] and result["failed_requests"] == []
    assert leftovers(pids) == ([], [])
    return [c["output_ids"] for c in result["completions"]]


def leftovers(pids):
    """(processes among `pids` still alive, shared-memory segments they created that still exist)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive, [p for pid in pids for p in glob.glob(f"/dev/shm/mbe-m2n-{pid}-*")]


def prefill_logits(directory, prompt: list[int], dtype: str, *, reference=None):
    """(the reference model's, `transformers`' eager) logits of one prompt's prefill in `dtype`; `transformers`
    loads `reference` where given (the same weights stored otherwise), else `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    from mbridge_epoverlap.serving.model.batch import TokenBatch
    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from mbridge_epoverlap.serving.model.kv_cache import KVCache
    from mbridge_epoverlap.serving.model.parts import LocalModel, load_attention_part, load_expert_part

    hf = AutoModelForCausalLM.from_pretrained(reference or directory, attn_implementation="eager",
                                              experts_implementation="eager", dtype=getattr(torch, dtype)).eval()
    spec = load_spec(directory, dtype=dtype)
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, range(spec.num_experts))])
    cache = KVCache.for_spec(spec)
    cache.add(0)
    x = model.forward(TokenBatch.from_chunks([(0, prompt, 0)]), cache)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    return model.attention.logits(x), expected


def config_variant(source: Path, directory: Path, **changes: object) -> Path:
    """A copy of the checkpoint at `directory` with config.json fields changed (the weights the same)."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def config_only(source: Path, tmp_path: Path, **changes: object) -> Path:
    """The checkpoint's config.json with `changes` (`a.b`: field b of the object a), and no weights: a refusal
    here came before any was read."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        *outer, last = key.split(".")
        target = config
        for name in outer:
            target = target[name]
        target[last] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def assert_refused_before_weights(directory: Path, named: list[str], tmp_path: Path) -> None:
    """`load_spec` refuses `directory` naming its config.json and every string of `named`, and `serve` on it
    exits 2."""
    import pytest

    from mbridge_epoverlap.cli import main
    from mbridge_epoverlap.errors import UsageError
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    with pytest.raises(UsageError) as info:
        load_spec(directory)
    message = str(info.value)
    assert str(directory / "config.json") in message
    assert all(n in message for n in named), message
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt_ids": [1, 2]}) + "\n")
    assert main(["serve", "--checkpoint", str(directory), "--prompts", str(prompts)]) == 2
