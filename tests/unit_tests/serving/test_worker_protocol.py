"""The serving workers' messages: each record survives `encode` then `decode` field by field, and the wire forms
are the ones the workers exchange."""

from __future__ import annotations

import pytest
import torch

from mbridge_epoverlap.serving.workers.protocol import (
    ACTIVE,
    CONTINUE,
    IDLE,
    RESEND_TAG,
    STOP,
    Combine,
    Dispatch,
    ElasticControl,
    StepControl,
    decode_control,
    message_tag,
)


@pytest.mark.parametrize("active", [True, False])
def test_step_control_round_trips(active: bool) -> None:
    encoded = StepControl(active).encode()
    assert encoded.dtype == torch.int64 and encoded.tolist() == [ACTIVE if active else IDLE]
    assert StepControl.decode(encoded) == StepControl(active)
    assert decode_control(encoded) == StepControl(active)


@pytest.mark.parametrize("slots", [(0, 1, 2), (3, 2, 1, 0, 3, 2, 1, 0)])
def test_elastic_control_round_trips_whatever_its_table_size(slots: tuple[int, ...]) -> None:
    announced_slots = tuple(reversed(slots))
    control = ElasticControl(active=True, mask=0b101, layer=7, epoch=2, slots=slots, announced=3,
                             announced_slots=announced_slots)
    back = decode_control(control.encode())
    assert isinstance(back, ElasticControl)
    # Field by field: the table size moves every field after `slots`, which a reader by fixed index gets wrong.
    assert back.active is True and back.mask == 0b101 and back.layer == 7
    assert back.epoch == 2 and back.slots == slots
    assert back.announced == 3 and back.announced_slots == announced_slots
    assert back == control


def test_an_idle_elastic_control_decodes_idle() -> None:
    control = ElasticControl(active=False, mask=1, layer=0, epoch=0, slots=(0, 1), announced=0, announced_slots=(0, 1))
    assert decode_control(control.encode()).active is False


@pytest.mark.parametrize("length", [4, 6])
def test_an_elastic_control_of_a_wrong_length_is_refused(length: int) -> None:
    with pytest.raises(ValueError, match="5 \\+ 2"):
        ElasticControl.decode(torch.zeros(length, dtype=torch.int64))


def test_indexed_dispatch_round_trips() -> None:
    tokens = torch.randn(3, 4)
    ids = torch.tensor([5, 1, 6, 2], dtype=torch.int64)
    index = torch.tensor([0, 0, 1, 2], dtype=torch.int64)
    message = Dispatch(StepControl(True), tokens, ids, token_index=index)
    wire = message.encode()
    assert len(wire) == 4
    back = Dispatch.decode(wire)
    assert back.control == StepControl(True) and back.pairs == 4
    assert torch.equal(back.tokens, tokens) and torch.equal(back.expert_ids, ids)
    assert back.token_index is not None and torch.equal(back.token_index, index)


def test_row_per_pair_dispatch_round_trips_with_an_elastic_control() -> None:
    control = ElasticControl(active=True, mask=3, layer=1, epoch=0, slots=(0, 1, 0, 1), announced=1,
                             announced_slots=(1, 0, 1, 0))
    rows, ids = torch.randn(2, 4), torch.tensor([1, 0], dtype=torch.int64)
    wire = Dispatch(control, rows, ids).encode()
    assert len(wire) == 3
    back = Dispatch.decode(wire)
    assert back.control == control and back.token_index is None
    assert torch.equal(back.tokens, rows) and torch.equal(back.expert_ids, ids) and back.pairs == 2


def test_an_empty_dispatch_round_trips() -> None:
    back = Dispatch.decode(Dispatch(StepControl(False), torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64),
                                    token_index=torch.zeros(0, dtype=torch.int64)).encode())
    assert back.pairs == 0 and back.tokens.shape == (0, 4) and back.control.active is False


def test_a_dispatch_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="3 or 4 tensors"):
        Dispatch.decode([torch.zeros(1, dtype=torch.int64), torch.zeros(1)])


@pytest.mark.parametrize("stop", [True, False])
def test_combine_round_trips(stop: bool) -> None:
    outputs = torch.randn(5, 4)
    wire = Combine(stop, outputs).encode()
    assert wire[0].tolist() == [STOP if stop else CONTINUE]
    back = Combine.decode(wire)
    assert back.stop is stop and torch.equal(back.outputs, outputs)


def test_tags_are_unique_within_a_step_and_below_the_resend_tag() -> None:
    layers, m = 4, 3
    tags = {message_tag(layer, mb, m) for layer in range(layers) for mb in range(m)}
    assert len(tags) == layers * m and max(tags) < RESEND_TAG


def test_elastic_plans_ask_the_backend_class_what_it_can_do(tiny_mixtral_dir, prompts, monkeypatch):
    from mbridge_epoverlap.comm.m2n.shm import ShmCommunicator
    from mbridge_epoverlap.errors import UsageError
    from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec
    from tests.unit_tests.serving.engine_runs import requests_of

    plan = make_plan(load_spec(tiny_mixtral_dir), requests_of(prompts), expert_workers=2, backend="shm")
    assert make_elastic(plan, redundant=2, rejoin_after_steps=2).elastic
    monkeypatch.setattr(ShmCommunicator, "connects_late", False)
    with pytest.raises(UsageError, match="--backend shm cannot serve --rejoin-after-steps"):
        make_elastic(plan, redundant=2, rejoin_after_steps=2)
    assert make_elastic(plan, redundant=2).elastic  # without replacements, waits that resume are enough
    monkeypatch.setattr(ShmCommunicator, "resumable_wait", False)
    with pytest.raises(UsageError, match="--backend shm cannot serve --elastic"):
        make_elastic(plan, redundant=2)
