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
from better_compute.agent.runner import PROGRESS_INTERVAL, TRY_WORD_INTERVAL, Agent, _Run
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

    def checks(self, stop: list[str]) -> list[str]:
        """The command queue answers each check with ``stop`` (as it is then); what was asked."""
        asked: list[str] = []

        async def check(kind: str, event: Any, timeout: float) -> Any:
            asked.append(kind)
            return {"stop": list(stop)}

        self.agent._told_cancel = set()
        base = {"site": "lab1", "agent": "agent_a", "signer_id": "cert_1", "signed_at_ms": 1}
        self.agent._base = lambda: base  # type: ignore[method-assign]
        self.agent._request = check  # type: ignore[method-assign,assignment]
        self.agent.log = SimpleNamespace(info=lambda *a, **k: None)
        return asked


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


async def test_a_command_over_before_its_try_words_turn_says_no_word_a_longer_one_does() -> None:
    sent = _Sent()
    sent.enter()
    sent.checks([])  # nobody cancels
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False)  # its running mark just went out
    await sent.agent._before_call("cmd_1", "GET System")
    del sent.agent._runs["cmd_1"]  # it ended (before its try word's turn): its result is on its way
    await asyncio.sleep(TRY_WORD_INTERVAL * 1.2)  # past when its word was due
    assert sent.events == []

    started = time.monotonic()
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False)
    await sent.agent._before_call("cmd_1", "GET System")
    await sent.agent._before_call("cmd_1", "PATCH System")
    await until(lambda: sent.events, timeout=TRY_WORD_INTERVAL + 5)
    [(at, word)] = sent.events
    assert word == "try 2: PATCH System"  # the latest word, at its turn after the running mark
    assert at - started >= TRY_WORD_INTERVAL * 0.9


async def test_news_of_a_failing_call_does_not_wait_for_a_try_words_turn() -> None:
    """A try word waits ``TRY_WORD_INTERVAL``; a call that fails is said within
    ``PROGRESS_INTERVAL`` all the same, once, in the try word's place."""
    sent = _Sent()
    sent.enter()
    sent.checks([])
    started = time.monotonic()
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False)
    await sent.agent._before_call("cmd_1", "POST Reset")  # a try word: its turn is 3 s away
    await call_failed("unreachable", "connection refused", at="10.0.0.5:443")
    await until(lambda: sent.events, timeout=TRY_WORD_INTERVAL + 5)
    [(at, word)] = sent.events
    assert is_call_failure(word), word
    assert PROGRESS_INTERVAL * 0.9 <= at - started < TRY_WORD_INTERVAL, at - started
    await asyncio.sleep(TRY_WORD_INTERVAL + 0.5 - (time.monotonic() - started))  # the try word's turn
    assert len(sent.events) == 1, sent.events  # its turn went with the news


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


async def test_a_tries_first_request_takes_the_tries_check_and_a_cancel_still_stops_the_next() -> None:
    sent = _Sent()
    sent.enter()
    stop: list[str] = []
    asked = sent.checks(stop)

    def request(call: str) -> None:  # what the Redfish driver's HTTP adapter does, in a thread
        runner.before_call_blocking(call)

    await runner.before_call("power on")  # the try: asks the command queue
    await asyncio.to_thread(request, "GET System")  # nothing sent since: that answer holds
    assert asked == ["check"]
    stop.append("cmd_1")  # cancelled while the GET was out
    with pytest.raises(runner.CommandCancelled):
        await asyncio.to_thread(request, "POST Reset")  # a request went out since: asks again
    assert asked == ["check", "check"]


async def test_reads_ask_nothing_the_first_change_takes_the_tries_check_a_known_cancel_stops_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redfish action is a GET or three, then the POST or PATCH: each request asked the command
    queue (deploy: 19 checks for 5 commands). Only a request that changes the BMC must never go
    after a cancel; a read asks nothing, and stops on a cancel the agent knows of."""
    monkeypatch.setattr(runner, "_TRY_CHECK_FOR", 60.0)  # a loaded machine's thread hops count not
    sent = _Sent()
    sent.enter()
    stop: list[str] = []
    asked = sent.checks(stop)

    def request(method: str, path: str) -> None:  # what the Redfish driver's HTTP adapter does
        runner.before_call_blocking(f"{method} {path}", changes=method not in ("GET", "HEAD"))

    await runner.before_call("set boot device")  # the try: asks the command queue
    await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1")
    await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1/Bios")
    assert asked == ["check"]  # the reads asked nothing
    await asyncio.to_thread(request, "PATCH", "/redfish/v1/Systems/1")  # the try's answer holds
    assert asked == ["check"]
    stop.append("cmd_1")  # cancelled now
    with pytest.raises(runner.CommandCancelled):
        await asyncio.to_thread(request, "POST", "/redfish/v1/Systems/1/Actions/Reset")  # asks again
    assert asked == ["check", "check"]
    with pytest.raises(runner.CommandCancelled):  # known now: a read stops too, asking nothing
        await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1")
    assert asked == ["check", "check"]


async def test_the_first_try_within_a_second_of_the_claim_takes_the_claim_as_its_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim (``ack``) the command queue just let through said "not cancelled", as a check
    says: the first try within ``_TRY_CHECK_FOR`` of it and that try's first change ask nothing.
    A later try asks; a cancel the agent knows of stops the first try all the same; a claim
    older than a second is no answer (the try asks)."""
    monkeypatch.setattr(runner, "_TRY_CHECK_FOR", 60.0)  # a loaded machine's thread hops count not
    sent = _Sent()
    sent.enter()
    stop: list[str] = []
    asked = sent.checks(stop)
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic())

    def request(method: str, path: str) -> None:  # what the Redfish driver's HTTP adapter does
        runner.before_call_blocking(f"{method} {path}", changes=method not in ("GET", "HEAD"))

    await runner.before_call("set power on")  # the first try: the claim answers for it
    await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1")
    await asyncio.to_thread(request, "POST", "/redfish/v1/Systems/1/Actions/Reset")
    assert asked == []
    await asyncio.to_thread(request, "POST", "/redfish/v1/Systems/1/Actions/Reset")  # a second change
    assert asked == ["check"]
    await runner.before_call("set power on")  # the second try
    assert asked == ["check", "check"]

    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic())
    sent.agent._told_cancel.add("cmd_1")  # heard of (a heartbeat's answer) after the claim
    with pytest.raises(runner.CommandCancelled):
        await runner.before_call("set power on")
    assert asked == ["check", "check"]

    sent.agent._told_cancel.clear()
    monkeypatch.setattr(runner, "_TRY_CHECK_FOR", 1.0)
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic() - 2.0)
    stop.append("cmd_1")  # cancelled in the two seconds since the claim
    with pytest.raises(runner.CommandCancelled):
        await runner.before_call("set power on")
    assert asked == ["check", "check", "check"]

    stop.clear()  # no try-level call: the first change takes a fresh claim itself
    monkeypatch.setattr(runner, "_TRY_CHECK_FOR", 60.0)
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic())
    await asyncio.to_thread(request, "PATCH", "/redfish/v1/Systems/1")
    assert asked == ["check", "check", "check"]


async def test_a_try_whose_requests_are_checked_asks_only_before_the_request_that_changes() -> None:
    """The Redfish driver's tries (``requests_checked``): the try asks nothing, a read asks
    nothing, the request that changes the machine asks right before it goes; a cancel the queue
    answers there stops it; one the agent knows of stops the try itself; a claim still fresh at
    the change answers for it."""
    sent = _Sent()
    sent.enter()
    stop: list[str] = []
    asked = sent.checks(stop)
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic() - 5.0)

    def request(method: str, path: str) -> None:  # what the Redfish driver's HTTP adapter does
        runner.before_call_blocking(f"{method} {path}", changes=method not in ("GET", "HEAD"))

    await runner.before_call("power state", requests_checked=True)  # a try that only reads
    await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1")
    assert asked == []
    await runner.before_call("set power on", requests_checked=True)
    await asyncio.to_thread(request, "GET", "/redfish/v1/Systems/1")
    assert asked == []
    await asyncio.to_thread(request, "POST", "/redfish/v1/Systems/1/Actions/Reset")
    assert asked == ["check"]  # one check for the change, none for the try

    stop.append("cmd_1")  # cancelled now: the next change is stopped by its own check
    await runner.before_call("set power on", requests_checked=True)
    with pytest.raises(runner.CommandCancelled):
        await asyncio.to_thread(request, "POST", "/redfish/v1/Systems/1/Actions/Reset")
    assert asked == ["check", "check"]

    stop.clear()
    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic())
    sent.agent._told_cancel.add("cmd_1")  # a cancel the agent heard of stops the try, asking nothing
    with pytest.raises(runner.CommandCancelled):
        await runner.before_call("set power on", requests_checked=True)
    sent.agent._told_cancel.clear()

    sent.agent._runs["cmd_1"] = _Run.starting(cancelled=False, claimed=time.monotonic())
    await runner.before_call("set boot device", requests_checked=True)
    await asyncio.to_thread(request, "PATCH", "/redfish/v1/Systems/1")  # the fresh claim answers
    assert asked == ["check", "check"]


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
        self.tries: list[bool] = []
        """Each try's ``requests_checked``: whether its requests ask the command queue themselves."""

    async def _before_call(self, command_id: str, call: str, **how: bool) -> None:
        requests_checked = how.get("requests_checked", False)
        if not how.get("request", False):
            self.tries.append(requests_checked)

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
    assert seen.tries
    assert all(seen.tries)  # its HTTP adapter asks before each change: the tries do not


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
    assert seen.tries
    assert not any(seen.tries)  # pyghmi's requests are not checked: each try asks


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


async def test_progress_words_waiting_their_turn_take_no_commands_place() -> None:
    """A word waiting its turn is a task of the agent's; the agent counted every task against
    ``max_concurrency``, so words of commands that had ended kept new ones waiting."""
    agent = object.__new__(Agent)
    agent._stop, agent._rehello, agent._work = asyncio.Event(), asyncio.Event(), asyncio.Event()
    agent._tasks, agent._commands = set(), set()
    agent.max_concurrency, agent.fetch_timeout = 2, 20.0
    asked: list[int] = []
    running = asyncio.Event()

    async def fetch(batch: int) -> list[object]:
        asked.append(batch)
        if len(asked) > 1:
            agent._stop.set()
            raise TimeoutError
        return [object()] * batch

    async def handle(_msg: object) -> None:
        running.set()

    agent._fetch = fetch  # type: ignore[method-assign,assignment]
    agent._handle = handle  # type: ignore[method-assign,assignment]
    for _ in range(3):  # three words due later (their commands have ended)
        agent._spawn(asyncio.sleep(30))
    try:
        async with asyncio.timeout(5):
            await agent._pull()
        assert asked == [2, 2], asked  # both places free for commands, each time
        assert running.is_set()
    finally:
        for task in agent._tasks:
            task.cancel()
        await asyncio.gather(*agent._tasks, return_exceptions=True)
