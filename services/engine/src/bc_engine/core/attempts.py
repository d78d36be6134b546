"""What an earlier attempt of a step, or an aborted workflow, left behind: tokens and secrets it
minted are revoked, its key is fenced in every service it used, and its commands are cancelled,
before a new attempt starts (or once the abort is recorded). An abort revokes what every step of
the workflow minted, not only the cancelled one: a join token an earlier step minted must stop
working once its workflow was given up."""

from __future__ import annotations

import time
from typing import Any, Protocol

from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ServiceUnavailableError
from better_compute.core.keys import workflow_command_prefix
from better_compute.provision import step_command_key

from ..store import StepRow, WorkflowRow
from .outcomes import QUEUE_RETRY_S
from .reconciler_store import ReconcilerStore

__all__ = ["SUPERSEDED_POLL_S", "AttemptHost", "cleanup_aborted", "supersede"]

SUPERSEDED_POLL_S = 2.0  # a previous attempt's command still runs: look again this soon


class AttemptHost(Protocol):
    """What the clean-up uses of the reconciler (``engine.Engine``)."""

    store: ReconcilerStore
    cmdq: CommandQueueClient
    pki: PkiClient
    secrets: SecretsClient
    log: Any

    async def waiting(self, wf: WorkflowRow, step: StepRow, what: dict[str, Any] | None) -> None: ...


async def cleanup_aborted(engine: AttemptHost, wf: WorkflowRow) -> float | None:
    """After an abort: revoke what the cancelled attempt minted, fence it, and cancel the
    workflow's live commands wherever it sent them (retried until the services answer)."""
    if not wf.cancel_commands:
        return None
    cancelled = await engine.store.cancelled_step(wf.id)
    sent = await engine.store.any_sent(wf.id)
    try:
        if cancelled is not None and cancelled.attempt > 0:
            await _revoke_attempt(engine, wf, cancelled, reason="its workflow was aborted")
        for minted in await engine.store.minted_steps(wf.id):
            await _revoke_minted(engine, wf, minted, reason="its workflow was aborted")
        if sent:
            await engine.cmdq.cancel_under(
                key_prefix=workflow_command_prefix(wf.id), workflow_id=wf.id, reason="workflow aborted"
            )
    except BcError as err:
        engine.log.warning("abort_cleanup_deferred", workflow_id=wf.id, code=err.code.value)
        return time.time() + QUEUE_RETRY_S
    await engine.store.cleaned_up(wf.id)
    return None


async def _revoke_minted(engine: AttemptHost, wf: WorkflowRow, step: StepRow, *, reason: str) -> None:
    """Revoke the tokens and secrets attempt ``step.attempt`` minted, and fence its key there."""
    coords: dict[str, Any] = {"workflow_id": wf.id, "step": step.idx, "attempt": step.attempt}
    minted = set(step.minted or ())
    if "pki" in minted:
        await engine.pki.revoke_attempt(**coords, reason=reason)
    if "secrets" in minted:
        await engine.secrets.revoke_attempt(**coords, reason=reason)


async def _revoke_attempt(
    engine: AttemptHost, wf: WorkflowRow, step: StepRow, *, reason: str
) -> list[dict[str, Any]]:
    """Revoke what attempt ``step.attempt`` minted and fence its key in every service it
    used; returns the commands of it that may still run at their agents (``commandId``, and the
    ``agentId`` and ``journalId`` that claimed it: interrupted ones too, until that journal
    reports their end or is lost)."""
    await _revoke_minted(engine, wf, step, reason=reason)
    if not step.sent_commands:
        return []
    reply = await engine.cmdq.cancel_under(
        key_prefix=step_command_key(step), workflow_id=wf.id, fence=True, reason=reason
    )
    if reply.running and not reply.running_at:  # an older command-queue: ids only
        return [{"commandId": ident} for ident in reply.running]
    return [
        {"commandId": r.command_id, "agentId": r.agent_id, "journalId": r.journal_id}
        for r in reply.running_at
    ]


async def supersede(engine: AttemptHost, wf: WorkflowRow, step: StepRow) -> float | None:
    """Before attempt N+1 of a step: attempt N's tokens and secrets revoked, its commands
    cancelled wherever they were sent and fenced, and none of them still running at an agent.
    Returns when to look again, or None once attempt N+1 may start."""
    try:
        running = await _revoke_attempt(engine, wf, step, reason="superseded by a later attempt")
    except BcError as err:
        service = err.service if isinstance(err, ServiceUnavailableError) else None
        engine.log.warning(
            "supersede_deferred", workflow_id=wf.id, step=step.idx, code=err.code.value,
            service=service,
        )  # fmt: skip
        await engine.waiting(
            wf, step, {"reason": "service-unavailable", "service": service, "code": err.code.value}
        )
        return time.time() + QUEUE_RETRY_S
    if not running:
        return None
    # A claimed command cannot be recalled: attempt N+1 waits until it ends at its agent
    # (its result, even a late one, or the agent's loss); its event wakes us sooner.
    await engine.waiting(
        wf,
        step,
        {
            "reason": "previous-attempt-running",
            "attempt": step.attempt,
            "commands": [r["commandId"] for r in running],
            "journals": running,
        },
    )
    return time.time() + SUPERSEDED_POLL_S
