"""A claim starts its command (issue 25): the agent journals the command started, with a token,
before it claims it, and the command queue's claim marks it ``running`` at once, so no running mark
follows. What keeps a command from running twice moved from the queue's ``running`` mark to the
journal's entry: a journal restored from an older copy has no entry and cannot know the token (its
claim is refused), and a process that died with the entry asks with the entry's token (the command
runs if the claim never arrived, and is reported interrupted if it did).

The agent here is the real SDK ``Agent`` with its real journal; the command queue is the real
``Claims`` and ``Runs`` on the in-memory store (tests/support/cmdq_kit.py), reached through the
agent's request and publish hooks instead of NATS. The same rules on PostgreSQL and the bus:
tests/integration/test_cmdq_claims.py; the whole path with kills: tests/chaos/test_kill_points.py.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import msgspec

from better_compute.agent import Enrollment
from better_compute.agent.journal import Journal, JournalEntry
from better_compute.agent.runner import Agent, Command
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import new_agent_key
from better_compute.testing import until
from better_compute.wire.agent import Ack, AgentEvent, CommandDelivery, Progress
from cmdq_kit import SITE, Queue, command, digest_of, payload_of, queue

NODE = "node_1"


class _Msg:
    """A JetStream message as the agent sees it: its bytes, acknowledged or not."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def in_progress(self) -> None:
        pass


class _Bridge:
    """The agent's requests and events, answered by the queue's real parts on the memory store.
    ``lose``: how many of the next claims are applied and their answers lost (a timeout)."""

    def __init__(self, q: Queue) -> None:
        self.q = q
        self.claims: list[Ack] = []
        self.entries: list[JournalEntry | None] = []
        """The claiming agent's journal entry of the command as each claim arrived."""
        self.marks: list[str] = []
        """Commands marked running by a progress event with nothing to say."""
        self.lose = 0

    def hook(self, agent: Agent) -> None:
        async def request(kind: str, event: AgentEvent, *, timeout: float | None = None) -> Any:
            if kind == "ack":
                assert isinstance(event, Ack)
                assert agent.journal is not None
                self.claims.append(event)
                self.entries.append(agent.journal.get(event.command_id))
                reply = await self.q.claims.ack(event)
                if self.lose > 0:
                    self.lose -= 1
                    raise BcError(ErrorCode.TIMEOUT, "the answer was lost")
                return msgspec.to_builtins(reply)
            if kind == "result":
                return msgspec.to_builtins(await self.q.runs.result(event))  # type: ignore[arg-type]
            raise AssertionError(f"unexpected request {kind}")

        async def publish(kind: str, event: AgentEvent) -> None:
            assert kind == "progress"
            assert isinstance(event, Progress)
            if event.message is None:
                self.marks.append(event.command_id)
            await self.q.runs.progress(event)

        agent._request = request  # type: ignore[method-assign]
        agent._publish = publish  # type: ignore[method-assign]


class _Machine:
    """The handler's side: how often the command ran, and a gate to hold it running."""

    def __init__(self) -> None:
        self.runs = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def handle(self, _command: Command) -> dict[str, str]:
        self.runs += 1
        await self.gate.wait()
        return {"ok": "yes"}


def _agent(path: Path, bridge: _Bridge, machine: _Machine) -> Agent:
    enrollment = Enrollment(
        agent_id=NODE, cert_id="cert_x", site_id=SITE, tenant_id="root", role="node",
        certificate_pem="-----BEGIN CERTIFICATE-----\n", private_key=new_agent_key(),
    )  # fmt: skip
    agent = Agent(
        enrollment=enrollment, handlers={"node.inventory": machine.handle},
        journal=Journal(path, durable=False), sign_results=False,
        nc=object(),  # type: ignore[arg-type]  # never used: the bridge answers
    )  # fmt: skip
    bridge.hook(agent)
    return agent


async def _delivered(q: Queue) -> tuple[CommandDelivery, str]:
    """A node command dispatched to NODE, as its stream delivers it, and the message's bytes."""
    row = await command(q, node=NODE)
    assert row.state == "dispatched"
    delivery = CommandDelivery(
        id=row.id, kind=row.kind, payload=msgspec.Raw(payload_of(row.kind).encode()), node_id=NODE,
        site_id=SITE, agent_id=NODE, key=row.key, not_after_ms=int((q.store.now() + 60) * 1000),
    )  # fmt: skip
    return delivery, msgspec.json.encode(delivery).decode()


async def _handle(agent: Agent, data: str) -> _Msg:
    msg = _Msg(data.encode())
    delivery = msgspec.json.decode(msg.data, type=CommandDelivery)
    assert agent.journal is not None
    await agent._handle_once(delivery, msg, agent.journal)  # type: ignore[arg-type]
    return msg


async def _state(q: Queue, command_id: str) -> tuple[str, str | None]:
    row = await q.store.command_by_id(command_id)
    assert row is not None
    return row.state, row.reason


async def test_the_journal_has_the_command_before_its_claim_and_the_claim_starts_it(tmp_path: Path) -> None:
    q, machine = queue(), _Machine()
    bridge = _Bridge(q)
    agent = _agent(tmp_path / "j.db", bridge, machine)
    delivery, data = await _delivered(q)
    msg = await _handle(agent, data)
    assert msg.acked
    assert machine.runs == 1
    [claim], [entry] = bridge.claims, bridge.entries
    assert entry is not None
    assert entry.state == "started"
    assert claim.token
    assert entry.token == claim.token
    # the claim took it straight to running; no running mark went out
    assert bridge.marks == []
    assert [s for i, s, _r in q.states() if i == delivery.id] == ["running", "succeeded"]
    reported = agent.journal.get(delivery.id) if agent.journal else None
    assert reported is not None
    assert reported.state == "reported"


async def test_a_claim_whose_answer_was_lost_is_asked_again_with_its_token_and_runs_once(
    tmp_path: Path,
) -> None:
    q, machine = queue(), _Machine()
    bridge = _Bridge(q)
    bridge.lose = 1
    agent = _agent(tmp_path / "j.db", bridge, machine)
    delivery, data = await _delivered(q)
    await _handle(agent, data)
    assert len(bridge.claims) == 2
    assert bridge.claims[0].token == bridge.claims[1].token
    assert machine.runs == 1
    assert await _state(q, delivery.id) == ("succeeded", None)


async def test_a_journal_restored_from_an_older_copy_never_runs_what_its_original_started(
    tmp_path: Path,
) -> None:
    q, machine = queue(), _Machine()
    first = tmp_path / "j.db"
    Journal(first, durable=False).close()
    shutil.copy(first, tmp_path / "copy.db")  # the copy: same journal id, no entry of the command
    bridge = _Bridge(q)
    original = _agent(first, bridge, machine)
    delivery, data = await _delivered(q)
    machine.gate.clear()
    running = asyncio.create_task(_handle(original, data))
    await until(lambda: machine.runs == 1)
    restored = _agent(tmp_path / "copy.db", bridge, machine)
    assert restored.journal is not None
    assert original.journal is not None
    assert restored.journal.id == original.journal.id
    msg = await _handle(restored, data)  # the stream delivers the command again
    assert msg.acked
    assert machine.runs == 1
    assert bridge.claims[1].token != bridge.claims[0].token
    refused = restored.journal.get(delivery.id)
    assert refused is not None
    assert refused.state == "refused"
    assert refused.reason == "running"
    machine.gate.set()
    await running
    assert machine.runs == 1
    assert await _state(q, delivery.id) == ("succeeded", None)


async def test_a_process_that_died_before_its_claim_arrived_claims_it_at_its_start_and_runs_it_once(
    tmp_path: Path,
) -> None:
    q, machine = queue(), _Machine()
    bridge = _Bridge(q)
    path = tmp_path / "j.db"
    delivery, data = await _delivered(q)
    journal = Journal(path, durable=False)
    # the dead process journaled it started with its token, and its claim never left
    assert await journal.started(
        delivery.id, kind=delivery.kind, not_after=delivery.not_after_ms / 1000, delivery=data.encode(),
        token="t-dead",
    )  # fmt: skip
    journal.close()
    agent = _agent(path, bridge, machine)
    await agent._settle_journal()
    assert agent.journal is not None
    await until(lambda: (e := agent.journal.get(delivery.id)) is not None and e.state == "reported")  # type: ignore[union-attr]
    assert machine.runs == 1
    assert [(c.rerun, c.token) for c in bridge.claims] == [(True, "t-dead")]
    assert await _state(q, delivery.id) == ("succeeded", None)
    assert bridge.marks == []


async def test_a_process_that_died_after_its_claim_arrived_never_runs_it_and_reports_it_interrupted(
    tmp_path: Path,
) -> None:
    q, machine = queue(reruns=False), _Machine()
    bridge = _Bridge(q)
    path = tmp_path / "j.db"
    delivery, data = await _delivered(q)
    journal = Journal(path, durable=False)
    assert await journal.started(
        delivery.id, kind=delivery.kind, not_after=delivery.not_after_ms / 1000, delivery=data.encode(),
        token="t-dead",
    )  # fmt: skip
    # its claim arrived and was taken (the command is running at the queue), then it died
    taken = await q.claims.ack(
        Ack(
            site=SITE, agent=NODE, signer_id="cert_x", signed_at_ms=1, command_id=delivery.id,
            digest=digest_of(delivery.kind), journal_id=journal.id, token="t-dead",
        )
    )  # fmt: skip
    assert (taken.proceed, taken.state) == (True, "running")
    journal.close()
    agent = _agent(path, bridge, machine)
    await agent._settle_journal()
    assert agent.journal is not None
    await until(lambda: (e := agent.journal.get(delivery.id)) is not None and e.state == "reported")  # type: ignore[union-attr]
    assert machine.runs == 0
    assert await _state(q, delivery.id) == ("failed", "interrupted: the agent stopped while the command ran")


async def test_a_refused_claim_leaves_no_started_entry(tmp_path: Path) -> None:
    q, machine = queue(), _Machine()
    bridge = _Bridge(q)
    agent = _agent(tmp_path / "j.db", bridge, machine)
    assert agent.journal is not None
    # for good: another journal of this node claimed it first (a journal that may have run it)
    gone, gone_data = await _delivered(q)
    done = await q.claims.ack(
        Ack(
            site=SITE, agent=NODE, signer_id="cert_x", signed_at_ms=1, command_id=gone.id,
            digest=digest_of(gone.kind), journal_id="another-journal",
        )
    )  # fmt: skip
    assert done.proceed
    msg = await _handle(agent, gone_data)
    entry = agent.journal.get(gone.id)
    assert msg.acked
    assert entry is not None
    assert (entry.state, entry.reason) == ("refused", "interrupted")
    # for now: the command is not this agent's (it may be handed to it later, afresh)
    row = await command(q, node="node_other")
    other = CommandDelivery(
        id=row.id, kind=row.kind, payload=msgspec.Raw(payload_of(row.kind).encode()), node_id=NODE,
        site_id=SITE, agent_id=NODE, key=row.key, not_after_ms=int((q.store.now() + 60) * 1000),
    )  # fmt: skip
    msg = await _handle(agent, msgspec.json.encode(other).decode())
    assert msg.acked
    assert agent.journal.get(row.id) is None
    assert machine.runs == 0
