"""A tiny Mixtral checkpoint with a tokenizer and a chat template, and a real server on it for the front-end tests.

- `chat_mixtral_dir`: `MixtralForCausalLM` (2 layers, 4 experts top-2, 256 positions) beside a byte-level BPE
  trained with `tokenizers` on some of the standard library's modules, saved with `transformers`'
  `PreTrainedTokenizerFast.save_pretrained` with a chat template.
- `plain_mixtral_dir`: the same weights and tokenizer without a chat template.
- `ServerProcess` / `start_server`: `mbridge-epoverlap serve --http 127.0.0.1:PORT` in a subprocess, ready once
  it printed its ready line (bounded wait), always stopped by its fixture (SIGTERM, then SIGKILL).
- `server`: one server on `chat_mixtral_dir` shared by a test module.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import pytest

from mbridge_epoverlap.launch.signals import stop_gracefully

REPO = Path(__file__).resolve().parents[4]
VOCAB = 384
CONTEXT = 256
MODEL_NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CORPUS = ("abc.py", "bisect.py", "colorsys.py", "contextlib.py", "dataclasses.py", "fnmatch.py", "functools.py",
          "heapq.py", "keyword.py", "numbers.py", "operator.py", "queue.py", "shlex.py", "textwrap.py")
READY_S = 120.0  # loading two tiny workers takes seconds; a loaded machine may take longer


def _tokenizer(directory: Path, *, chat: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # A fixed corpus (the standard library's own modules), not this package's sources: training on those made
    # every edit of them change the tokens, and so the texts the tests decode.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [str(stdlib / name) for name in CORPUS]
    tokenizer.train(sources, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


@pytest.fixture(scope="session")
def chat_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(2468)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=CONTEXT,
        initializer_range=0.1, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )
    directory = tmp_path_factory.mktemp("chat_mixtral")
    MixtralForCausalLM(config).eval().save_pretrained(directory)
    _tokenizer(directory, chat=True)
    return directory


@pytest.fixture(scope="session")
def plain_mixtral_dir(chat_mixtral_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("plain_mixtral")
    for path in chat_mixtral_dir.iterdir():
        shutil.copy(path, directory / path.name)
    _tokenizer(directory, chat=False)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A server given none of these measures its layout first (a few engine trial runs); the tests that are not about
# that choice run the layout given before it existed, 1 attention and 1 expert worker with m=2.
LAYOUT_FLAGS = ("--colocated", "--replicate-experts", "--attn-workers", "--expert-workers", "--micro-batches",
                "--threads", "--elastic", "--emulate-hosts")
FIXED_LAYOUT = ("--attn-workers", "1", "--expert-workers", "1", "--micro-batches", "2")


class ServerProcess:
    """`serve --http` in a subprocess; `url` once ready; `stop()` always leaves nothing running.

    Without a layout flag the server gets `FIXED_LAYOUT`, unless `choose_layout` (then `env` may point
    `XDG_CACHE_HOME` at a test's own directory: the choice is cached there)."""

    def __init__(self, checkpoint: Path, *flags: str, choose_layout: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(REPO), MBRIDGE_EPOVERLAP_API_KEY="", **(env or {}))
        if not choose_layout and not any(flag in LAYOUT_FLAGS for flag in flags):
            flags = (*FIXED_LAYOUT, *flags)
        command = [sys.executable, "-m", "mbridge_epoverlap.cli", "serve", "--checkpoint", str(checkpoint),
                   "--http", f"127.0.0.1:{self.port}", "--served-model-name", MODEL_NAME, *flags]
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.stderr: list[str] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            if "ready at http://" in line:
                self.ready.set()

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        if not self.ready.wait(timeout_s):
            self.stop()
            raise AssertionError("the server did not get ready:\n" + "".join(self.stderr))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5.0)
        return code

    def stop(self) -> None:
        stop_gracefully(self.proc, 60.0)


@pytest.fixture
def start_server(request: pytest.FixtureRequest):
    """Start servers that the test stops or that are stopped after it: `start_server(checkpoint, *flags)`."""
    started: list[ServerProcess] = []

    def start(checkpoint: Path, *flags: str, ready: bool = True, **options: Any) -> ServerProcess:
        server = ServerProcess(checkpoint, *flags, **options)
        started.append(server)
        if ready:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(chat_mixtral_dir: Path):
    """One server for a module's tests: 1 attention and 1 expert worker, 4 sequences at once, every expert's load
    in /metrics (`--expert-metrics full`)."""
    process = ServerProcess(chat_mixtral_dir, "--max-batch", "4", "--max-waiting", "64", "--timeout", "60",
                            "--expert-metrics", "full")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
