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
    parser.add_argument("--emulate-hosts", type=int, default=0, metavar="H",
                        help="2: senders and receivers on two emulated hosts (network namespaces joined by a shaped "
                             "link; root only) (default 0: this host)")
    parser.add_argument("--emulate-link-gbps", type=float, default=None, metavar="G",
                        help="with --emulate-hosts 2: the link's rate in Gbit/s")
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

    if args.emulate_hosts not in (0, 2):
        raise UsageError(f"--emulate-hosts {args.emulate_hosts}: 2 is supported (senders on one host, receivers on "
                         "the other)")
    if bool(args.emulate_hosts) != (args.emulate_link_gbps is not None):
        raise UsageError("--emulate-hosts 2 and --emulate-link-gbps G go together (two hosts joined by a G Gbit/s "
                         "link)")
    if args.emulate_link_gbps is not None and args.emulate_link_gbps <= 0:
        raise UsageError(f"--emulate-link-gbps {args.emulate_link_gbps}: the rate must be positive")
    doc = run_bench(args.backend, senders=args.senders, receivers=args.receivers, sizes=sizes, iters=args.iters,
                    timeout_s=args.timeout, progress=progress, emulate_link_gbps=args.emulate_link_gbps)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"M2N {doc['backend']}: {doc['senders']} senders x {doc['receivers']} receivers, {doc['iters']} "
          f"iterations per size")
    print(f"machine: {describe_machine(doc['machine'])}")
    link = "emulate_link_gbps" in doc
    if link:
        print(f"across 2 emulated hosts, link {doc['emulate_link_gbps']:g} Gbit/s (link limit: size x 8 / rate)")
    print(f"{'size (bytes)':>14} {'median (us)':>12} {'P99 (us)':>10} {'Gbit/s':>8}"
          + (f" {'link (us)':>10} {'median/link':>12}" if link else ""))
    for row in doc["results"]:
        extra = f" {row['link_us']:>10,.1f} {row['median_us'] / row['link_us']:>12.2f}" if link else ""
        print(f"{row['size_bytes']:>14,} {row['median_us']:>12,.1f} {row['p99_us']:>10,.1f} {row['gbps']:>8.3f}"
              + extra)
    return 0
