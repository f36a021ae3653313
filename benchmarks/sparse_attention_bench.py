"""Decode attention of DeepSeek Sparse Attention against dense latent attention, at a context several times the
indexer's choice.

One attention layer of `serving_peers_bench.py`'s DeepSeek-V3.2 model (bf16: DeepSeek-V3's latent sizes at width
512, the indexer at DeepSeek's 64 heads of 128 choosing `index_topk` = 128 tokens) through the engine workers' code
(`MultiLatentAttention.attend` over a `LatentKVCache` with absorbed decode): `--sequences` sequences are prefilled
to `--context` tokens (8x the choice by default), then decode steps run, the sparse layer (the indexer scores
every cached token, the absorbed attention reads the chosen 128 latents) and the same weights without the indexer
(dense absorbed attention over every latent) interleaved A B A B, `--rounds` rounds of `--steps` steps each. Prints
the median milliseconds per step of each and their ratio, with the CPU model and flags.

    python benchmarks/sparse_attention_bench.py                 # 32 sequences at 1,024 tokens
    python benchmarks/sparse_attention_bench.py --quick         # `make bench`: 8 sequences at 512 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mbridge_epoverlap.machine import machine
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.kv_cache import LatentKVCache
from mbridge_epoverlap.serving.model.layers import MultiLatentAttention, rotary_for
from mbridge_epoverlap.serving.model.parts import load_attention_part

LAYER = 1


def _layers(checkpoint: Path) -> tuple[MultiLatentAttention, MultiLatentAttention, object, object]:
    """The sparse layer as loaded, the same weights without the indexer, and the two specs."""
    spec = load_spec(checkpoint, dtype="bfloat16")
    sparse = load_attention_part(spec).layers[LAYER].attention
    assert spec.mla is not None and spec.mla.indexer is not None
    dense_spec = dataclasses.replace(spec, mla=dataclasses.replace(spec.mla, indexer=None))
    dense = MultiLatentAttention(dense_spec, spec.torch_dtype(), layer=LAYER)
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    return sparse, dense, spec, dense_spec


class Run:
    """One layer decoding `sequences` sequences from a prefilled `context`, its own cache and token positions."""

    def __init__(self, layer: MultiLatentAttention, spec, sequences: int, context: int, seed: int) -> None:
        self.layer, self.sequences = layer, sequences
        self.cache = LatentKVCache.for_spec(spec, exact_decode=False)
        self.rotary = rotary_for(spec)
        self.gen = torch.Generator().manual_seed(seed)
        self.hidden, self.dtype = spec.hidden_size, spec.torch_dtype()
        self.lengths = [0] * sequences
        for seq in range(sequences):
            self.cache.add(seq)
            for start in range(0, context, 256):  # prompt chunks, as the scheduler feeds a long prompt
                n = min(256, context - start)
                self._step(TokenBatch.from_chunks([(seq, [0] * n, start)]))
                self.lengths[seq] = start + n

    def _step(self, batch: TokenBatch) -> None:
        x = torch.randn(batch.positions.shape[0], self.hidden, generator=self.gen).to(self.dtype)
        self.layer.attend(LAYER, x, batch, self.cache, self.rotary.cos_sin(batch.positions))

    def decode(self, steps: int) -> float:
        """Milliseconds per step over `steps` decode steps of every sequence."""
        begin = time.perf_counter()
        for _ in range(steps):
            self._step(TokenBatch.from_chunks([(s, [0], self.lengths[s]) for s in range(self.sequences)]))
            self.lengths = [n + 1 for n in self.lengths]
        return (time.perf_counter() - begin) * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024, help="tokens cached per sequence before decode")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mbe-serving-peers")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="8 sequences at 512 tokens, 3 rounds of 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.context, args.steps, args.rounds = 8, 512, 4, 3
    for name in ("sequences", "context", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serving_peers_bench import build_checkpoints

    checkpoint = build_checkpoints(args.workdir, ["deepseek_v32_bf16"])["deepseek_v32_bf16"]
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    sparse_layer, dense_layer, spec, dense_spec = _layers(checkpoint)
    topk = spec.mla.indexer.topk
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, avx512_bf16={info['avx512_bf16']}, "
          f"amx_bf16={info['amx_bf16']}; bf16; {args.sequences} sequences at {args.context} tokens "
          f"({args.context / topk:.1f}x index_topk {topk}); A B A B x{args.rounds}, {args.steps} steps each",
          flush=True)
    with torch.no_grad():
        runs = {"sparse": Run(sparse_layer, spec, args.sequences, args.context, 1),
                "dense": Run(dense_layer, dense_spec, args.sequences, args.context, 1)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                times[name].append(run.decode(args.steps))
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {"machine": info, "sequences": args.sequences, "context": args.context, "index_topk": topk,
              "ms_per_step": medians, "ms_per_step_rounds": times,
              "dense_over_sparse": medians["dense"] / medians["sparse"]}
    print(f"decode attention, one layer: sparse {medians['sparse']:.2f} ms/step, dense {medians['dense']:.2f} "
          f"ms/step; dense / sparse = {result['dense_over_sparse']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
