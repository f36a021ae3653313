"""The one switch that turns a skip for a missing dependency into a failure (`tests.unit_tests.requirements`)."""

from __future__ import annotations

import pytest

from tests.unit_tests.requirements import ENV_VAR, REQUIREMENTS, import_or_skip, require_or_skip, required_names


def test_a_required_dependency_fails_the_test_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "netns,mooncake")
    with pytest.raises(pytest.fail.Exception, match=f"no ip\n{ENV_VAR} requires 'mooncake': .*libibverbs1"):
        require_or_skip("mooncake", "no ip")


def test_a_dependency_not_required_skips_with_the_reason(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "netns")
    with pytest.raises(pytest.skip.Exception, match="^no mooncake$"):
        require_or_skip("mooncake", "no mooncake")
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(pytest.skip.Exception, match="^no ip$"):
        require_or_skip("netns", "no ip")


def test_all_requires_every_name_and_spaces_do_not_matter():
    assert required_names({ENV_VAR: "all"}) == frozenset(REQUIREMENTS)
    assert required_names({ENV_VAR: " slurm , megatron_core,"}) == {"slurm", "megatron_core"}
    assert required_names({}) == frozenset()


@pytest.mark.parametrize("value", ["mooncak", "slurm,gpu"])
def test_an_unknown_name_is_an_error_not_a_silent_no(value):
    with pytest.raises(ValueError, match=f"{ENV_VAR}=.*unknown name.*use a comma-separated list of mooncake"):
        required_names({ENV_VAR: value})


def test_a_test_cannot_skip_for_an_unlisted_name():
    with pytest.raises(ValueError, match="unknown requirement 'gpu': add it to REQUIREMENTS"):
        require_or_skip("gpu", "no GPU")


def test_import_or_skip_returns_the_module_or_goes_through_the_switch(monkeypatch):
    assert import_or_skip("json", "megatron_core").dumps([]) == "[]"
    monkeypatch.setenv(ENV_VAR, "megatron_core")
    with pytest.raises(pytest.fail.Exception, match="(?s)no_such_module does not import.*requires 'megatron_core'"):
        import_or_skip("no_such_module", "megatron_core")
    monkeypatch.setenv(ENV_VAR, "")
    with pytest.raises(pytest.skip.Exception, match="no_such_module does not import"):
        import_or_skip("no_such_module", "megatron_core")
