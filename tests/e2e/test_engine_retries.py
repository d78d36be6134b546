"""Retry policies per step (issue 15 item 3): a failed attempt with a listed code runs again
after the backoff, as a new attempt; other codes fail the workflow; each attempt's error is kept
and shown by ``bcx workflows get``. The engine is its own process."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from better_compute.clients import EngineClient
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, refused
from better_compute.testing.agents import start_sim_agent
from better_compute.testing.workflows import wait_workflow
from engine_stack import sim_bmc


@pytest.fixture
def settings(bc_settings: Settings) -> Settings:
    return msgspec.structs.replace(bc_settings, app="engine_test_app:app")


def _t(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _profile(pid: str, step: dict[str, Any]) -> dict[str, Any]:
    return {"id": pid, "version": 1, "target": "metal", "role": "host", "steps": [{"use": "test.noop"}, step]}


async def test_listed_codes_are_retried_after_a_growing_backoff_and_others_fail_at_once(
    settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    bc_processes.settings = settings
    bc_processes.start("bc-engine")
    await bc_processes.wait_ready()
    engine = EngineClient(bc_api)
    policy = {"attempts": 3, "backoff": "1s", "maxBackoff": "1500ms", "on": ["CONFLICT"]}
    cases = {
        # fails twice with a listed code, then succeeds on attempt 3
        "retried": {"use": "test.failTimes", "with": {"times": 2, "code": "CONFLICT"}, "retry": policy},
        # a code the policy does not list fails the workflow on attempt 1
        "unlisted": {"use": "test.failTimes", "with": {"times": 2, "code": "INVALID_STATE"}, "retry": policy},
        # listed, but more failures than attempts
        "exhausted": {
            "use": "test.failTimes",
            "with": {"times": 5, "code": "CONFLICT"},
            "retry": {**policy, "attempts": 2},
        },
        # no policy in the profile: the step definition's default (3 attempts, 300 ms, UNAVAILABLE)
        "default": {"use": "test.flaky", "with": {"times": 2}},
        # no policy at all: fails on attempt 1
        "none": {"use": "test.failTimes", "with": {"times": 1, "code": "UNAVAILABLE"}},
        # a long backoff: `why` names it while the step waits
        "waiting": {
            "use": "test.failTimes",
            "with": {"times": 1, "code": "CONFLICT"},
            "retry": {**policy, "backoff": "10m", "maxBackoff": "10m"},
        },
    }
    started = {}
    for name, step in cases.items():
        await engine.create_profile(document=_profile(f"retry-{name}", step))
        started[name] = (await engine.start_workflow(profile_id=f"retry-{name}")).id
    waiting = started.pop("waiting")
    done = {name: await wait_workflow(engine, wf_id, timeout=30) for name, wf_id in started.items()}

    view = await engine.get_workflow(id=waiting)
    assert (view.state, view.steps[1].state, view.steps[1].attempt) == ("running", "pending", 1)
    assert view.steps[1].retry_at is not None
    why = await engine.why(id=waiting)
    assert "attempt 1 failed (CONFLICT: attempt 1 fails on purpose)" in why.answer
    assert "its retry policy starts attempt 2 in 9m" in why.answer
    assert why.reasons[0].kind == "retry-backoff"
    await engine.abort_workflow(id=waiting)

    retried = done["retried"]
    assert retried.state == "succeeded", retried
    step = retried.steps[1]
    assert (step.attempt, step.result) == (3, {"attempt": 3})
    assert [a["attempt"] for a in step.attempts] == [1, 2]
    assert [a["error"]["code"] for a in step.attempts] == ["CONFLICT", "CONFLICT"]
    assert step.attempts[0]["error"]["message"] == "attempt 1 fails on purpose"
    # the backoff, from the steps' own timestamps: 1 s, then doubled but capped at 1.5 s
    first_gap = _t(step.attempts[1]["startedAt"]) - _t(step.attempts[0]["finishedAt"])
    second_gap = _t(step.started_at) - _t(step.attempts[1]["finishedAt"])
    assert 1.0 <= first_gap < 1.45, first_gap
    assert 1.5 <= second_gap < 2.5, second_gap
    assert step.retry["attempts"] == 3
    assert step.retry["on"] == ["CONFLICT"]

    unlisted = done["unlisted"]
    assert unlisted.state == "failed"
    assert (unlisted.steps[1].attempt, unlisted.error["code"]) == (1, "INVALID_STATE")
    assert len(unlisted.steps[1].attempts) == 1

    exhausted = done["exhausted"]
    assert exhausted.state == "failed"
    assert exhausted.steps[1].attempt == 2
    assert [a["error"]["code"] for a in exhausted.steps[1].attempts] == ["CONFLICT", "CONFLICT"]
    assert "retryAt" in exhausted.steps[1].attempts[0]
    assert "retryAt" not in exhausted.steps[1].attempts[1]

    default = done["default"]
    assert default.state == "succeeded"
    assert default.steps[1].attempt == 3
    assert default.steps[1].retry["backoffMs"] == 300

    none = done["none"]
    assert (none.state, none.steps[1].attempt) == ("failed", 1)

    # an operator's retry counts attempts afresh: the exhausted step gets its policy's 2 again
    await engine.retry_workflow(id=exhausted.id)
    again = await wait_workflow(engine, exhausted.id, timeout=30)
    assert again.state == "failed"
    assert again.steps[1].attempt == 4
    assert len(again.steps[1].attempts) == 4

    # attempts shown by bcx, human and --json
    code, out, err = await bcx(settings, "workflows", "get", retried.id)
    assert code == 0, err
    assert "retry: 3 attempts, backoff 1s to 1500ms, on CONFLICT" in out
    lines = [line for line in out.splitlines() if line.strip().startswith("attempt ")]
    assert len(lines) == 2
    assert "CONFLICT: attempt 1 fails on purpose" in lines[0]
    assert "retried " in lines[0]
    code, out, err = await bcx(settings, "workflows", "get", retried.id, "--json")
    assert code == 0, err
    shown = json.loads(out)["steps"][1]
    assert [a["error"]["code"] for a in shown["attempts"]] == ["CONFLICT", "CONFLICT"]


async def test_a_retry_policy_is_validated_with_paths_and_only_for_retry_safe_steps(
    settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    bc_processes.settings = settings
    bc_processes.start("bc-engine")
    await bc_processes.wait_ready()
    engine = EngineClient(bc_api)
    retry = {"attempts": 3, "backoff": "soon"}
    bad = _profile("bad", {"use": "test.failTimes", "with": {"times": 1}, "retry": retry})
    err = await refused(engine.create_profile(document=bad))
    assert (err.code.value, err.path) == ("INVALID_CONFIG", "document.steps[1].retry.backoff")
    bad["steps"][1]["retry"] = {"attempts": 3, "backoff": "1s", "on": ["UNAVAILABLE", "TIMOUT"]}
    err = await refused(engine.create_profile(document=bad))
    assert err.path == "document.steps[1].retry.on[1]"
    assert "did you mean TIMEOUT" in err.message
    # test.noop is not retry_safe: a profile may not make it retry on its own
    unsafe = _profile("unsafe", {"use": "test.noop", "retry": {"attempts": 3, "backoff": "1s"}})
    checked = await engine.validate_profile(document=unsafe)
    assert not checked.valid
    assert [(p.path, p.code) for p in checked.problems] == [("document.steps[1].retry", "INVALID_INPUT")]
    assert "not retry-safe" in checked.problems[0].message
    # render shows the policy a step would run under
    ok = _profile("ok", {"use": "test.flaky", "with": {"times": 0}})
    rendered = await engine.render_profile(document=ok)
    assert rendered.steps[1].retry["attempts"] == 3


async def test_a_retried_agent_step_sends_a_new_command_under_its_new_attempts_key(
    settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient, tmp_path: Path
) -> None:
    bc_processes.settings = settings
    bc_processes.extra_env.update(BC_CMDQ_HEARTBEAT="200ms", BC_CMDQ_SWEEP="100ms")
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        bc_processes.start(name)
    await bc_processes.wait_ready()
    engine, cq = EngineClient(bc_api), CommandQueueClient(bc_api)
    sim, _agent = await start_sim_agent(
        settings, tmp_path / "agent", site_id="lab1", pki=PkiClient(bc_api), cq=cq,
        args=["--fail", "driver.invoke"],
    )  # fmt: skip
    try:
        node = await engine.create_node(site_id="lab1", bmc=sim_bmc())
        step = {"use": "netboot.clearEntry", "on": "site", "with": {"mac": "52:54:00:00:00:01"},
                "retry": {"attempts": 2, "backoff": "500ms", "on": ["DRIVER_ERROR"]}}  # fmt: skip
        await engine.create_profile(document=_profile("retry-agent", step))
        wf = await engine.start_workflow(profile_id="retry-agent", node_id=node.id)
        done = await wait_workflow(engine, wf.id, timeout=60)
        assert done.state == "failed"
        assert done.steps[1].attempt == 2
        assert [a["error"]["code"] for a in done.steps[1].attempts] == ["DRIVER_ERROR", "DRIVER_ERROR"]
        # each attempt its own command, under its own key; the second only after the first ended
        listed = (await cq.list_commands(workflow_id=wf.id, kind="driver.invoke")).commands
        first, second = sorted(listed, key=lambda c: c.created_at)
        assert (first.key, second.key) == (f"wf:{wf.id}:1#1", f"wf:{wf.id}:1#2")
        assert (first.state, second.state) == ("failed", "failed")
        assert second.created_at >= first.updated_at + 0.5
        assert len([line for line in sim.executions() if "driver.invoke" in line]) == 2
    finally:
        sim.close()
