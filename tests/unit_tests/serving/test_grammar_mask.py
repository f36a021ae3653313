"""`GrammarState.mask` forbids exactly the tokens llguidance's bitmask forbids, on every instruction set (the
numerics reruns run it with the CPU libraries held to each): the bits read one by one in Python are the truth."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.serving.decoding.grammar import JSON_SCHEMA, Grammars

VOCAB = 400  # past the tokenizer's 384: the model's extra rows are never allowed


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Grammars:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(Path(sysconfig.get_paths()["stdlib"]) / "abc.py")],
                    trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = tmp_path_factory.mktemp("grammar") / "tokenizer.json"
    tokenizer.save(str(path))
    return Grammars(path, VOCAB, (2,))


@pytest.mark.numerics
def test_the_mask_forbids_exactly_what_the_bitmask_forbids(grammars):
    schema = json.dumps({"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
                         "additionalProperties": False})
    state = grammars.state(JSON_SCHEMA, schema)
    gen = torch.Generator().manual_seed(3)
    for _ in range(12):  # through the object to its end (then only the end-of-sequence token)
        row = state.mask(torch.randn(VOCAB, generator=gen))
        words = state.bitmask[0].tolist()
        truth = [(words[t // 32] >> (t % 32)) & 1 == 1 for t in range(VOCAB)]
        assert torch.isfinite(row).tolist() == truth
        assert 0 < sum(truth) < VOCAB
        token = int(torch.argmax(row))
        if token == 2:
            break
        state.accept(token)
    assert token == 2
