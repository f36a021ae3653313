"""Online serving: the project's OpenAI-compatible server (and vLLM's, given its venv) under the same client.

Builds a random checkpoint with a tokenizer (a byte-level BPE trained with `tokenizers` on the Python standard
library's sources, saved with `transformers` beside the weights, with a chat template): the 57M Mixtral (8 experts
top-2) or, with `--shape qwen3_moe`, a 108M Qwen3-MoE (64 experts top-8, expert FFN 256). It starts
`mbridge-epoverlap serve --http` on it and sends `--prompts` requests of `--input-len` random token ids,
`--output-len` tokens each with `ignore_eos`, all at once (`burst`), at each Poisson rate of `--rates`, and all at
once after a `--shared-prefix`-token prefix they share (a new one each round: automatic prefix caching prefills it
once), streaming. It prints output tokens/s, TTFT, TPOT and ITL (P50, P99) and the failed requests per case, with
the machine. `--kill-expert` adds a case on an elastic server (2 expert workers, redundant experts) whose
expert worker 0 is SIGKILLed once half the requests stream: failed requests and P99 ITL through the loss.

With `--vllm-python PATH` (a venv's python with vLLM's CPU build), vLLM's OpenAI server is started on the
same checkpoint (`python -m vllm.entrypoints.openai.api_server --dtype float32 --max-model-len 512
--max-num-seqs 64 --enforce-eager`, `VLLM_CPU_KVCACHE_SPACE=2`) and both servers are driven by vLLM's own
client (`vllm.benchmarks.serve`, random dataset, `--ignore-eos`) instead of the built-in one, side by side.

Both servers run at once and the client takes turns: after one unmeasured burst each, every round runs each
case on one server, then on the other (A B A B), for `--repeats` rounds; the table gives each figure's
median, every round's tokens/s, and on each server's row the CPU the other (idle) server took meanwhile, and
the ratios line the project's figures over vLLM's round by round (this machine's speed drifts by 10-20 %
between minutes, more than the servers differ). The project's server runs `--server-flags`; by default none, as
a user starts it: the server measures its layout at start (`serving.engine.choice.online`) and says which in its
ready line.

    python benchmarks/serving_online_bench.py                     # the issue's model, 64 x (64 in, 64 out)
    python benchmarks/serving_online_bench.py --vllm-python ~/vllm-venv/bin/python --rates 8,16 --repeats 2
    python benchmarks/serving_online_bench.py --shape qwen3_moe --vllm-python ~/vllm-venv/bin/python
    python benchmarks/serving_online_bench.py --quick --json      # a tiny model, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.arg_types import positive_int  # noqa: E402
from mbridge_epoverlap.launch.signals import stop_gracefully  # noqa: E402
from mbridge_epoverlap.serving.engine.bench import machine  # noqa: E402

READY_S = 600.0
RETOKENIZE_MARGIN = 8  # tokens a shared-prefix prompt leaves free of the context (see `main`)
STATS_LAG_S = 0.5  # an attention worker reports its steps every 0.25 s while busy (`online.STATS_EVERY_S`)
NAME = "bench-model"
TUNED_LAYOUT = "--colocated 2 --micro-batches 1 --order sequential --replicate-experts"
SHAPES = {"mixtral": dict(hidden=512, layers=4, experts=8, vocab=4096, context=512, text_files=200),
          "qwen3_moe": dict(hidden=512, layers=4, experts=64, vocab=4096, context=512, text_files=200)}


def poisson_rates(text: str) -> list[float]:
    """`--rates 8,16` -> [8.0, 16.0]; each a positive number of requests per second."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"error: --rates {text!r}: give requests per second, comma-separated (e.g. 8,16)") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise SystemExit(f"error: --rates {text!r}: every rate must be a positive number")
    return rates
STEP_FIGURES = ("engine_steps", "mean_step_ms", "mean_step_tokens", "steps_over_200ms")
FIGURES = ("output_tokens_per_s", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms",
           "p99_itl_ms", "mean_tpot_ms", "idle_server_cpu")


# --- the checkpoint ---------------------------------------------------------------------------------------
def build_checkpoint(directory: Path, *, hidden: int, layers: int, experts: int, vocab: int, context: int,
                     text_files: int, shape: str = "mixtral") -> Path:
    """A random Mixtral (or Qwen3-MoE: `shape`) with a BPE tokenizer and a chat template in `directory` (reused
    when present)."""
    if (directory / "tokenizer.json").is_file() and (directory / "config.json").is_file():
        return directory
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  max_position_embeddings=context, bos_token_id=1, eos_token_id=2)
    if shape == "qwen3_moe":  # serving_peers_bench.py's 108M Qwen3-MoE: many small experts, top-8
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_attention_heads=max(1, hidden // 64), num_key_value_heads=2,
                                                   head_dim=64, num_experts=experts, num_experts_per_tok=8,
                                                   moe_intermediate_size=hidden // 2, norm_topk_prob=True,
                                                   tie_word_embeddings=False, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(num_attention_heads=max(1, hidden // 64),
                                                 num_key_value_heads=max(1, hidden // 128), num_local_experts=experts,
                                                 num_experts_per_tok=2, **common))
    model.eval().save_pretrained(directory)
    sources = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:text_files]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(sources, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                 show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(directory)
    return directory


# --- servers ----------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process started by `command`, ready once `probe` answers (or its ready line is printed)."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"the server did not get ready: {self.log.read().decode(errors='replace')[-3000:]}")

    def worker_pids(self, role: str) -> list[int]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/health", timeout=10) as answer:
            return [w["pid"] for w in json.loads(answer.read())["workers"] if w["role"] == role]

    def stop(self) -> None:
        stop_gracefully(self.proc, 120)


def ours(checkpoint: Path, flags: list[str]) -> Server:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return Server([sys.executable, "-m", "mbridge_epoverlap.cli", "serve", "--checkpoint", str(checkpoint),
                   "--http", f"127.0.0.1:{port}", "--served-model-name", NAME, *flags], port, env)


def server_layout(server: Server) -> dict[str, Any] | None:
    """What the project's server runs and why (its /health `layout`: measured, cached or the flags')."""
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as answer:
        return json.loads(answer.read()).get("layout")


def engine_step_totals(server: Server) -> dict[str, float]:
    """The project's server's step histograms (`/metrics`), summed over its attention workers: steps, their
    seconds and token rows, and the steps of at most 0.2 s."""
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    totals = dict.fromkeys(("steps", "seconds", "tokens", "short"), 0.0)
    names = {"mbe_engine_step_seconds_count": "steps", "mbe_engine_step_seconds_sum": "seconds",
             "mbe_iteration_tokens_sum": "tokens"}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.partition("{")[0]
        if base in names:
            totals[names[base]] += float(value)
        elif base == "mbe_engine_step_seconds_bucket" and 'le="0.2"' in name:
            totals["short"] += float(value)
    return totals


def step_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """A case's engine steps from the totals before and after it: how many, their mean time and token rows, and
    how many took over 0.2 s (a large prefill beside decoding: what the decoding sequences' ITL P99 shows)."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return {}
    return {"engine_steps": steps, "mean_step_ms": 1000 * (after["seconds"] - before["seconds"]) / steps,
            "mean_step_tokens": (after["tokens"] - before["tokens"]) / steps,
            "steps_over_200ms": steps - (after["short"] - before["short"])}


def vllm(python: str, checkpoint: Path, context: int, max_seqs: int) -> Server:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    return Server([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
                   "--served-model-name", NAME, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                   "--max-model-len", str(context), "--max-num-seqs", str(max_seqs), "--enforce-eager"], port, env)


# --- the built-in client ------------------------------------------------------------------------------------
class Streaming:
    """Counts the requests that got their first text; `half` is set once half of them did."""

    def __init__(self, requests: int) -> None:
        self.count, self.target, self.half = 0, max(1, requests // 2), threading.Event()
        self.done = threading.Event()  # every request answered

    def first(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.half.set()


async def _one(client: Any, url: str, prompt: list[int], output_len: int, streaming: Streaming) -> dict[str, Any]:
    body = {"model": NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                return {"ok": False, "error": f"HTTP {answer.status_code}"}
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"ok": False, "error": event["error"]["message"]}
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.perf_counter())
                    if len(times) == 1:
                        streaming.first()
    except Exception as exc:  # noqa: BLE001 - a failed request is a figure here
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    ok = tokens == output_len and bool(times)
    return {"ok": ok, "start": started, "times": times, "tokens": tokens,
            "error": None if ok else f"{tokens} of {output_len} tokens"}


async def _drive(url: str, prompts: list[list[int]], output_len: int, rate: float,
                 on_half: Any = None) -> tuple[list[dict[str, Any]], float]:
    """Send every prompt (all at once, or at a Poisson `rate`); `on_half(streaming)` runs on a thread meanwhile."""
    import httpx

    streaming = Streaming(len(prompts))

    rng = random.Random(1)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        side = asyncio.create_task(asyncio.to_thread(on_half, streaming)) if on_half is not None else None
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one(client, url, prompt, output_len, streaming)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        if side is not None:
            streaming.done.set()
            streaming.half.set()  # nothing streams any more: let it finish
            await side
    return list(results), time.perf_counter() - started


def summarize(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """vLLM's figures from per-request chunk times: output tokens/s, TTFT, TPOT, ITL (ms, P50/P99), failed."""
    good = [r for r in results if r["ok"]]
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in good]
    tpot = [(r["times"][-1] - r["times"][0]) * 1e3 / (r["tokens"] - 1) for r in good if r["tokens"] > 1]
    itl = [(b - a) * 1e3 for r in good for a, b in zip(r["times"], r["times"][1:], strict=False)]

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    out = {"completed": len(good), "failed": len(results) - len(good),
           "output_tokens_per_s": sum(r["tokens"] for r in good) / wall_s if wall_s > 0 else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out[f"p50_{name}_ms"], out[f"p99_{name}_ms"] = pct(values, 50), pct(values, 99)
    out["mean_tpot_ms"] = statistics.fmean(tpot) if tpot else None
    errors = sorted({r["error"] for r in results if not r["ok"]})
    if errors:
        out["errors"] = errors[:5]
    return out


def builtin_case(url: str, vocab: int, args: argparse.Namespace, rate: float, on_half: Any = None, *,
                 prefix_len: int = 0, input_len: int | None = None, seed: int = 0) -> dict[str, Any]:
    """`args.prompts` random prompts of `input_len` tokens (default `args.input_len`; after a `prefix_len`-token
    prefix they all share, drawn from `seed`) sent at `rate`."""
    rng = random.Random(0)
    shared_rng = random.Random(1000 + seed)
    prefix = [shared_rng.randrange(3, vocab) for _ in range(prefix_len)]
    length = args.input_len if input_len is None else input_len
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(length)] for _ in range(args.prompts)]
    results, wall = asyncio.run(_drive(url, prompts, args.output_len, rate, on_half))
    return summarize(results, wall)


# --- vLLM's client -----------------------------------------------------------------------------------------
def vllm_client_case(python: str, url: str, checkpoint: Path, args: argparse.Namespace, rate: float, *,
                     prefix_len: int = 0, input_len: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Run `vllm.benchmarks.serve` against `url` (its random dataset, with a shared `--random-prefix-len`
    drawn from `seed`); its figures under this benchmark's names."""
    out = Path(tempfile.mkdtemp()) / "result.json"
    code = ("import argparse, sys; from vllm.benchmarks import serve as s; p = argparse.ArgumentParser(); "
            "s.add_cli_args(p); s.main(p.parse_args(sys.argv[1:]))")
    command = [python, "-c", code, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", str(checkpoint), "--served-model-name", NAME, "--dataset-name", "random",
               "--random-input-len", str(args.input_len if input_len is None else input_len),
               "--random-output-len", str(args.output_len),
               "--num-prompts", str(args.prompts), "--ignore-eos", "--request-rate", str(rate),
               "--random-prefix-len", str(prefix_len), "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(out.parent), "--result-filename", out.name]
    with open(out.parent / "client.log", "wb") as log:  # its chatter stays out of this table
        done = subprocess.run(command, timeout=3600, cwd=out.parent, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (out.parent / "client.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm.benchmarks.serve failed (exit {done.returncode}):\n{tail}")
    doc = json.loads(out.read_text())
    figures = {"completed": doc.get("completed"), "failed": args.prompts - int(doc.get("completed", 0)),
               "output_tokens_per_s": doc.get("output_throughput"), "mean_tpot_ms": doc.get("mean_tpot_ms")}
    for name in ("ttft", "tpot", "itl"):
        for q in (50, 99):
            figures[f"p{q}_{name}_ms"] = doc.get(f"p{q}_{name}_ms")
    return figures


# --- the run -------------------------------------------------------------------------------------------------
def cpu_seconds(server: Server) -> float:
    """CPU time (user + system) of the server and every live process below it (its workers run in sessions of
    their own, so the session alone would leave them out)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total = 0.0
    for pid, seconds in used.items():
        ancestor = pid
        while ancestor > 1 and ancestor != server.proc.pid:
            ancestor = parent.get(ancestor, 0)
        if ancestor == server.proc.pid:
            total += seconds
    return total


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's rounds: the median of each figure, every round's tokens/s, and failures over all rounds."""
    out: dict[str, Any] = {}
    for name in FIGURES + STEP_FIGURES:
        values = [r[name] for r in runs if r.get(name) is not None]
        out[name] = statistics.median(values) if values else None
    out["output_tokens_per_s_rounds"] = [r["output_tokens_per_s"] for r in runs]
    out["failed"] = max(r["failed"] for r in runs)
    out["failed_total"] = sum(r["failed"] for r in runs)
    errors = sorted({e for r in runs for e in r.get("errors", [])})
    if errors:
        out["errors"] = errors[:5]
    return out


def ratios(ours_runs: dict[str, list[dict[str, Any]]], peer_runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per case, the project's figure over vLLM's in each round (measured back to back) and their median:
    tokens/s (above 1 is faster) and P99 TPOT (below 1 is shorter)."""
    out: dict[str, Any] = {}
    for case, runs in ours_runs.items():
        pairs = list(zip(runs, peer_runs[case], strict=True))
        for name in ("output_tokens_per_s", "p99_tpot_ms"):
            per_round = [a[name] / b[name] for a, b in pairs if a.get(name) and b.get(name)]
            out[f"{case}_{name}"] = {"median": statistics.median(per_round) if per_round else None,
                                     "rounds": per_round}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mbe-online-bench",
                        help="where the checkpoint is built (reused)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rates", default="16", help="requests/s of the Poisson cases, comma-separated (default 16)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="mixtral",
                        help="the model: the 57M Mixtral (8 experts top-2) or the 108M Qwen3-MoE (64 experts "
                             "top-8) of serving_peers_bench.py (default mixtral)")
    parser.add_argument("--server-flags", default="",
                        help="`serve` flags of the project's server (default none: the layout the server measures "
                             f"at its start; '{TUNED_LAYOUT}' was the fastest given by hand on 2 cores)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="measured rounds (default 3); each round runs every case on each server, one after "
                             "the other; the table gives the medians")
    parser.add_argument("--shared-prefix", type=int, default=384, metavar="TOKENS",
                        help="a case whose prompts all begin with the same TOKENS-token prefix (each round its own "
                             "prefix), sent at once: what automatic prefix caching saves (default 384; 0: none)")
    parser.add_argument("--kill-expert", action="store_true",
                        help="also a case on an elastic server whose expert worker 0 is killed mid-run")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="a python with vLLM's CPU build: run vLLM's server too, both driven by vLLM's client")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 8 requests of 16 in, 16 out")
    args = parser.parse_args(argv)
    size = dict(SHAPES[args.shape])
    if args.quick:
        size = dict(hidden=64, layers=2, experts=4, vocab=320, context=256, text_files=5)
        args.prompts, args.input_len, args.output_len = 8, 16, 16
        args.shared_prefix = min(args.shared_prefix, 64)
    if args.shared_prefix < 0 or args.shared_prefix + RETOKENIZE_MARGIN + 1 + args.output_len > size["context"]:
        raise SystemExit(f"error: --shared-prefix {args.shared_prefix}: with --input-len and --output-len it must fit "
                         f"the context of {size['context']} tokens")
    name = "quick" if args.quick else args.shape if args.shape != "mixtral" else "full"
    checkpoint = build_checkpoint(args.workdir / name, **size, shape="mixtral" if args.quick else args.shape)
    limits = ["--max-model-len", str(size["context"]), "--max-batch", str(max(args.prompts, 1)),
              "--max-waiting", str(args.prompts * 2)]
    flags = [*limits, *args.server_flags.split()]
    doc: dict[str, Any] = {"machine": machine(), "model": {k: v for k, v in size.items() if k != "text_files"},
                           "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
                           "shape": args.shape, "server_flags": args.server_flags, "rates": args.rates,
                           "client": "vllm.benchmarks.serve" if args.vllm_python else "built-in",
                           "servers": {}, "load_before": round(os.getloadavg()[0], 2)}
    rates = {"burst": float("inf"), **{f"poisson {rate:g}/s": rate for rate in poisson_rates(args.rates)}}
    prefixes = {case: 0 for case in rates}
    inputs = {case: args.input_len for case in rates}
    if args.shared_prefix:
        # vLLM's random dataset decodes random ids to text and encodes it again: a prompt can come back a few tokens
        # longer, and a server adds BOS; a prompt plus its output past the context is refused (ours, as OpenAI) or
        # has its output cut (vLLM). The unique part leaves that margin.
        unique = min(args.input_len, size["context"] - args.shared_prefix - args.output_len - RETOKENIZE_MARGIN)
        shared = f"shared prefix {args.shared_prefix}+{unique}"
        rates[shared], prefixes[shared], inputs[shared] = float("inf"), args.shared_prefix, unique
    starts = {"mbridge-epoverlap": lambda: ours(checkpoint, flags)}
    if args.vllm_python:
        starts["vllm"] = lambda: vllm(args.vllm_python, checkpoint, size["context"], max(args.prompts, 1))

    def measure(server: Server, rate: float, prefix_len: int = 0, input_len: int | None = None,
                seed: int = 0) -> dict[str, Any]:
        if args.vllm_python:
            return vllm_client_case(args.vllm_python, server.url, checkpoint, args, rate, prefix_len=prefix_len,
                                    input_len=input_len, seed=seed)
        return builtin_case(server.url, size["vocab"], args, rate, prefix_len=prefix_len, input_len=input_len,
                            seed=seed)

    servers: dict[str, Server] = {}
    try:
        for label, start in starts.items():  # both up at once: the client alternates between them
            servers[label] = start()
            servers[label].wait_ready()
        doc["layout"] = server_layout(servers["mbridge-epoverlap"])
        for label, server in servers.items():  # first-use costs (kernel choices, allocations) out of the figures
            print(f"warming up {label} (one unmeasured burst)", file=sys.stderr, flush=True)
            measure(server, float("inf"))
        rounds: dict[str, dict[str, list[dict[str, Any]]]] = {label: {case: [] for case in rates} for label in servers}
        for repeat in range(args.repeats):
            for case, rate in rates.items():
                for label, server in servers.items():  # A B, A B, ...: the machine's drift hits both alike
                    print(f"round {repeat + 1}/{args.repeats}: {label} {case}", file=sys.stderr, flush=True)
                    idle = [other for other in servers.values() if other is not server]
                    before = sum(cpu_seconds(other) for other in idle)
                    steps_before = engine_step_totals(server) if label == "mbridge-epoverlap" else None
                    started = time.perf_counter()
                    figures = measure(server, rate, prefixes[case], inputs[case], seed=repeat + 1)
                    wall = time.perf_counter() - started
                    if steps_before is not None:
                        time.sleep(STATS_LAG_S)  # the workers' last report of the case arrives
                        figures.update(step_figures(steps_before, engine_step_totals(server)))
                    if idle:
                        figures["idle_server_cpu"] = (sum(cpu_seconds(other) for other in idle) - before) / wall
                    rounds[label][case].append(figures)
    finally:
        for server in servers.values():
            server.stop()
    doc["repeats"] = args.repeats
    doc["load_after"] = round(os.getloadavg()[0], 2)
    doc["servers"] = {label: {case: median_figures(runs) for case, runs in cases.items()}
                      for label, cases in rounds.items()}
    if args.vllm_python:
        doc["ratios"] = ratios(rounds["mbridge-epoverlap"], rounds["vllm"])
    if args.kill_expert:
        # Elastic EP needs expert workers of their own: the layout flags of the other cases do not apply.
        server = ours(checkpoint, [*limits, "--elastic", "--expert-workers", "2", "--redundant-experts",
                                   str(size["experts"])])
        try:
            server.wait_ready()
            victim = server.worker_pids("expert")[0]
            killed = threading.Event()

            def kill(streaming: Streaming) -> None:
                streaming.half.wait(READY_S)
                if not streaming.done.is_set():  # mid-run: half the requests stream, some still run
                    os.kill(victim, signal.SIGKILL)
                    killed.set()

            doc["kill_expert"] = builtin_case(server.url, size["vocab"], args, float("inf"), on_half=kill)
            doc["kill_expert"]["killed_mid_run"] = killed.is_set()
        finally:
            server.stop()
    if args.json:
        print(json.dumps(doc))
    else:
        _print(doc)
    failed = sum(c["failed_total"] for cases in doc["servers"].values() for c in cases.values())
    failed += doc.get("kill_expert", {}).get("failed", 0)
    return 0 if failed == 0 else 1


def _print(doc: dict[str, Any]) -> None:
    m = doc["machine"]
    print(f"machine: {m.get('cpu')} ({m.get('cores')} cores, avx512_bf16={m.get('avx512_bf16')}, "
          f"amx_bf16={m.get('amx_bf16')}, 1-min load {doc.get('load_before')} before, {doc.get('load_after')} after)")
    layout = doc.get("layout") or {}
    print(f"mbridge-epoverlap layout ({layout.get('source', '?')}): {layout.get('workers', '?')}"
          + (f"; {layout['summary']}" if layout.get("summary") and layout.get("source") != "flags" else ""))
    print(f"client: {doc['client']}; {doc['prompts']} requests "
          f"of {doc['input_len']} in, {doc['output_len']} out; medians of {doc['repeats']} rounds (servers "
          "alternating)")

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:,.1f}"

    print(f"{'server':<20} {'case':<20} {'out tok/s':>10} {'TTFT p50/p99 ms':>18} {'TPOT p50/p99 ms':>18} "
          f"{'ITL p50/p99 ms':>18} {'failed':>6}  tok/s per round; the other server's CPU meanwhile (idle)")
    rows = [(label, case, c) for label, cases in doc["servers"].items() for case, c in cases.items()]
    if "kill_expert" in doc:
        rows.append(("mbridge-epoverlap", "kill", doc["kill_expert"]))
    for label, case, c in rows:
        rounds = ", ".join(f"{v:,.0f}" for v in c.get("output_tokens_per_s_rounds", []))
        idle = c.get("idle_server_cpu")
        other = " and ".join(name for name in doc["servers"] if name != label)
        print(f"{label:<20} {case:<20} {fmt(c['output_tokens_per_s']):>10} "
              f"{fmt(c['p50_ttft_ms']) + ' / ' + fmt(c['p99_ttft_ms']):>18} "
              f"{fmt(c['p50_tpot_ms']) + ' / ' + fmt(c['p99_tpot_ms']):>18} "
              f"{fmt(c['p50_itl_ms']) + ' / ' + fmt(c['p99_itl_ms']):>18} {c['failed']:>6}  {rounds}"
              + (f"; {other} idle {idle:.2f} core" if idle is not None else ""))
    for case, c in doc["servers"].get("mbridge-epoverlap", {}).items():
        if c.get("engine_steps") is not None:
            print(f"mbridge-epoverlap engine steps, {case}: {c['engine_steps']:.0f} per round, mean "
                  f"{c['mean_step_ms']:.1f} ms and {c['mean_step_tokens']:.1f} token rows, "
                  f"{c['steps_over_200ms']:.0f} over 200 ms (medians)")
    for key, value in doc.get("ratios", {}).items():
        per_round = ", ".join(f"{v:.2f}" for v in value["rounds"])
        print(f"mbridge-epoverlap / vllm, {key}: {fmt_ratio(value['median'])} (rounds: {per_round})")


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
