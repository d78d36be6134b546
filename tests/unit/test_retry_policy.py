"""Retry policies: how a profile step and a step definition say when a failed attempt runs again,
refused with the path of the bad field like every other profile field."""

from __future__ import annotations

from typing import Any

import pytest

from better_compute.core import manifest
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import define_profile, define_step, parse_retry, step_not_ready


async def _run(_input: dict[str, Any], _ctx: Any) -> None:
    return None


def _profile(retry: Any) -> Any:
    return define_profile(
        id="p", version=1, target="metal", role="host",
        steps=[{"use": "a.b"}, {"use": "a.c"}, {"use": "a.d", "retry": retry}],
    )  # fmt: skip


def test_a_profile_step_keeps_its_retry_policy_and_writes_it_back() -> None:
    retry = {"attempts": 3, "backoff": "1s", "maxBackoff": "4s", "on": ["CONFLICT", "UNAVAILABLE"]}
    profile = _profile(retry)
    policy = profile.steps[2].retry
    assert policy is not None
    assert (policy.attempts, policy.backoff_ms, policy.max_backoff_ms, policy.on) == (
        3, 1000, 4000, ("CONFLICT", "UNAVAILABLE"),
    )  # fmt: skip
    assert profile.to_document()["steps"][2]["retry"] == retry
    # the backoff doubles per failure, never above maxBackoff
    assert [policy.delay_ms(n) for n in (1, 2, 3, 4)] == [1000, 2000, 4000, 4000]
    assert policy.retries("CONFLICT", 2)
    assert not policy.retries("CONFLICT", 3)
    assert not policy.retries("INVALID_INPUT", 1)


def test_defaults_fill_max_backoff_and_codes() -> None:
    policy = parse_retry({"attempts": 2, "backoff": "2s"}, "retry")
    assert (policy.max_backoff, policy.on) == ("5m", ("UNAVAILABLE", "TIMEOUT", "DRIVER_ERROR"))


@pytest.mark.parametrize(
    ("retry", "path"),
    [
        ("3 times", "steps[2].retry"),
        ({"attempts": 3}, "steps[2].retry.backoff"),
        ({"attempts": 3, "backoff": "soon"}, "steps[2].retry.backoff"),
        ({"attempts": 3, "backoff": "0s"}, "steps[2].retry.backoff"),
        ({"attempts": 0, "backoff": "1s"}, "steps[2].retry.attempts"),
        ({"attempts": True, "backoff": "1s"}, "steps[2].retry.attempts"),
        ({"attempts": 101, "backoff": "1s"}, "steps[2].retry.attempts"),
        ({"attempts": 2, "backoff": "10s", "maxBackoff": "1s"}, "steps[2].retry.maxBackoff"),
        ({"attempts": 2, "backoff": "1s", "on": []}, "steps[2].retry.on"),
        ({"attempts": 2, "backoff": "1s", "on": ["TIMEOUT", "TIMOUT"]}, "steps[2].retry.on[1]"),
        ({"attempts": 2, "backoff": "1s", "on": ["TIMEOUT", "TIMEOUT"]}, "steps[2].retry.on[1]"),
        ({"attempts": 2, "backoff": "1s", "max_backoff": "2s"}, "steps[2].retry.max_backoff"),
    ],
)
def test_a_bad_retry_policy_is_refused_at_its_path(retry: Any, path: str) -> None:
    with pytest.raises(BcError) as exc:
        _profile(retry)
    assert exc.value.code is ErrorCode.INVALID_CONFIG
    assert exc.value.path == path


def test_an_unknown_code_names_the_closest_one() -> None:
    with pytest.raises(BcError, match="did you mean TIMEOUT"):
        parse_retry({"attempts": 2, "backoff": "1s", "on": ["TIMOUT"]}, "retry")


def test_a_step_definition_carries_a_default_policy_only_when_retry_safe() -> None:
    step = define_step(
        id="a.b", runs_on="control-plane", timeout="1m", input=manifest({}), run=_run,
        retry_safe=True, retry={"attempts": 4, "backoff": "500ms", "on": ["DRIVER_ERROR"]},
    )  # fmt: skip
    assert step.retry is not None
    assert step.retry.attempts == 4
    assert step.retry.on == ("DRIVER_ERROR",)
    with pytest.raises(BcError) as exc:
        define_step(
            id="a.b", runs_on="control-plane", timeout="1m", input=manifest({}), run=_run,
            retry={"attempts": 4, "backoff": "500ms"},
        )  # fmt: skip
    assert (exc.value.code, exc.value.path) == (ErrorCode.INVALID_CONFIG, "retry")
    with pytest.raises(BcError) as exc:
        define_step(
            id="a.b", runs_on="control-plane", timeout="1m", input=manifest({}), run=_run,
            retry_safe=True, retry={"attempts": 4, "backoff": "later"},
        )  # fmt: skip
    assert exc.value.path == "retry.backoff"


def test_step_not_ready_carries_its_reason() -> None:
    nr = step_not_ready(2000, reason="no DHCP lease for 52:54:00:00:00:01 yet")
    assert (nr.retry_after_ms, nr.reason) == (2000, "no DHCP lease for 52:54:00:00:00:01 yet")
    assert step_not_ready().reason is None
    with pytest.raises(BcError) as exc:
        step_not_ready(10, reason="x" * 301)
    assert exc.value.path == "reason"
