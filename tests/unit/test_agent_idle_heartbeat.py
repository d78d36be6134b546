"""Issue 25: a machine's agent with nothing to do heartbeats every ``idle_heartbeat_ms`` and
says so; work (a delivery, a cancel, a re-run, an unreported journal entry) brings the busy
cadence back at once. The queue side (each agent's silence from the gap it announced) is in
tests/integration/test_cmdq_store_contract.py; both with real processes in
tests/e2e/test_cmdq_agents.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from better_compute.agent import Enrollment
from better_compute.agent.journal import Journal
from better_compute.agent.runner import Agent
from better_compute.crypto import new_agent_key
from better_compute.testing import until
from better_compute.wire.agent import AgentEvent, Heartbeat

BUSY_MS = 50
IDLE_MS = 60_000  # never waited out here: a test that needs it times out instead


class _Queue:
    """Answers the agent's heartbeats and keeps the gap each announced."""

    def __init__(self) -> None:
        self.gaps: list[int] = []
        self.cancel: list[str] = []

    async def request(self, kind: str, event: AgentEvent, *, timeout: float | None = None) -> Any:
        assert kind == "heartbeat"
        assert isinstance(event, Heartbeat)
        self.gaps.append(event.next_heartbeat_ms)
        return {"bootLease": False, "cancel": self.cancel}


def _agent(tmp_path: Path, role: str, queue: _Queue, *, idle_ms: int = IDLE_MS) -> Agent:
    enrollment = Enrollment(
        agent_id="node_1", cert_id="cert_1", site_id="s1", tenant_id="root", role=role,
        certificate_pem="-----BEGIN CERTIFICATE-----\n", private_key=new_agent_key(),
    )  # fmt: skip
    agent = Agent(
        enrollment=enrollment, handlers={}, journal=Journal(tmp_path / f"{role}.db", durable=False),
        nc=object(),  # type: ignore[arg-type]  # never used: the queue's answers are _Queue's
    )  # fmt: skip
    agent.heartbeat_ms, agent.idle_heartbeat_ms = BUSY_MS, idle_ms  # as the hello reply says
    agent._request = queue.request  # type: ignore[method-assign]
    return agent


async def _heartbeats(agent: Agent) -> asyncio.Task[None]:
    return asyncio.create_task(agent._heartbeats(), name="heartbeats")


async def test_an_idle_machine_says_its_long_gap_and_work_brings_the_short_cadence_back_at_once(
    tmp_path: Path,
) -> None:
    queue = _Queue()
    agent = _agent(tmp_path, "node", queue)
    beats = await _heartbeats(agent)
    try:
        # the first heartbeat after a hello comes at the usual cadence (the hello said no
        # longer gap), and says the long one: nothing to do
        await until(lambda: queue.gaps == [IDLE_MS])
        # a delivery arrives in the middle of the long pause: the agent heartbeats at once and
        # keeps the short cadence while the work lasts
        done = asyncio.Event()
        agent._spawn(done.wait())
        await until(lambda: len(queue.gaps) >= 4)
        assert queue.gaps[1:4] == [BUSY_MS] * 3
        done.set()
        await until(lambda: queue.gaps[-1] == IDLE_MS)
        settled = len(queue.gaps)
        # a command started and never reported (its process died) is work too
        assert agent.journal is not None
        await agent.journal.started("cmd_1", kind="node.inventory", not_after=time.time() + 60)
        agent._work.set()
        await until(lambda: len(queue.gaps) >= settled + 2)
        assert queue.gaps[settled : settled + 2] == [BUSY_MS, BUSY_MS]
    finally:
        agent.request_stop()
        await beats
        assert agent.journal is not None
        agent.journal.close()


async def test_a_cancel_in_a_heartbeat_reply_keeps_the_short_cadence_until_it_is_handled(
    tmp_path: Path,
) -> None:
    queue = _Queue()
    agent = _agent(tmp_path, "provisioned", queue)
    hold = asyncio.Event()

    async def cancel_reached(command_ids: list[str], *, via: str) -> None:
        await hold.wait()

    agent._cancel_reached = cancel_reached  # type: ignore[method-assign]
    queue.cancel = ["cmd_9"]
    beats = await _heartbeats(agent)
    try:
        await until(lambda: len(queue.gaps) >= 3)
        assert queue.gaps[1:3] == [BUSY_MS, BUSY_MS]  # the reply's cancel is work
        queue.cancel = []
        hold.set()
        await until(lambda: queue.gaps[-1] == IDLE_MS)
    finally:
        agent.request_stop()
        await beats
        assert agent.journal is not None
        agent.journal.close()


@pytest.mark.parametrize(("role", "idle_ms"), [("site", IDLE_MS), ("node", 0)])
async def test_a_site_agent_or_an_agent_of_an_older_queue_keeps_one_cadence(
    tmp_path: Path, role: str, idle_ms: int
) -> None:
    queue = _Queue()
    agent = _agent(tmp_path, role, queue, idle_ms=idle_ms)
    beats = await _heartbeats(agent)
    try:
        await until(lambda: len(queue.gaps) >= 3)
        assert set(queue.gaps) == {BUSY_MS}
    finally:
        agent.request_stop()
        await beats
        assert agent.journal is not None
        agent.journal.close()
