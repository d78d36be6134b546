"""A failing BMC try is its command's progress (issue 26 item 1): the agent SDK's wording and
coalescing, both drivers' reports against a closed port (real sushy, real pyghmi), and what
``bcx why`` and the watch line make of it. tests/e2e/test_bmc_failures.py drives the processes."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace
from typing import Any

import pytest

from bc_engine.why import WhyApi
from bc_site_agent.drivers import BmcCredentials, make_driver
from better_compute.agent import call_answered, call_failed, runner
from better_compute.agent.runner import PROGRESS_INTERVAL, Agent, _Run
from better_compute.cli.rollout import _step_text
from better_compute.core.errors import BcError
from better_compute.runtime.embedded import free_port
from better_compute.testing import until
from better_compute.wire.agent import call_failure_text, is_call_failure
from better_compute.wire.cmdq import CommandView
from better_compute.wire.engine import CurrentStep, CurrentWorkflow
from better_compute.wire.metal import NodeBmc

FAILING = re.compile(
    r"^BMC unreachable at 127\.0\.0\.1:\d+: connection refused, (\d+) tr(y|ies) since \d\d:\d\d:\d\d UTC$"
)


class _Sent:
    """An agent with one running command whose progress events are recorded, not published."""

    def __init__(self) -> None:
        self.agent = object.__new__(Agent)
        self.agent._runs = {"cmd_1": _Run()}
        self.agent._tasks = set()
        self.agent._work = asyncio.Event()  # what wakes an idle agent's heartbeat pause
        self.events: list[tuple[float, str | None]] = []

        async def progress(command_id: str, message: str | None, percent: float | None) -> None:
            self.events.append((time.monotonic(), message))

        self.agent._progress = progress  # type: ignore[method-assign]

    def enter(self) -> None:
        runner._CURRENT.set((self.agent, "cmd_1", asyncio.get_running_loop()))


async def test_failing_tries_are_one_progress_a_second_naming_the_bmc_tries_and_since() -> None:
    sent = _Sent()
    sent.enter()
    for _ in range(5):
        await call_failed("unreachable", "connection refused", at="127.0.0.1:1234")
    await until(lambda: sent.events)
    first_at, first = sent.events[0]
    assert first is not None
    assert FAILING.match(first), first
    assert " 1 try since " in first, first
    await until(lambda: len(sent.events) == 2, timeout=5)
    later_at, later = sent.events[1]
    assert later is not None
    assert " 5 tries since " in later, later  # the latest word, not each try
    assert later_at - first_at >= PROGRESS_INTERVAL * 0.9
    [(text, since)] = sent.agent.call_failures()
    assert text == later
    assert abs(since - time.time()) < 5

    await call_answered()
    assert sent.agent.call_failures() == []  # the agent's last error clears at once
    await until(lambda: len(sent.events) == 3, timeout=5)
    assert not is_call_failure(sent.events[2][1]), sent.events


async def test_a_plain_try_does_not_hide_a_failure_that_lasts() -> None:
    sent = _Sent()
    sent.enter()

    async def nobody_cancelled(kind: str, event: Any, timeout: float) -> Any:
        return {"stop": []}

    sent.agent._told_cancel = set()
    sent.agent._base = lambda: {"site": "lab1", "agent": "agent_a", "signer_id": "cert_1", "signed_at_ms": 1}  # type: ignore[method-assign]
    sent.agent._request = nobody_cancelled  # type: ignore[method-assign,assignment]
    await call_failed("error", "HTTP 503 (GET System)", at="10.0.0.5")
    await sent.agent._before_call("cmd_1", "GET System")  # the retry: its try is not the news
    await until(lambda: sent.events)
    await asyncio.sleep(PROGRESS_INTERVAL * 1.2)
    assert [m for _, m in sent.events] == [
        "BMC answers with errors at 10.0.0.5: HTTP 503 (GET System), 1 try since "
        + time.strftime("%H:%M:%S", time.gmtime(sent.agent._runs["cmd_1"].failure.since))  # type: ignore[union-attr]
        + " UTC"
    ]


def test_the_failure_wording_is_what_readers_recognise() -> None:
    text = call_failure_text("unreachable", "connection refused", at="127.0.0.1:1234", tries=12, since=0)
    assert text == "BMC unreachable at 127.0.0.1:1234: connection refused, 12 tries since 00:00:00 UTC"
    assert is_call_failure(text)
    assert not is_call_failure("try 3: GET System.PowerState")
    assert not is_call_failure(None)


class _Recorder:
    """The running command as a driver sees it: what its retry loop reported."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, str, str]] = []
        self.answered = 0

    async def _before_call(self, command_id: str, call: str) -> None:
        return None

    def _call_failed(self, command_id: str, kind: str, reason: str, at: str) -> None:
        self.failed.append((kind, reason, at))

    def _call_answered(self, command_id: str) -> None:
        self.answered += 1


async def test_the_redfish_driver_reports_a_refused_bmc_on_each_try() -> None:
    port = free_port()  # nothing listens
    seen = _Recorder()
    runner._CURRENT.set((seen, "cmd_1", asyncio.get_running_loop()))  # type: ignore[arg-type]
    driver = make_driver(
        NodeBmc(driver="redfish", address=f"http://127.0.0.1:{port}"),
        BmcCredentials(username="admin", password="pw-never-said"),
    )
    with pytest.raises(BcError) as err:
        await driver.inventory(deadline=time.time() + 1.5)
    assert "connection refused" in str(err.value)
    assert len(seen.failed) >= 2
    assert set(seen.failed) == {("unreachable", "connection refused", f"127.0.0.1:{port}")}
    assert "pw-never-said" not in repr(seen.failed)


@pytest.mark.timeout(30)
async def test_the_ipmi_driver_reports_a_bmc_that_never_answers() -> None:
    """pyghmi gives up a login nobody answered with no words (``IpmiException(None)``): that
    is a BMC that is away (tried again), not an IPMI error that ends the command at once."""
    port = free_port()
    seen = _Recorder()
    runner._CURRENT.set((seen, "cmd_1", asyncio.get_running_loop()))  # type: ignore[arg-type]
    driver = make_driver(
        NodeBmc(driver="ipmi", address=f"127.0.0.1:{port}"), BmcCredentials(username="u", password="p")
    )
    with pytest.raises(BcError) as err:
        await driver.inventory(deadline=time.time() + 1.0)
    assert "did not answer in time" in str(err.value), err.value
    assert seen.failed == [("unreachable", "no answer (timed out)", f"127.0.0.1:{port}")]


async def test_bcx_why_leads_with_the_failing_bmc() -> None:
    failing = call_failure_text("unreachable", "connection refused", at="10.0.0.5:443", tries=3, since=0)
    cmd = CommandView(
        id="cmd_1", node_id="node_1", site_id="lab1", kind="power.setPower", key="wf:wf_1:0#1",
        state="running", target="site", created_at=time.time(), updated_at=time.time(),
        agent_id="agent_a", progress=failing,
    )  # fmt: skip
    part = await WhyApi(db=None, cmdq=None)._command(cmd)  # type: ignore[arg-type]
    assert part.kind == "bmc-failing"
    assert part.text.startswith(failing)
    assert part.facts["progress"] == failing


def test_the_watch_line_shows_the_failing_bmc_whole() -> None:
    failing = call_failure_text(
        "unreachable", "connection refused", at="bmc-rack12-u07.example.net:443", tries=12, since=0
    )
    wf = CurrentWorkflow(
        id="wf_1", state="running", profile_id="p", batch_id=None,
        step=CurrentStep(index=0, action="power.setPower"),
        waiting_for={"reason": "bmc-failing", "message": failing, "commandId": "cmd_1"},
    )  # fmt: skip
    node: Any = SimpleNamespace(current_workflow=wf)  # what the watch reads of a NodeView
    assert _step_text(node) == f"0 power.setPower (waits: {failing})"
