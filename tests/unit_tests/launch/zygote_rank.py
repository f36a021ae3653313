"""A rank for `test_zygote`, run as `python -m tests.unit_tests.launch.zygote_rank MODE [OUT]`: it reports what a
process sees of itself and a few bits of arithmetic as JSON (MODE "report"), or ends in a given way."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def report() -> dict:
    import torch

    torch.manual_seed(0)
    a, b = torch.randn(96, 80), torch.randn(80, 72)
    product = a @ b
    soft = torch.softmax(torch.randn(4, 1000), dim=-1)
    return {
        "name": __name__, "argv": sys.argv[1:], "argv0": sys.argv[0], "path0": sys.path[0], "cwd": os.getcwd(),
        "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "threads": torch.get_num_threads(),
        "product": product.double().sum().item().hex(), "softmax": soft.double().sum().item().hex(),
        "random": torch.rand(3).tolist(), "sigint": str(signal.getsignal(signal.SIGINT)),
        "title": open(f"/proc/{os.getpid()}/cmdline", "rb").read().rstrip(b"\0").decode(),
    }


def main() -> int:
    mode = sys.argv[1]
    if mode == "report":
        with open(sys.argv[2], "w") as f:
            json.dump(report(), f)
        return 0
    if mode == "exit":
        return int(sys.argv[2])
    if mode == "raise":
        raise ValueError("the rank's own error")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "orphan":
        from mbridge_epoverlap.launch.orphan import exit_when_orphaned

        def release() -> None:
            with open(sys.argv[2], "w") as f:
                f.write("released")

        exit_when_orphaned(release)
        print("watching", flush=True)
        time.sleep(600)
    return 2


if __name__ == "__main__":
    sys.exit(main())
