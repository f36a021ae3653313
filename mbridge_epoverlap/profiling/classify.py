"""Name rules: which kernels or CPU ranges are communication, memory traffic or compute.

Communication is recognised by library name, case-insensitively, at the start of the name or right
after whitespace (`void `) or a namespace separator (`::`): `nccl`, `deep_ep`, `hybrid_ep`,
`dpsk::ep` and `gloo:`. That covers `ncclDevKernel_SendRecv(...)`,
`void deep_ep::intranode::dispatch<...>`, `deep_ep::internode_ll::combine` and CPU-side
`gloo:all_to_all` ranges. Name-only NCCL rules (HTA, nsys recipes) count DeepEP/HybridEP kernels as
compute; these do not. A user `--comm-regex` adds to the built-in names.

Memory operations (names starting `Memcpy`, `Memset` or `dma`) are neither communication nor
compute: they count towards the GPU-active union only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from mbridge_epoverlap.errors import UsageError

# Integer codes stored per activity row (numpy int8).
COMPUTE = 0
COMM = 1
MEMORY = 2
# CPU traces only: a call that issues or waits for communication (c10d::alltoall_base_, ...). It is
# busy time on the calling thread but neither overlappable compute nor the transfer itself.
COMM_CALL = 3

BUILTIN_COMM = re.compile(r"(?:^|\s|::)(?:nccl|deep_ep|hybrid_ep|dpsk::ep|gloo:)", re.IGNORECASE)
MEMORY_PREFIX = re.compile(r"\s*(?:memcpy|memset|dma)", re.IGNORECASE)
# torch.distributed entry points seen as cpu_op events on the calling thread.
COMM_CALL_PREFIX = re.compile(r"\s*(?:_?c10d(?:_functional)?::|record_param_comms)", re.IGNORECASE)

# Annotation ranges backing the overlap figures. `pre_dispatch` is the compute stage before the
# dispatch, not the dispatch itself.
DISPATCH_RANGE = re.compile(r"(?<!pre_)(?<!pre-)(?<!pre )dispatch", re.IGNORECASE)
COMBINE_RANGE = re.compile(r"combine", re.IGNORECASE)
# Step ranges usable by `--window steps:A:B`.
STEP_RANGE = re.compile(r"^\s*(?:ProfilerStep\s*#\s*|iteration[\s_#:-]*|iter[\s_#:-]*|step[\s_#:-]*)(\d+)\s*$", re.I)
# Compute stages of the MoE stage program, as CPU traces name their ranges.
COMPUTE_STAGE = re.compile(
    r"(?<![a-z])(?:pre_dispatch|attention|attn|router|permute|unpermute|experts?|shared_experts?|mlp|post"
    r"|wgrad|dgrad)(?![a-z])",
    re.IGNORECASE,
)


class Classifier:
    """Classifies kernel and range names as communication, memory or compute.

    Args:
        comm_regex: Extra pattern (Python `re` syntax, case-insensitive, searched anywhere in the
            name) whose matches also count as communication.

    Raises:
        UsageError: `comm_regex` is not a valid regular expression.
    """

    def __init__(self, comm_regex: str | None = None) -> None:
        self.comm_regex = comm_regex
        self._extra: re.Pattern[str] | None = None
        if comm_regex:
            try:
                self._extra = re.compile(comm_regex, re.IGNORECASE)
            except re.error as exc:
                raise UsageError(
                    f"--comm-regex {comm_regex!r} is not a valid regular expression ({exc}); "
                    "fix the pattern or escape special characters, e.g. --comm-regex 'my_a2a|alltoall\\('"
                ) from None

    def is_comm(self, name: str) -> bool:
        """True when `name` is a communication kernel or range."""
        if BUILTIN_COMM.search(name):
            return True
        return bool(self._extra is not None and self._extra.search(name))

    def kind(self, name: str) -> int:
        """`COMM`, `MEMORY` or `COMPUTE` for a GPU kernel name."""
        if self.is_comm(name):
            return COMM
        if MEMORY_PREFIX.match(name):
            return MEMORY
        return COMPUTE

    def kinds(self, names: Iterable[str]) -> list[int]:
        """`kind` of every name, in order."""
        return [self.kind(n) for n in names]

    def describe(self) -> str:
        """One line naming the rule, for reports."""
        extra = f" or /{self.comm_regex}/" if self.comm_regex else ""
        return f"comm = nccl|deep_ep|hybrid_ep|dpsk::ep|gloo:{extra}; memory = Memcpy|Memset|dma; rest = compute"


def step_number(name: str) -> int | None:
    """The step number of a `ProfilerStep#N` / `iteration N` range, else None."""
    m = STEP_RANGE.match(name)
    return int(m.group(1)) if m else None
