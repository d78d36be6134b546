"""Claims name the agent's journal: a command that may have started is never claimed again by
another journal of the same agent (a wiped state folder, a RAM-disk agent, a node's bcd back in
its new OS), while the same journal asking again is answered as before.

The claims are signed by hand with the agent's real key, so each rule is seen on the wire.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio

from bc_command_queue.config import CmdqConfig
from bc_command_queue.service import CommandQueueService
from better_compute.agent import Enrollment
from better_compute.agent.sim import join_agent
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.wire import unwrap
from better_compute.wire.agent import payload_digest
from better_compute.wire.cmdq import CommandView, EnqueueCommand


@dataclass
class Node:
    api: ApiClient
    cq: CommandQueueClient
    enrollment: Enrollment
    database_url: str

    @property
    def id(self) -> str:
        return self.enrollment.agent_id

    async def wipe(self, key: str) -> CommandView:
        view = await self.cq.enqueue(
            EnqueueCommand(node_id=self.id, site_id="site-c", kind="node.wipe", key=key, target="node")
        )
        assert view.state == "dispatched"
        return view

    async def send(self, kind: str, doc: dict[str, Any]) -> Any:
        """Sign ``doc`` (camelCase, as on the wire) with the node's key and send it."""
        doc = {
            "site": "site-c",
            "agent": self.id,
            "signerId": self.enrollment.cert_id,
            "signedAtMs": time.time_ns() // 1_000_000,
            **doc,
        }
        _data, signature = self.enrollment.identity.sign(f"agent.{kind}", doc)
        data = msgspec.json.encode({**doc, "signature": base64.b64encode(signature).decode()})
        subject = self.api.subjects.agent_event("site-c", self.id, kind)
        return unwrap((await self.api.nc.request(subject, data, timeout=5)).data)

    async def claim(self, view: CommandView, journal: str | None, **over: Any) -> Any:
        canonical = msgspec.json.encode(view.payload, order="sorted")
        doc: dict[str, Any] = {"commandId": view.id, "digest": payload_digest(view.kind, canonical)}
        if journal is not None:
            doc["journalId"] = journal
        return await self.send("ack", {**doc, **over})


@pytest_asyncio.fixture(loop_scope="session")
async def node(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> AsyncIterator[Node]:
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    config = CmdqConfig(sweep_ms=100, presence_write_ms=100)
    async with CommandQueueService(bc_settings, config=config) as svc:
        run = asyncio.create_task(svc.run())
        enrollment = await join_agent(bc_api, site_id="site-c", role="node", node_id=new_id("node"))
        try:
            yield Node(
                api=bc_api, cq=CommandQueueClient(bc_api), enrollment=enrollment,
                database_url=bc_settings.database_url,
            )  # fmt: skip
        finally:
            svc.request_stop()
            await run


async def test_a_claim_from_another_journal_settles_the_command_interrupted(node: Node) -> None:
    wipe = await node.wipe("w1")
    first = await node.claim(wipe, "journal-a")
    assert (first["proceed"], first["state"]) == (True, "acked")
    # the agent comes back with an empty journal: the wipe may have started, it never runs again
    again = await node.claim(wipe, "journal-b")
    assert (again["proceed"], again["state"], again["reason"]) == (False, "failed", "interrupted")
    settled = await node.cq.get(id=wipe.id)
    assert (settled.state, settled.reason) == ("failed", "interrupted")
    # nor by the first journal, and its late result is not taken
    late = await node.claim(wipe, "journal-a")
    assert (late["proceed"], late["state"]) == (False, "failed")
    result = await node.send("result", {"commandId": wipe.id, "status": "succeeded", "result": ""})
    assert result["recorded"] is False
    # a running command, and a claim that names no journal (it cannot show it is the same one)
    running = await node.wipe("w2")
    assert (await node.claim(running, "journal-a"))["proceed"] is True
    await node.send("progress", {"commandId": running.id, "message": "erasing"})
    assert (await node.cq.get(id=running.id)).state == "running"
    unnamed = await node.claim(running, None)
    assert (unnamed["proceed"], unnamed["reason"]) == (False, "interrupted")


async def test_the_same_journal_may_claim_again_and_an_older_claim_changes_nothing(node: Node) -> None:
    wipe = await node.wipe("w1")
    before = time.time_ns() // 1_000_000 - 5_000
    assert (await node.claim(wipe, "journal-a"))["proceed"] is True
    # the answer was lost and the agent asks again, or its process restarted with the journal
    # intact (the journal has not started it, or it would not ask)
    again = await node.claim(wipe, "journal-a")
    assert (again["proceed"], again["state"]) == (True, "acked")
    # a claim signed before the first one, by an earlier journal, arriving late
    stale = await node.claim(wipe, "journal-old", signedAtMs=before)
    assert (stale["proceed"], stale["state"]) == (False, "acked")
    assert (await node.cq.get(id=wipe.id)).state == "acked"
    assert (await node.claim(wipe, "journal-a"))["proceed"] is True
    # once it runs, the journal has it started and never asks again: a copy of its claim (or a
    # journal restored from an older copy) does not make it run again, and changes nothing
    await node.send("progress", {"commandId": wipe.id})
    late = await node.claim(wipe, "journal-a")
    assert (late["proceed"], late["state"]) == (False, "running")
    assert (await node.cq.get(id=wipe.id)).state == "running"


async def test_a_claim_with_an_id_marks_the_command_running_and_another_handling_cannot_claim_it(
    node: Node,
) -> None:
    # Issue 25 item 5: the claim names an id of its handling and marks the command running, so
    # the agent sends no running mark; the same id claims again (the answer was lost), another
    # handling of the same journal (its process died before it journaled the start, or the
    # journal was restored from an older copy) does not, nor does another journal.
    wipe = await node.wipe("ids1")
    first = await node.claim(wipe, "journal-a", claimId="c-1")
    assert (first["proceed"], first["state"]) == (True, "running")
    assert (await node.cq.get(id=wipe.id)).state == "running"
    again = await node.claim(wipe, "journal-a", claimId="c-1")
    assert (again["proceed"], again["state"]) == (True, "running")
    restored = await node.claim(wipe, "journal-a", claimId="c-2")
    assert (restored["proceed"], restored["reason"]) == (False, "running")
    older_sdk = await node.claim(wipe, "journal-a")
    assert (older_sdk["proceed"], older_sdk["reason"]) == (False, "running")
    other = await node.claim(wipe, "journal-b", claimId="c-1")
    assert (other["proceed"], other["reason"]) == (False, "interrupted")
    with pytest.raises(BcError) as err:
        await node.claim(await node.wipe("ids2"), "journal-a", claimId="x" * 65)
    assert (err.value.code, err.value.details.get("path")) == (ErrorCode.INVALID_INPUT, "claimId")


async def test_a_late_claim_from_an_older_journal_never_breaks_a_newer_journals_run(node: Node) -> None:
    # Issue 22 gap 3. Process A (journal a) says hello, receives a wipe and is cut off before
    # its claim gets through; process B (same enrollment, a fresh journal) starts, claims the
    # redelivered wipe and runs it. A comes back and sends its claim again, signed afresh, so
    # later than B's: it must change nothing, and B's real result must count. Four tries.
    dropped = 0
    for i in range(4):
        old, new = f"journal-a{i}", f"journal-b{i}"
        await node.send("hello", {"journalId": old, "incarnation": f"a{i}"})
        wipe = await node.wipe(f"late{i}")
        await node.send("hello", {"journalId": new, "incarnation": f"b{i}"})
        assert (await node.claim(wipe, new))["proceed"] is True
        await node.send("progress", {"commandId": wipe.id, "message": "erasing"})
        late = await node.claim(wipe, old)  # signed now: later than B's claim
        assert late["proceed"] is False
        done = await node.send(
            "result",
            {"commandId": wipe.id, "status": "succeeded", "result": base64.b64encode(b"wiped").decode()},
        )
        settled = await node.cq.get(id=wipe.id)
        if not done["recorded"] or (settled.state, settled.result) != ("succeeded", b"wiped"):
            dropped += 1
    assert dropped == 0


async def test_an_interrupted_command_stays_in_the_running_list_until_its_journal_ends_it(node: Node) -> None:
    # Issue 22 gap 4. Journal a claims and starts a wipe, then goes quiet (a partition); a second
    # process with the same enrollment and a fresh journal claims the redelivered wipe, which
    # settles it failed (interrupted). The wipe still runs at journal a: the next attempt must
    # wait for it, and `why` must say which journal it waits for.
    wf = new_id("wf")
    await node.send("hello", {"journalId": "journal-a", "incarnation": "a"})
    view = await node.cq.enqueue(
        EnqueueCommand(
            node_id=node.id, site_id="site-c", kind="node.wipe", key=f"wf:{wf}:0#1", target="node",
            workflow_id=wf, step=0,
        )
    )  # fmt: skip
    assert (await node.claim(view, "journal-a"))["proceed"] is True
    await node.send("progress", {"commandId": view.id, "message": "erasing"})
    await node.send("hello", {"journalId": "journal-b", "incarnation": "b"})
    taken = await node.claim(view, "journal-b")
    assert (taken["proceed"], taken["reason"]) == (False, "interrupted")
    fence = await node.cq.cancel_under(key_prefix=f"wf:{wf}:0#1", workflow_id=wf, fence=True)
    assert fence.running == [view.id]
    assert [(r.command_id, r.journal_id) for r in fence.running_at] == [(view.id, "journal-a")]
    # journal a comes back and reports the end of its run: the wipe no longer holds anything up
    late = await node.send("result", {"commandId": view.id, "status": "succeeded", "result": ""})
    assert late["recorded"] is False
    assert (await node.cq.cancel_under(key_prefix=f"wf:{wf}:0#1", workflow_id=wf)).running == []

    # the same, but journal a never comes back: the wait ends when a is lost (silent for
    # cmdq.lost_after), although journal b of the same agent keeps heartbeating
    again = await node.cq.enqueue(
        EnqueueCommand(
            node_id=node.id, site_id="site-c", kind="node.wipe", key=f"wf:{wf}:1#1", target="node",
            workflow_id=wf, step=1,
        )
    )  # fmt: skip
    assert (await node.claim(again, "journal-a"))["proceed"] is True
    await node.send("hello", {"journalId": "journal-c", "incarnation": "c"})
    assert (await node.claim(again, "journal-c"))["reason"] == "interrupted"
    assert (await node.cq.cancel_under(key_prefix=f"wf:{wf}:1#1", workflow_id=wf)).running == [again.id]
    conn = await asyncpg.connect(node.database_url)
    try:  # two minutes pass without a word from journal a
        await conn.execute(
            "UPDATE cmdq.journals SET last_seen = now() - interval '121 seconds'"
            " WHERE journal_id = 'journal-a'"
        )
    finally:
        await conn.close()
    await node.send("heartbeat", {"journalId": "journal-c", "incarnation": "c"})
    assert (await node.cq.cancel_under(key_prefix=f"wf:{wf}:1#1", workflow_id=wf)).running == []


async def _command(node: Node, kind: str, key: str, payload: dict[str, Any] | None = None) -> CommandView:
    view = await node.cq.enqueue(
        EnqueueCommand(
            node_id=node.id, site_id="site-c", kind=kind, key=key, target="node", payload=payload or {}
        )
    )
    assert view.state == "dispatched"
    return view


async def _cancels_told(node: Node, until_: Callable[[list[str]], bool]) -> list[str]:
    """The cancels a heartbeat's reply carries, once ``until_`` holds for them (a write later)."""

    async def told() -> tuple[list[str]] | None:
        cancel: list[str] = (await node.send("heartbeat", {"incarnation": "i1"}))["cancel"]
        return (cancel,) if until_(cancel) else None

    return (await until(told, what="the cancels in a heartbeat's reply"))[0]


async def test_a_cancel_after_a_claim_waits_for_the_word_of_the_journal_that_claimed_it(node: Node) -> None:
    """Issue 22, gap 1: a claimed command is cancelling until its agent says it stopped it; the
    agent hears of it in its heartbeat's reply and in a check; only the claiming journal's word
    makes it cancelled."""
    await node.send("hello", {"incarnation": "i1", "kinds": None})
    confirmed = await _command(node, "node.inventory", "c1")
    doubted = await _command(node, "node.inventory", "c2")
    for view in (confirmed, doubted):
        assert (await node.claim(view, "journal-a"))["proceed"] is True
        await node.cq.cancel(id=view.id, reason="workflow aborted")
        assert (await node.cq.get(id=view.id)).state == "cancelling"
    # a machine's heartbeat is answered from memory: the cancels its instance read at its last
    # presence write (every presence_write_ms)
    both = sorted([confirmed.id, doubted.id])
    assert sorted(await _cancels_told(node, lambda told: sorted(told) == both)) == both
    check = await node.send("check", {"commandIds": [confirmed.id]})
    assert check["stop"] == [confirmed.id]
    # a claim of a cancelling command is answered so: the agent says it never started it
    again = await node.claim(confirmed, "journal-a")
    assert (again["proceed"], again["reason"]) == (False, "cancelling")
    word = {"status": "rejected", "reason": "cancelled: the agent never started it", "result": ""}
    said = await node.send("result", {"commandId": confirmed.id, "journalId": "journal-a", **word})
    assert (said["recorded"], said["state"]) == (True, "cancelled")
    done = await node.cq.get(id=confirmed.id)
    assert (done.state, done.reason) == ("cancelled", "workflow aborted")
    assert done.progress is not None
    assert "the agent stopped: rejected" in done.progress
    # another journal of the agent cannot vouch for what journal-a sent: outcome unknown
    other = await node.send("result", {"commandId": doubted.id, "journalId": "journal-b", **word})
    assert (other["recorded"], other["state"]) == (True, "failed")
    assert (await node.cq.get(id=doubted.id)).reason == "interrupted"
    assert await _cancels_told(node, lambda told: not told) == []


async def test_only_the_claiming_journal_may_run_an_idempotent_command_again(node: Node) -> None:
    """Issue 22, gap 7: a rerun claim proceeds for an idempotent kind and payload, from the
    journal that claimed it; a power cycle or another journal is refused."""
    on = await _command(node, "power.setPower", "p-on", {"action": "on"})
    cycle = await _command(node, "power.setPower", "p-cycle", {"action": "cycle"})
    for view in (on, cycle):
        assert (await node.claim(view, "journal-a"))["proceed"] is True
        await node.send("progress", {"commandId": view.id, "message": "try 1: GET System"})
    other = await node.claim(on, "journal-b", rerun=True)
    assert (other["proceed"], other["reason"]) == (False, "claimed-by-another-journal")
    rerun = await node.claim(on, "journal-a", rerun=True)
    assert (rerun["proceed"], rerun["state"], rerun["rerun"]) == (True, "running", True)
    refused = await node.claim(cycle, "journal-a", rerun=True)
    assert (refused["proceed"], refused["reason"]) == (False, "not-idempotent")
    assert (await node.cq.get(id=cycle.id)).state == "running"  # the agent reports it interrupted


async def test_an_event_checked_before_a_revocation_arrived_brings_the_agent_back_to_nothing(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    """Issue 23 L4: once the revocation cut a site agent off, a heartbeat or hello it signed that
    was checked against the certificate cached before (the race the cut-off cannot order) neither
    reconnects it nor gives it the boot lease back."""
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    async with CommandQueueService(bc_settings, config=CmdqConfig(sweep_ms=100)) as svc:
        run = asyncio.create_task(svc.run())
        try:
            enrollment = await join_agent(bc_api, site_id="site-r", role="site")
            agent = Node(api=bc_api, cq=CommandQueueClient(bc_api), enrollment=enrollment, database_url="")

            async def send(kind: str, doc: dict[str, Any]) -> Any:
                doc = {"site": "site-r", "agent": agent.id, "signerId": enrollment.cert_id,
                       "signedAtMs": time.time_ns() // 1_000_000, **doc}  # fmt: skip
                _data, signature = enrollment.identity.sign(f"agent.{kind}", doc)
                data = msgspec.json.encode({**doc, "signature": base64.b64encode(signature).decode()})
                subject = bc_api.subjects.agent_event("site-r", agent.id, kind)
                return unwrap((await bc_api.nc.request(subject, data, timeout=5)).data)

            async def shown() -> Any:
                (view,) = [a for a in await agent.cq.agents(site_id="site-r") if a.id == agent.id]
                return view

            assert (await send("hello", {"incarnation": "i1", "journalId": "j1"}))["bootLease"] is True
            assert svc.signers is not None
            cached = await svc.signers.get(enrollment.cert_id)
            await PkiClient(bc_api).revoke_certificate(cert_id=enrollment.cert_id, reason="stolen")

            async def cut_off() -> bool:
                view = await shown()
                return not view.connected and not view.boot_lease

            await until(cut_off, timeout=5.0, what="the revoked agent cut off")
            # as if both had passed their signature check just before the revocation arrived
            svc.signers._cache[enrollment.cert_id] = cached
            assert (await send("heartbeat", {"incarnation": "i1", "journalId": "j1"}))["bootLease"] is False
            svc.signers._cache[enrollment.cert_id] = cached
            assert (await send("hello", {"incarnation": "i2", "journalId": "j1"}))["bootLease"] is False
            assert await cut_off()
        finally:
            svc.request_stop()
            await run
