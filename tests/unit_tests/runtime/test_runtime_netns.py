"""The emulated inter-node link: a short shaped run, and nothing left behind (also after a failure)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.launch import netns
from mbridge_epoverlap.runtime import run_local
from tests.unit_tests.requirements import require_or_skip

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def _netns_tools() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        require_or_skip("netns", "link emulation needs root and iproute2 (ip, tc)")


needs_netns = pytest.mark.usefixtures("_netns_tools")


class _Recorder:
    """Wraps EmulatedLink to remember what each run created."""

    def __init__(self, monkeypatch):
        self.links: list[netns.EmulatedLink] = []
        real = netns.EmulatedLink
        recorder = self

        class Recording(real):
            def create(self) -> None:
                recorder.links.append(self)
                super().create()

        monkeypatch.setattr(netns, "EmulatedLink", Recording)

    def assert_all_removed(self) -> None:
        assert self.links, "no link was created"
        present = set(netns.existing_namespaces(prefix=""))
        for link in self.links:
            assert not set(link.namespaces) & present
            for name in [*link.host_links, link.bridge]:
                assert not Path("/sys/class/net", name).exists()
            assert not (netns.REGISTRY / f"{link.run_id}.json").exists()


@needs_netns
@pytest.mark.netns
def test_run_behind_an_emulated_link_and_clean_up(make_tiny, monkeypatch):
    recorder = _Recorder(monkeypatch)
    m = run_local(make_tiny(2, overlap=True), max_steps=2, emulate_link_gbps=1.0, timeout_s=150)
    assert len(m.losses) == 2
    link = recorder.links[0]
    assert all(link.address(r).startswith(("198.18.", "198.19.")) for r in range(2))
    recorder.assert_all_removed()


@needs_netns
@pytest.mark.netns
def test_emulated_link_is_removed_when_a_rank_fails(make_tiny, monkeypatch):
    recorder = _Recorder(monkeypatch)
    cfg = make_tiny(2)
    cfg.env_vars["MBRIDGE_EPOVERLAP_FAULT"] = "1:exit:1"
    with pytest.raises(RunFailedError, match="rank 1 failed"):
        run_local(cfg, max_steps=2, emulate_link_gbps=0.5, timeout_s=150)
    recorder.assert_all_removed()


def test_link_emulation_needs_root(make_tiny, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UsageError, match="needs root"):
        run_local(make_tiny(2), max_steps=1, emulate_link_gbps=1.0)


def test_link_rate_must_be_positive():
    with pytest.raises(UsageError, match="positive"):
        netns.EmulatedLink(2, 0.0)
