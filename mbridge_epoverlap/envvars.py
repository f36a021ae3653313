"""The `MBRIDGE_EPOVERLAP_*` environment variables a user can set, for `--help` epilogs and the docs.

The runtime reads them (`mbridge_epoverlap.runtime.options`, the Slurm script); this table is what a
user sees. A test checks that every variable the code reads is listed here.
"""

from __future__ import annotations

ENV_VARS: tuple[tuple[str, str], ...] = (
    ("MBRIDGE_EPOVERLAP_PYTHON", "Python on the Slurm nodes that has Megatron-Bridge (GPU jobs; default python3)"),
    ("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "a Python here with Megatron-Bridge (3.12; scripts/setup_bridge_venv.sh "
     "builds one) for --check_with_bridge and the differential test against Megatron-Bridge"),
    ("MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON", "a Python here with Megatron-Bridge main "
     "(scripts/setup_bridge_main_venv.sh builds one) for --check_with_bridge --bridge_version main, the differential "
     "test against main and main's recipe facts"),
    ("MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S", "seconds any collective may take before the run fails (default 120)"),
    ("MBRIDGE_EPOVERLAP_DTYPE", "fp32 or bf16: override the config's precision in the reference runtime"),
    ("MBRIDGE_EPOVERLAP_CPU_FLAGS", "CPU flags (space or comma separated) used instead of /proc/cpuinfo's when "
     "choosing the CPU compute dtype (native bf16: avx512_bf16 or amx_bf16)"),
    ("MBRIDGE_EPOVERLAP_OPTIMIZER", "adam (default) or sgd, for the reference runtime"),
    ("MBRIDGE_EPOVERLAP_DEVICE", "auto (default), cpu or cuda, for the reference runtime"),
    ("MBRIDGE_EPOVERLAP_BACKEND", "auto (default), nccl or gloo, for the reference runtime"),
    ("MBRIDGE_EPOVERLAP_COMM_NICE", "nice value of the CPU communication threads (default -10; 0 leaves them alone)"),
    ("MBRIDGE_EPOVERLAP_COMM_CHANNELS", "2 (default) or 1: on CPU, run the backward all-to-alls on their own "
     "communication thread and process group beside the forward ones (2) or share one (1)"),
    ("MBRIDGE_EPOVERLAP_SPLIT_EXPERT_WGRAD", "1 or 0 (default): with delayed wgrad, run the experts' down-projection "
     "weight gradient in the next combine-backward window (1) or with the rest of the expert weight gradient (0)"),
    ("MBRIDGE_EPOVERLAP_PAIRED_EDGES", "1 (default) or 0: with EP overlap, interleave the first two forwards and "
     "the last two backwards of an iteration (1) or run them alone as Megatron-Core does (0)"),
    ("MBRIDGE_EPOVERLAP_FAULT", "RANK:MODE:ITERATION, a test hook that makes one rank exit, raise or hang"),
    ("MBRIDGE_EPOVERLAP_MOVE_FAULT", "EPOCH:MESSAGES, a test hook: in the expert-weight moves of elastic layout "
     "epoch EPOCH, the lowest-index expert worker that sends weights SIGKILLs itself after MESSAGES of its messages"),
    ("MBRIDGE_EPOVERLAP_PACKED_GEMM", "1 (default) or 0: the serving workers run their expert GEMMs on oneDNN-packed "
     "weights (1) or on the reference model's GEMMs (0; docs/numerics.md says what each promises)"),
    ("MBRIDGE_EPOVERLAP_SMALL_GEMM", "1 (default) or 0: in fp32 the serving workers run the experts with a few rows "
     "of a narrow step (up to MBRIDGE_EPOVERLAP_SMALL_GEMM_ROWS on one thread, up to 128 where the call shares its "
     "work among the cores) in one call of a tiled GEMM compiled here with the system's C compiler (1), or every "
     "expert on oneDNN (0); where no compiler builds it, oneDNN"),
    ("MBRIDGE_EPOVERLAP_QUANTIZED_TILES", "1 (default) or 0: the experts of an FP8 block-scaled checkpoint served in "
     "fp32 keep their tiles also as FP8 codes and scales, which a decode step's experts of one row (up to 4 where the "
     "call shares its work among the cores) read instead of the fp32 tiles, with the same bits (1); or fp32 tiles "
     "only (0)"),
    ("MBRIDGE_EPOVERLAP_SMALL_GEMM_ROWS", "rows (default 4 on a CPU with AVX-512, 16 on one without): the most rows "
     "an expert may have for the tiled GEMM on one thread; 0 sends every expert to oneDNN"),
    ("MBRIDGE_EPOVERLAP_SMALL_GEMM_SPIN_US", "microseconds (default 300) a helper thread of the tiled GEMM waits "
     "spinning for the next call before it sleeps; lower leaves more of the cores to other processes between steps"),
    ("MBRIDGE_EPOVERLAP_EXACT_ATTENTION", "0 (default) or 1: the serving workers' decode attention runs the whole "
     "batch padded in two products (0) or each sequence's own products as the reference model does, bit for bit "
     "transformers' eager attention on every CPU (1)"),
    ("MBRIDGE_EPOVERLAP_MLA_ABSORB", "1 (default) or 0: the serving workers decode a multi-head latent attention "
     "model (DeepSeek-V3) with the key and value up-projections absorbed into the query and the output (1), or "
     "rebuild every head's keys and values from the cached latents, each sequence alone, as the reference model "
     "does (0; MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1 does the same)"),
    ("MBRIDGE_EPOVERLAP_ZYGOTE", "1 (default) or 0: local ranks started as `python -m` (training ranks, serving "
     "workers, replacements) are forked from a process of the launcher that imported torch once, about 1.5 s of "
     "CPU less per rank (1), or each starts as a new interpreter (0)"),
    ("MBRIDGE_EPOVERLAP_ZYGOTE_DIR", "a directory of zygotes shared by the launchers that have it in their "
     "environment (`launch.zygote.share`; the test suite's, one per pytest worker): one zygote per torch-import "
     "environment, started by the first launcher that needs it, living as long as the directory's owner"),
    ("MBRIDGE_EPOVERLAP_API_KEY", "serve --http: the key every /v1/* request must send as 'Authorization: Bearer "
     "KEY' (what --api-key gives; unset: none)"),
    ("MBRIDGE_EPOVERLAP_HEARTBEAT_DIR", "set by the launcher: where ranks leave heartbeat files for its watchdog"),
    ("MBRIDGE_EPOVERLAP_STORE_FD", "set by the local launcher for rank 0: the descriptor of the rendezvous socket it "
     "bound at MASTER_PORT, which rank 0's store takes over (no other run can take the port meanwhile)"),
    ("MBRIDGE_EPOVERLAP_SUPERVISOR_PID", "set by the launcher: its pid; a rank exits when that process is gone"),
)


def env_epilog(names: tuple[str, ...] | None = None) -> str:
    """An `environment variables:` block for an argparse epilog (all variables, or those named)."""
    rows = [(name, text) for name, text in ENV_VARS if names is None or name in names]
    width = max(len(name) for name, _ in rows)
    return "environment variables:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in rows) + "\n"


def env_markdown() -> str:
    """The same table in Markdown (for the docs)."""
    lines = ["| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {text.replace('|', chr(92) + '|')} |" for name, text in ENV_VARS]
    return "\n".join(lines) + "\n"
