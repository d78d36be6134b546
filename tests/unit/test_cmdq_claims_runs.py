"""The command queue's claims and runs on the in-memory store: what an agent's ack, progress and
result do to a command, and what the agent is told. (The same rules on PostgreSQL and the bus:
tests/integration/test_cmdq_claims.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from bc_command_queue.claims import Claims
from bc_command_queue.runs import Runs
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import result_document
from cmdq_kit import ack, command, progress, queue, result, signer


async def test_a_claim_is_taken_once_and_the_same_journal_asking_again_is_answered_as_before() -> None:
    q = queue()
    row = await command(q)
    assert row.state == "dispatched"
    first = await q.claims.ack(ack(row, journal="ja"))
    assert (first.proceed, first.state) == (True, "acked")
    assert q.states() == [(row.id, "acked", None)]
    # its answer was lost: the same journal asks again and may go on; nothing changes
    again = await q.claims.ack(ack(row, journal="ja"))
    assert (again.proceed, again.state) == (True, "acked")


async def test_a_claim_with_an_id_marks_the_command_running_and_only_that_id_claims_it_again() -> None:
    q = queue()
    row = await command(q)
    first = await q.claims.ack(ack(row, journal="ja", claim_id="k1"))
    assert (first.proceed, first.state) == (True, "running")  # no running mark from the agent needed
    assert q.states() == [(row.id, "running", None)]
    # its answer was lost: the same id (every try of the claim names it) is taken again
    again = await q.claims.ack(ack(row, journal="ja", claim_id="k1"))
    assert (again.proceed, again.state) == (True, "running")
    # another handling of the same journal (its process died after the claim, before it
    # journaled the start; or the journal was restored from an older copy): another id
    restored = await q.claims.ack(ack(row, journal="ja", claim_id="k2"))
    assert (restored.proceed, restored.reason) == (False, "running")
    without = await q.claims.ack(ack(row, journal="ja"))
    assert (without.proceed, without.reason) == (False, "running")
    assert (await q.store.command_by_id(row.id)).state == "running"  # type: ignore[union-attr]
    assert {state for _id, state, _reason in q.states()} == {"running"}
    with pytest.raises(BcError) as err:
        await q.claims.ack(ack(row, journal="ja", claim_id="k" * 65))
    assert err.value.details.get("path") == "claimId"


async def test_another_journal_claiming_a_claimed_command_settles_it_interrupted_for_good() -> None:
    q = queue()
    row = await command(q)
    await q.claims.ack(ack(row, journal="ja"))
    other = await q.claims.ack(ack(row, journal="jb"))
    assert (other.proceed, other.state, other.reason) == (False, "failed", "interrupted")
    late = await q.claims.ack(ack(row, journal="ja"))
    assert (late.proceed, late.state) == (False, "failed")
    assert (await q.store.command_by_id(row.id)).reason == "interrupted"  # type: ignore[union-attr]


async def test_a_late_claim_of_an_older_journal_changes_nothing() -> None:
    q = queue()
    row = await command(q)
    old_journal = await q.store.journal_seen(row.node_id, "old", present=True)
    await q.store.journal_seen(row.node_id, "new", present=True)
    assert old_journal.generation < (await q.store.journal_seen(row.node_id, "new", present=True)).generation
    assert (await q.claims.ack(ack(row, journal="new"))).proceed
    # a copy of the replaced journal's claim, re-signed later by its retry
    stale = await q.claims.ack(ack(row, journal="old"))
    assert (stale.proceed, stale.reason) == (False, "claimed-by-another-journal")
    assert (await q.store.command_by_id(row.id)).state == "acked"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "reason", "again"),
    [
        ({"digest": "00" * 32}, "digest-mismatch", True),
        ({"agent": "node_someone_else"}, "not-yours", True),
        ({"command_id": "cmd_unknown"}, "unknown-command", None),
    ],
)
async def test_a_claim_that_is_not_what_was_sent_is_refused_and_changes_nothing(
    change: dict[str, str], reason: str, again: bool | None
) -> None:
    q = queue()
    row = await command(q)
    reply = await q.claims.ack(ack(row, **change))
    assert (reply.proceed, reply.reason) == (False, reason)
    if again is not None:
        assert reply.again is again
    assert (await q.store.command_by_id(row.id)).state == "dispatched"  # type: ignore[union-attr]
    assert q.changed == []


async def test_a_command_past_its_deadline_is_not_claimed_and_the_sweep_expires_it() -> None:
    q = queue()
    row = await command(q, timeout_s=30)
    q.store.advance(31)
    reply = await q.claims.ack(ack(row))
    assert (reply.proceed, reply.reason) == (False, "expired")
    await q.sweeper.sweep()
    assert q.states() == [(row.id, "expired", "not-claimed")]


async def test_a_rerun_is_for_the_journal_that_claimed_an_idempotent_command_only() -> None:
    q = queue(reruns=True)
    row = await command(q, kind="media.eject")
    await q.claims.ack(ack(row, journal="ja"))
    mine = await q.claims.ack(ack(row, journal="ja", rerun=True))
    assert (mine.proceed, mine.rerun) == (True, True)
    theirs = await q.claims.ack(ack(row, journal="jb", rerun=True))
    assert (theirs.proceed, theirs.reason) == (False, "claimed-by-another-journal")
    no = queue(reruns=False)
    other = await command(no)
    await no.claims.ack(ack(other, journal="ja"))
    refused = await no.claims.ack(ack(other, journal="ja", rerun=True))
    assert (refused.proceed, refused.reason) == (False, "not-idempotent")


async def test_progress_marks_a_claimed_command_running_once_and_a_result_settles_it_once() -> None:
    q = queue()
    row = await command(q)
    await q.claims.ack(ack(row))
    await q.runs.progress(progress(row, "10%"))
    await q.runs.progress(progress(row, "50%"))  # no new state: no event
    assert q.states()[1:] == [(row.id, "running", None)]
    assert (await q.store.command_by_id(row.id)).progress == "50%"  # type: ignore[union-attr]
    done = await q.runs.result(result(row, "failed", reason="disk busy"))
    assert (done.recorded, done.state) == (True, "failed")
    dup = await q.runs.result(result(row, "succeeded"))
    assert (dup.recorded, dup.state) == (False, "failed")
    assert q.states()[-1] == (row.id, "failed", "disk busy")


async def test_a_result_before_any_claim_is_not_recorded_and_another_agents_is_refused() -> None:
    q = queue()
    row = await command(q)
    early = await q.runs.result(result(row))
    assert (early.recorded, early.state) == (False, "dispatched")
    with pytest.raises(BcError) as refused:
        await q.runs.result(result(row, agent="node_else", result_signature=b"sig"))
    assert refused.value.code is ErrorCode.PERMISSION_DENIED


async def test_a_cancelled_claimed_command_is_cancelled_on_the_word_of_the_journal_that_claimed_it() -> None:
    q = queue()
    mine, theirs = await command(q), await command(q)
    for row in (mine, theirs):
        await q.claims.ack(ack(row, journal="ja"))
        [cancelling] = await q.store.cancel(row.id, "operator")
        assert cancelling.state == "cancelling"
    # the claiming journal says it stopped it: cancelled, its outcome kept in progress
    said = await q.runs.result(result(mine, "succeeded", journal="ja"))
    assert said.state == "cancelled"
    settled = await q.store.command_by_id(mine.id)
    assert settled is not None
    assert (settled.reason, settled.progress, settled.result) == (
        "operator", "the agent stopped: succeeded", None,
    )  # fmt: skip
    # another journal of the agent cannot vouch for it: its outcome is unknown
    other = await q.runs.result(result(theirs, "succeeded", journal="jb"))
    assert other.state == "failed"
    assert (await q.store.command_by_id(theirs.id)).reason == "interrupted"  # type: ignore[union-attr]
    # a late end of the run still lets a step waiting for it go on
    before = len(q.changed)
    assert (await q.runs.result(result(theirs, "succeeded", journal="ja"))).recorded is False
    assert q.states()[before:] == [(theirs.id, "failed", "interrupted")]


class VerifyingPki:
    """bc-pki's ``signatures.verify``: every certificate of the node, counted."""

    def __init__(self, node_keys: dict[str, list[ed25519.Ed25519PublicKey]]) -> None:
        self.keys = node_keys
        self.asked = 0

    async def verify(self, *, signer_id: str, data: bytes, signature: bytes) -> Any:
        self.asked += 1
        for key in self.keys.get(signer_id, []):
            with contextlib.suppress(InvalidSignature):
                key.verify(signature, data)
                return SimpleNamespace(agent_id=signer_id)
        raise BcError(ErrorCode.UNAUTHENTICATED, "signature does not verify", {"reason": "bad-signature"})


async def test_a_nodes_result_is_attested_with_the_key_of_its_event_and_through_bc_pki_otherwise() -> None:
    q = queue()
    now_key, earlier_key = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    rows = [await command(q) for _ in range(3)]
    pki = VerifyingPki({r.node_id: [now_key.public_key(), earlier_key.public_key()] for r in rows})
    q.runs.pki = pki  # type: ignore[assignment]
    attested = []
    for row, key in zip(rows, (now_key, earlier_key, ed25519.Ed25519PrivateKey.generate()), strict=True):
        await q.claims.ack(ack(row))
        doc = result_document(command_id=row.id, node_id=row.node_id, status="succeeded", result=b"{}")
        event_signer = signer(row.node_id, role="node", public_key=now_key.public_key())
        reply = await q.runs.result(result(row, result_signature=key.sign(doc)), event_signer)
        attested.append(reply.attested)
    # the event's own certificate checks it; an earlier certificate of the node is bc-pki's to
    # know; a key that is none of the node's is attested by nobody (and the result still counts)
    assert attested == [True, True, False]
    assert pki.asked == 2
    assert [(await q.store.command_by_id(r.id)).state for r in rows] == ["succeeded"] * 3  # type: ignore[union-attr]


async def test_a_result_waiting_on_bc_pki_holds_no_store_slot_a_claim_needs() -> None:
    # A result signed under a node's earlier certificate asked bc-pki while it held one of the
    # agent events' store slots, so a slow bc-pki could hold them all: every claim unanswered and
    # the store idle, as in the stalled 10,000-machine deploy of 2026-12-07 (its cause not proven).
    q = queue()
    slots = asyncio.Semaphore(1)  # the service's: claims and results share them
    asked, answer = asyncio.Event(), asyncio.Event()

    class SlowPki:
        async def verify(self, *, signer_id: str, data: bytes, signature: bytes) -> Any:
            asked.set()
            await answer.wait()
            return SimpleNamespace(agent_id=signer_id)

    claims = Claims(store=q.store, config=q.config, changed=_nothing, log=q.log, slots=slots)
    runs = Runs(store=q.store, pki=SlowPki(), changed=_nothing, log=q.log, slots=slots)  # type: ignore[arg-type]
    ran, waiting = await command(q), await command(q)
    await claims.ack(ack(ran))
    reporting = asyncio.create_task(runs.result(result(ran, result_signature=b"s" * 64), None))
    await asyncio.wait_for(asked.wait(), 10)
    claimed = await asyncio.wait_for(claims.ack(ack(waiting)), 10)
    assert claimed.proceed
    answer.set()
    reply = await asyncio.wait_for(reporting, 10)
    assert (reply.recorded, reply.attested) == (True, True)


async def _nothing(_rows: Any) -> None:
    return None
