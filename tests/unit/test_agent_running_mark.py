"""A command's ``running`` mark: the agent SDK sends it only when the command still runs
``RUNNING_MARK_AFTER`` after it started and has said nothing, so a command over sooner costs no
progress event (its result follows the claim). Real ``Agent`` and journal; the command queue's
side is recorded, not run (tests/e2e/test_cmdq_agents.py has the processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

from better_compute.agent import Command, Enrollment, call_failed
from better_compute.agent.journal import Journal
from better_compute.agent.runner import RUNNING_MARK_AFTER, Agent
from better_compute.crypto import new_agent_key
from better_compute.wire.agent import CommandDelivery


def _agent(tmp_path: Path, handlers: dict[str, Any]) -> tuple[Agent, list[tuple[float, str | None]]]:
    enrollment = Enrollment(
        agent_id="agent_site1", cert_id="cert_1", site_id="s1", tenant_id="root", role="site",
        certificate_pem="-----BEGIN CERTIFICATE-----\n", private_key=new_agent_key(),
    )  # fmt: skip
    agent = Agent(
        enrollment=enrollment, handlers=handlers, journal=Journal(tmp_path / "j.db", durable=False),
        nc=object(),  # type: ignore[arg-type]  # never used: progress is recorded below
    )  # fmt: skip
    said: list[tuple[float, str | None]] = []

    async def progress(command_id: str, message: str | None, percent: float | None) -> None:
        said.append((time.monotonic(), message))

    agent._progress = progress  # type: ignore[method-assign]
    return agent, said


async def _run(agent: Agent, command_id: str, kind: str) -> None:
    delivery = CommandDelivery(
        id=command_id, kind=kind, payload=msgspec.Raw(b"{}"), node_id="node_1", site_id="s1",
        agent_id="agent_site1", key=f"k-{command_id}", not_after_ms=int(time.time() * 1000) + 60_000,
    )  # fmt: skip
    assert agent.journal is not None
    assert await agent.journal.started(command_id, kind=kind, not_after=time.time() + 60)
    await agent._execute(delivery, None, structlog.get_logger(), claimed=time.monotonic())


async def test_a_command_over_within_the_second_says_nothing_before_its_result(tmp_path: Path) -> None:
    async def quick(command: Command) -> dict[str, str]:
        return {"powerState": "on"}

    agent, said = _agent(tmp_path, {"power.setPower": quick})
    await _run(agent, "cmd_quick", "power.setPower")
    await asyncio.sleep(RUNNING_MARK_AFTER * 1.5)  # past when its mark would have gone
    assert said == []
    assert agent.journal is not None
    entry = agent.journal.get("cmd_quick")
    assert entry is not None
    assert (entry.state, entry.status) == ("finished", "succeeded")


async def test_a_longer_command_is_marked_running_once_after_a_second(tmp_path: Path) -> None:
    async def slow(command: Command) -> None:
        await asyncio.sleep(RUNNING_MARK_AFTER * 2.5)

    agent, said = _agent(tmp_path, {"media.insert": slow})
    started = time.monotonic()
    await _run(agent, "cmd_slow", "media.insert")
    [(at, message)] = said
    assert message is None  # the mark: a progress with no word
    assert at - started >= RUNNING_MARK_AFTER * 0.9


async def test_a_command_that_said_a_word_first_needs_no_mark(tmp_path: Path) -> None:
    async def failing_then_answering(command: Command) -> None:
        await call_failed("unreachable", "connection refused", at="10.0.0.5:443")
        await asyncio.sleep(RUNNING_MARK_AFTER * 2.5)

    agent, said = _agent(tmp_path, {"power.setPower": failing_then_answering})
    await _run(agent, "cmd_words", "power.setPower")
    assert [m is not None and "BMC unreachable" in m for _, m in said] == [True]  # the news went, no mark
