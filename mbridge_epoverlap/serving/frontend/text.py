"""Text in and out of the server: the checkpoint's tokenizer, its chat template, and text that streams.

- `TextCodec`: encodes prompts as the batch `serve` does (the tokenizer's post-processor adds BOS and the
  like), decodes generated ids without special tokens, and renders the chat template the way `transformers`'
  `apply_chat_template` does (Jinja2 in a sandbox with `trim_blocks` and `lstrip_blocks`, the generation
  prompt added, the rendered text encoded without special tokens), so a chat prompt is the same ids.
- `TextStream`: one request's text as its tokens arrive: each new token gives the text that can be sent now,
  holding back an unfinished UTF-8 character and anything that could still become a stop string; a stop
  string ends the text just before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"


class NoTokenizer(ValueError):
    """The checkpoint has no tokenizer (text prompts need one), or no chat template (chat needs one)."""


class TextCodec:
    """The checkpoint's tokenizer (`tokenizer.json`) and chat template, if it has them.

    Args:
        directory: the checkpoint directory, or None (a recipe model: token ids only).
    """

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._tokenizer: Any = None
        self.template: str | None = None
        self.special: dict[str, str] = {}
        if self.directory is None or not (self.directory / TOKENIZER_FILE).is_file():
            return
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(self.directory / TOKENIZER_FILE))
        config: dict[str, Any] = {}
        if (self.directory / CONFIG_FILE).is_file():
            config = json.loads((self.directory / CONFIG_FILE).read_text())
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self.special[name] = value
        if (self.directory / TEMPLATE_FILE).is_file():
            self.template = (self.directory / TEMPLATE_FILE).read_text()
        elif isinstance(config.get("chat_template"), str):
            self.template = config["chat_template"]

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise NoTokenizer(f"{self.directory or 'this model'} has no {TOKENIZER_FILE}: give the prompt as "
                              "token ids")
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens kept (`token_id:N` without a tokenizer, as vLLM writes it)."""
        if self._tokenizer is None:
            return f"token_id:{token}"
        return self._tokenizer.decode([token], skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The ids of `messages` (and the `tools` the template may describe) through the chat template with the
        generation prompt.

        Raises:
            NoTokenizer: no tokenizer or no chat template.
        """
        if self.template is None:
            raise NoTokenizer(f"{self.directory or 'this model'} has no chat template ({TEMPLATE_FILE} or "
                              f"\"chat_template\" in {CONFIG_FILE}); use /v1/completions")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.template).render(messages=messages, tools=tools, add_generation_prompt=True,
                                                     **self.special)
        return self.encode(text, special=False)


class TextStream:
    """One request's text as its tokens arrive (see the module docstring).

    Args:
        codec: decodes the ids.
        stops: stop strings; the text ends before the first one found.
    """

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.codec, self.stops = codec, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already given out
        self.stopped = False
        self._end = 0  # where the text ends once stopped
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, token: int) -> str:
        """Take a new token; return the text that can be sent now ("" if none). Sets `stopped` on a stop string."""
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        found = [at for stop in self.stops if (at := text.find(stop)) >= 0]
        if found and not self.stopped:
            self.stopped, self._end = True, min(found)
        if self.stopped:
            return self._give(text[:self._end])
        safe = len(text) - self._hold
        while safe > self.sent and text[safe - 1] == "\ufffd":  # an unfinished character may still complete
            safe -= 1
        return self._give(text[:max(safe, self.sent)])

    def finish(self) -> str:
        """The held-back rest, once the request finished without a stop string."""
        if self.stopped:
            return ""
        return self._give(self.codec.decode(self.ids))

    @property
    def text(self) -> str:
        text = self.codec.decode(self.ids)
        return text[:self._end] if self.stopped else text

    def _give(self, text: str) -> str:
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
