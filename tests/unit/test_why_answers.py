"""The parts of a ``workflows.why`` answer built from the command-queue's views (a fake queue:
the end-to-end tests in tests/e2e/test_engine_why.py drive the real one)."""

from __future__ import annotations

import time
from typing import Any

from bc_engine.why import WhyApi, _in
from better_compute.core.errors import BcError
from better_compute.wire.cmdq import AgentView, BatchView, CommandView


class FakeQueue:
    def __init__(self, agents: list[AgentView], batch: BatchView | None = None) -> None:
        self._agents = agents
        self._batch = batch

    async def agents(
        self, *, role: str | None = None, connected: bool | None = None, **_: Any
    ) -> list[AgentView]:
        return [
            a for a in self._agents
            if (role is None or a.role == role) and (connected is None or a.connected == connected)
        ]  # fmt: skip

    async def get_batch(self, *, id: str) -> BatchView:
        if self._batch is None:
            raise BcError("NOT_FOUND", f"no batch {id}")
        return self._batch

    async def quorum(self) -> Any:
        raise BcError("UNAVAILABLE", "away")


def _cmd(**over: Any) -> CommandView:
    base: dict[str, Any] = dict(
        id="cmd_1", node_id="node_1", site_id="lab1", kind="node.converge", key="wf:wf_1:0#1",
        state="pending", target="node", created_at=time.time() - 5, updated_at=time.time() - 5,
    )  # fmt: skip
    return CommandView(**{**base, **over})


def _agent(id: str, *, connected: bool, role: str = "node", last_seen: float = 1_764_570_000.0) -> AgentView:
    return AgentView(
        id=id, site_id="lab1", tenant_id="root", role=role, cert_id="cert_1", connected=connected,
        connected_at=last_seen, last_seen=last_seen,
    )  # fmt: skip


async def test_a_command_for_a_nodes_own_agent_names_that_agent_missing_or_there() -> None:
    why = WhyApi(db=None, cmdq=FakeQueue([_agent("node_1", connected=False)]))  # type: ignore[arg-type]
    part = await why._command(_cmd())
    assert part.kind == "no-agent"
    assert part.text.startswith("node node_1's own agent is not connected (last seen 2025-12-01T06:20:00Z)")
    never = WhyApi(db=None, cmdq=FakeQueue([]))  # type: ignore[arg-type]
    assert "(it never joined)" in (await never._command(_cmd())).text
    there = WhyApi(db=None, cmdq=FakeQueue([_agent("node_1", connected=True)]))  # type: ignore[arg-type]
    part = await there._command(_cmd())
    assert (part.kind, part.text.endswith("own agent (connected)")) == ("command", True)


async def test_a_command_a_node_agent_took_and_left_with_says_the_agent_is_gone() -> None:
    """acme-memory-check right after an inspect (the machine off): 'dispatched on agent node_1'
    read as if the node's bcd were on it, for the 10 minutes of the step's deadline."""
    took = _cmd(kind="node.inventory", state="dispatched", agent_id="node_1")
    gone = WhyApi(db=None, cmdq=FakeQueue([_agent("node_1", connected=False)]))  # type: ignore[arg-type]
    part = await gone._command(took)
    assert part.kind == "agent-away"
    assert "that agent is not connected (last seen 2025-12-01T06:20:00Z)" in part.text
    here = WhyApi(db=None, cmdq=FakeQueue([_agent("node_1", connected=True)]))  # type: ignore[arg-type]
    part = await here._command(took)
    assert part.kind == "command"
    assert part.text.endswith("on agent node_1")


async def test_a_site_command_names_the_connected_agents_or_the_last_one_seen() -> None:
    cmd = _cmd(kind="power.setPower", target="site")
    gone = [_agent("agent_a", connected=False, role="site", last_seen=1_764_570_000.0),
            _agent("agent_b", connected=False, role="site", last_seen=1_764_570_060.0)]  # fmt: skip
    part = await WhyApi(db=None, cmdq=FakeQueue(gone))._command(cmd)  # type: ignore[arg-type]
    assert part.text.startswith("no connected agent at site lab1 (last seen 2025-12-01T06:21:00Z: agent_b)")
    assert part.facts["agentId"] == "agent_b"
    here = [_agent("agent_c", connected=True, role="site")]
    part = await WhyApi(db=None, cmdq=FakeQueue(here))._command(cmd)  # type: ignore[arg-type]
    assert "(connected at site lab1: agent_c)" in part.text
    running = _cmd(kind="power.setPower", target="site", state="running", agent_id="agent_c", progress="50%")
    part = await WhyApi(db=None, cmdq=FakeQueue(here))._command(running)  # type: ignore[arg-type]
    assert "running since " in part.text
    assert part.text.endswith("on agent agent_c (50%)")


async def test_a_site_with_no_agent_connected_is_unreachable_since_its_site_agent_was_last_heard() -> None:
    cut = [
        _agent("agent_s", connected=False, role="site", last_seen=1_764_570_060.0),
        _agent("node_1", connected=False, last_seen=1_764_570_061.0),
    ]
    part = await WhyApi(db=None, cmdq=FakeQueue(cut))._site_unreachable("lab1")  # type: ignore[arg-type]
    assert part is not None
    assert part.kind == "site-unreachable"
    assert part.text.startswith("site lab1 unreachable since 2025-12-01T06:21:00Z: no agent of the site")
    assert (part.facts["siteId"], part.facts["agentId"]) == ("lab1", "agent_s")
    # one agent of the site heard just now (a bcd, the site agent down): the site is reachable
    one = [cut[0], _agent("node_1", connected=True, last_seen=time.time() - 2)]
    assert await WhyApi(db=None, cmdq=FakeQueue(one))._site_unreachable("lab1") is None  # type: ignore[arg-type]
    # an idle machine still counts as connected for three of its 30 s heartbeats, but unheard for
    # longer than a site agent's silence it does not say its site is there (the site is cut)
    idle = [cut[0], _agent("node_1", connected=True, last_seen=time.time() - 40)]
    part = await WhyApi(db=None, cmdq=FakeQueue(idle))._site_unreachable("lab1")  # type: ignore[arg-type]
    assert part is not None
    assert part.kind == "site-unreachable"
    # a site that never had a site agent is empty, not unreachable
    none = [_agent("node_1", connected=False)]
    assert await WhyApi(db=None, cmdq=FakeQueue(none))._site_unreachable("lab1") is None  # type: ignore[arg-type]


def test_durations_read_as_people_say_them() -> None:
    assert [_in(s) for s in (0, 59.6, 119, 120, 3599, 7200, 90000)] == [
        "0s", "60s", "119s", "2m00s", "59m59s", "2h00m", "25h00m",
    ]  # fmt: skip


def test_a_wait_for_a_previous_attempt_names_the_journal_it_waits_for() -> None:
    part = WhyApi._waiting_for(
        {
            "reason": "previous-attempt-running",
            "attempt": 1,
            "commands": ["cmd_1"],
            "journals": [{"commandId": "cmd_1", "agentId": "agent_a", "journalId": "j1"}],
        }
    )
    assert part.text == "attempt 1's commands still run at their agent (cmd_1 on journal j1 of agent agent_a)"
    assert part.facts["journals"] == [{"commandId": "cmd_1", "agentId": "agent_a", "journalId": "j1"}]
    older = WhyApi._waiting_for({"reason": "previous-attempt-running", "attempt": 2, "commands": ["cmd_2"]})
    assert older.text == "attempt 2's commands still run at their agent (cmd_2)"
