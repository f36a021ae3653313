"""`mbridge-epoverlap m2n-bench`: latency of M senders to N receivers over one M2N backend.

`register` only touches argparse so `mbridge-epoverlap --help` stays fast; torch and the backends are
imported by the rank processes the handler starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mbridge_epoverlap.errors import UsageError

_BACKENDS = ("shm", "mooncake", "torch", "gloo", "m2n")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "m2n-bench", help="measure M2N message latency between local sender and receiver processes",
        description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, required=True, help="sender processes (M)")
    parser.add_argument("--receivers", type=int, required=True, help="receiver processes (N)")
    parser.add_argument("--sizes", required=True, help="message sizes, comma separated, e.g. 2K,256K,8M")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per size (default 200)")
    parser.add_argument("--backend", default="m2n", help=f"one of {', '.join(_BACKENDS)} (default m2n: the "
                                                         "fastest available, shm on one host)")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit of the whole run in seconds")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    from mbridge_epoverlap.comm.m2n.bench import describe_machine, parse_size, run_bench

    if args.backend not in _BACKENDS:
        raise UsageError(f"--backend {args.backend}: unknown; choose one of {', '.join(_BACKENDS)}")
    sizes = [parse_size(part) for part in args.sizes.split(",") if part.strip()]
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout}: must be positive")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    doc = run_bench(args.backend, senders=args.senders, receivers=args.receivers, sizes=sizes, iters=args.iters,
                    timeout_s=args.timeout, progress=progress)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"M2N {doc['backend']}: {doc['senders']} senders x {doc['receivers']} receivers, {doc['iters']} "
          f"iterations per size")
    print(f"machine: {describe_machine(doc['machine'])}")
    print(f"{'size (bytes)':>14} {'median (us)':>12} {'P99 (us)':>10} {'Gbit/s':>8}")
    for row in doc["results"]:
        print(f"{row['size_bytes']:>14,} {row['median_us']:>12,.1f} {row['p99_us']:>10,.1f} {row['gbps']:>8.3f}")
    return 0
