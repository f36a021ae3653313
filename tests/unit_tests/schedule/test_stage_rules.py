"""The rules every executor of the stage table shares: handler names, each role's steps, heartbeat state."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.schedule.program import (
    ATTN,
    COMBINE,
    DISPATCH,
    EXPERTS,
    POST,
    Phase,
    Role,
    bind_handlers,
    handler_name,
    is_communicating,
    issue,
    role_phases,
    run,
    wait,
)


def test_handler_names_follow_the_stage_and_phase() -> None:
    assert handler_name(ATTN, Phase.RUN) == "_attn"
    assert handler_name(DISPATCH, Phase.ISSUE) == "_dispatch_issue"
    assert handler_name(COMBINE, Phase.WAIT) == "_combine_wait"


def test_each_role_gets_its_steps_of_the_forward_table() -> None:
    assert role_phases(Role.ATTENTION) == [(ATTN, Phase.RUN), (DISPATCH, Phase.ISSUE), (COMBINE, Phase.WAIT),
                                           (POST, Phase.RUN)]
    assert role_phases(Role.EXPERT) == [(DISPATCH, Phase.WAIT), (EXPERTS, Phase.RUN), (COMBINE, Phase.ISSUE)]


def test_bind_handlers_finds_each_method_and_fails_at_start_up_on_a_missing_one() -> None:
    class Expert:
        def _dispatch_wait(self, mb: int, layer: int) -> None: ...
        def _experts(self, mb: int, layer: int) -> None: ...
        def _combine_issue(self, mb: int, layer: int) -> None: ...

    worker = Expert()
    handlers = bind_handlers(worker, role_phases(Role.EXPERT))
    assert handlers[("experts", Phase.RUN)] == worker._experts
    with pytest.raises(AttributeError, match="_attn"):
        bind_handlers(worker, role_phases(Role.ATTENTION))


def test_a_rank_communicates_in_issues_and_waits_and_computes_in_runs() -> None:
    assert not is_communicating(run(0, 0, "attn"))
    assert is_communicating(issue(0, 0, "dispatch")) and is_communicating(wait(0, 0, "combine"))
