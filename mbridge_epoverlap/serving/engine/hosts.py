"""Emulated hosts for the engine: attention workers on one host, expert workers on another, so that M2N crosses
a real (shaped) link: `--emulate-hosts 2 --emulate-link-gbps G`.

Each host is a network namespace (`launch.netns.EmulatedLink` with a host per rank), the two joined by links
shaped with tc tbf to G Gbit/s; every worker's M2N endpoints listen on its host's address. The shared-memory
backend cannot cross it and is refused naming the hosts; `m2n` means the fastest cross-host backend. Root
only; everything is removed afterwards, also after a failure or Ctrl-C (the launcher's cleanup).
"""

from __future__ import annotations

from dataclasses import replace

from mbridge_epoverlap.comm.m2n import resolve_backend
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan

ATTENTION_HOST, EXPERT_HOST = 0, 1


def emulate_hosts(plan: EnginePlan, hosts: int, gbps: float | None) -> EnginePlan:
    """`plan` on `hosts` emulated hosts (2: attention workers on host 0, expert workers on host 1) joined by a
    link of `gbps` Gbit/s; `hosts` 0 leaves it on this host.

    Raises:
        UsageError: a host count other than 0 or 2, no or a bad rate, a colocated plan, or the `shm` backend.
    """
    check_emulated_hosts(hosts, gbps, colocated=plan.mode == COLOCATED, backend=plan.backend)
    if not hosts:
        return plan
    return replace(plan, emulate_hosts=hosts, emulate_link_gbps=float(gbps))


def check_emulated_hosts(hosts: int, gbps: float | None, *, colocated: bool, backend: str) -> None:
    """What `emulate_hosts` refuses, from the flags alone: the commands check it before any probe or worker.

    Raises:
        UsageError: as `emulate_hosts`.
    """
    if not hosts:
        if gbps is not None:
            raise UsageError("--emulate-link-gbps shapes the link between emulated hosts: add --emulate-hosts 2")
        return
    if hosts != 2:
        raise UsageError(f"--emulate-hosts {hosts}: 2 is supported (attention workers on one host, expert "
                         "workers on the other)")
    if gbps is None or gbps <= 0:
        raise UsageError("--emulate-hosts 2 needs --emulate-link-gbps G (the link's rate, G > 0)")
    if colocated:
        raise UsageError("--emulate-hosts puts attention and expert workers on different hosts; drop --colocated")
    if resolve_backend(backend, single_host=False) == "shm":
        raise UsageError(f"--backend {backend} cannot cross hosts: the attention workers (host "
                         f"{ATTENTION_HOST}) and the expert workers (host {EXPERT_HOST}) share no memory; use "
                         "--backend mooncake, torch or m2n")


def host_of_ranks(plan: EnginePlan) -> list[int] | None:
    """The emulated host of each rank of `plan` (None: one real host)."""
    if not plan.emulate_hosts:
        return None
    experts = set(plan.expert_ranks)
    return [EXPERT_HOST if rank in experts else ATTENTION_HOST for rank in range(plan.world)]
