"""define_step shape checks, step_not_ready and step_command_key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from better_compute.core import BcError, ErrorCode, field, manifest
from better_compute.provision import (
    StepNotReady,
    define_step,
    step_command_key,
    step_not_ready,
)

pytestmark = pytest.mark.unit

INVALID_CONFIG = ErrorCode.INVALID_CONFIG
INVALID_INPUT = ErrorCode.INVALID_INPUT
PORT = manifest({"port": field.int(min=1, max=65535).default(50000)})


def refusal(fn: Callable[[], object]) -> tuple[ErrorCode, str | None]:
    with pytest.raises(BcError) as info:
        fn()
    return info.value.code, info.value.path


async def run(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {"port": input["port"]}


def sync_run(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {}


CONTROL_PLANE: dict[str, Any] = {
    "id": "wait.talosReady",
    "runs_on": "control-plane",
    "timeout": "20m",
    "input": PORT,
    "run": run,
}
AGENT: dict[str, Any] = {
    "id": "power.setPower",
    "runs_on": "site",
    "timeout": "2m",
    "input": manifest({"action": field.enum(["on", "off", "cycle"])}),
    "command": "power.setPower",
}


def test_a_relaying_step_is_returned_frozen() -> None:
    relays = ["site"]
    step = define_step(**CONTROL_PLANE, relays=relays, sends=["site.httpProxy"], retry_safe=True)
    relays.append("node")
    assert step.extension == "step"
    assert step.timeout_ms == 20 * 60_000
    assert step.relays == ("site",)
    assert step.sends == ("site.httpProxy",)
    assert not step.is_agent_step
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.timeout = "1m"  # type: ignore[misc]


def test_on_must_match_runs_on_or_a_relay() -> None:
    relaying = define_step(**CONTROL_PLANE, relays=["site"])
    assert relaying.accepts(None)
    assert relaying.accepts("site")
    assert relaying.accepts("control-plane")
    assert not relaying.accepts("node")
    agent = define_step(**AGENT)
    assert agent.is_agent_step
    assert agent.accepts("site")
    assert not agent.accepts("node")


def test_an_object_with_async_call_is_a_valid_run() -> None:
    class Runner:
        async def __call__(self, input: dict[str, Any], ctx: Any) -> None:
            return None

    assert define_step(**{**CONTROL_PLANE, "run": Runner()}).run is not None


# Every refusal rule of define_step: (overrides of a valid step, expected details.path).
CONTROL_PLANE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"id": "autoinstall"}, "id"),  # one segment
    ({"id": "Autoinstall.renderIso"}, "id"),
    ({"id": "autoinstall.render_iso"}, "id"),
    ({"id": "autoinstall."}, "id"),
    ({"id": "autoinstall.renderIso\n"}, "id"),
    ({"id": 7}, "id"),
    ({"runs_on": "worker"}, "runs_on"),
    ({"runs_on": None}, "runs_on"),
    ({"timeout": "5 minutes"}, "timeout"),
    ({"timeout": "0s"}, "timeout"),
    ({"timeout": 300}, "timeout"),
    ({"input": {"port": field.int()}}, "input"),
    ({"input": None}, "input"),
    ({"run": None}, "run"),
    ({"run": sync_run}, "run"),
    ({"command": "power.setPower"}, "command"),
    ({"relays": "site"}, "relays"),
    ({"relays": ["bmc"]}, "relays[0]"),
    ({"relays": ["control-plane"]}, "relays[0]"),
    ({"relays": ["site", "site"]}, "relays[1]"),
    ({"sends": "site.httpProxy"}, "sends"),
    ({"sends": ["httpProxy"]}, "sends[0]"),
    ({"sends": ["site.httpProxy", "site.httpProxy"]}, "sends[1]"),
    ({"retry_safe": "yes"}, "retry_safe"),
    ({"description": 3}, "description"),
]


@pytest.mark.parametrize(("overrides", "path"), CONTROL_PLANE_REFUSALS)
def test_control_plane_step_refusals(overrides: dict[str, Any], path: str) -> None:
    assert refusal(lambda: define_step(**{**CONTROL_PLANE, **overrides})) == (INVALID_CONFIG, path)


AGENT_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"command": None}, "command"),
    ({"command": "setPower"}, "command"),
    ({"command": ""}, "command"),
    ({"run": run}, "run"),
    ({"sends": ["site.httpProxy"]}, "sends"),  # the page: no sends on an agent step
    ({"relays": ["site"]}, "relays"),
    ({"runs_on": "node", "timeout": "forever"}, "timeout"),
]


@pytest.mark.parametrize(("overrides", "path"), AGENT_REFUSALS)
def test_agent_step_refusals(overrides: dict[str, Any], path: str) -> None:
    assert refusal(lambda: define_step(**{**AGENT, **overrides})) == (INVALID_CONFIG, path)


def test_step_not_ready_defaults_to_five_seconds() -> None:
    with pytest.raises(StepNotReady) as info:
        raise step_not_ready()
    assert info.value.retry_after_ms == 5_000
    assert step_not_ready(2_000).retry_after_ms == 2_000


def test_step_not_ready_is_not_an_error() -> None:
    # A step's `except BcError` must not swallow the wait signal.
    assert not isinstance(step_not_ready(), BcError)


@pytest.mark.parametrize("ms", [0, -1, 1.5, True, "5000", None])
def test_step_not_ready_takes_positive_whole_milliseconds(ms: Any) -> None:
    assert refusal(lambda: step_not_ready(ms)) == (INVALID_INPUT, "ms")


CTX = SimpleNamespace(workflow_id="wf_01J0000000000000000000000A", step=3, attempt=2)


def test_step_command_key_is_per_attempt() -> None:
    assert step_command_key(CTX) == "wf:wf_01J0000000000000000000000A:3#2"
    assert step_command_key(CTX, "boot-device") == "wf:wf_01J0000000000000000000000A:3#2:boot-device"
    retried = SimpleNamespace(workflow_id=CTX.workflow_id, step=3, attempt=3)
    assert step_command_key(retried, "boot-device") != step_command_key(CTX, "boot-device")


@pytest.mark.parametrize("key", ["", "a:b", "a b", "x" * 65, 5])
def test_step_command_key_refuses_malformed_keys(key: Any) -> None:
    assert refusal(lambda: step_command_key(CTX, key)) == (INVALID_INPUT, "key")
