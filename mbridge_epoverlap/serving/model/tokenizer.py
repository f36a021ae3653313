"""Text prompts for checkpoints that ship a `tokenizer.json` (Hugging Face `tokenizers` format)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.spec import ModelSpec

TOKENIZER_FILE = "tokenizer.json"


class PromptTokenizer:
    """Encodes prompts (special tokens such as BOS added as the tokenizer's post-processor says) and decodes
    generated ids."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer: Any = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise UsageError(f"{path} is not a readable tokenizers file: {err}") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)


def load_tokenizer(spec: ModelSpec) -> PromptTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no `tokenizer.json` (or the model is a recipe)."""
    if not spec.is_checkpoint:
        return None
    path = Path(spec.source) / TOKENIZER_FILE
    return PromptTokenizer(path) if path.is_file() else None


def require_tokenizer(spec: ModelSpec) -> PromptTokenizer:
    """The checkpoint's tokenizer; a UsageError saying to give token ids when there is none."""
    tokenizer = load_tokenizer(spec)
    if tokenizer is None:
        where = (f"{spec.source} has no {TOKENIZER_FILE}" if spec.is_checkpoint
                 else f"recipe {spec.source} has no tokenizer")
        raise UsageError(f"{where}: give prompts as \"prompt_ids\": [int, ...] instead of \"prompt\" text")
    return tokenizer
