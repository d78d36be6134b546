"""Superseding a workflow step attempt in each service, on a real nats-server and PostgreSQL:
bc-pki and bc-secrets revoke what it minted and refuse more, the command-queue cancels what it
sent on every node and refuses more. ``wf:X:0#1`` covers ``wf:X:0#1:name``, never ``wf:X:0#12``."""

from __future__ import annotations

import msgspec

from bc_command_queue.service import CommandQueueService
from bc_pki.service import PkiService
from bc_secrets.service import SecretsService
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import ErrorCode
from better_compute.core.ids import new_id
from better_compute.core.keys import attempt_key
from better_compute.service import ApiClient
from better_compute.testing import refused
from better_compute.wire.cmdq import EnqueueCommand


async def test_pki_revokes_a_step_attempts_tokens_and_refuses_late_ones(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    pki = PkiClient(bc_api)
    wf = new_id("wf")

    async def issue(key: str) -> str:
        token = await pki.issue_join_token(
            tenant_id="acme", role="provisioned", site_id="lab1", ttl_seconds=600, idempotency_key=key
        )
        return token.join_token_id

    async with PkiService(bc_settings):
        first = [await issue(attempt_key(wf, 0, 1)), await issue(f"{attempt_key(wf, 0, 1)}:named")]
        others = [await issue(attempt_key(wf, 0, 12)), await issue(attempt_key(wf, 0, 2))]
        revoked = await pki.revoke_attempt(workflow_id=wf, step=0, attempt=1)
        assert sorted(revoked.revoked) == sorted(first)
        assert [(await pki.get_join_token(join_token_id=t)).state for t in first] == ["revoked", "revoked"]
        assert [(await pki.get_join_token(join_token_id=t)).state for t in others] == ["active", "active"]
        assert (await pki.revoke_attempt(workflow_id=wf, step=0, attempt=1)).revoked == []

        # a late run of attempt 1 (an engine that lost its shard) mints nothing usable
        err = await refused(issue(f"{attempt_key(wf, 0, 1)}:late"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "attempt-superseded")
        tokens = await pki.list_join_tokens(tenant_id="acme")
        late = [t for t in tokens if (t.idempotency_key or "").endswith(":late")]
        assert [t.state for t in late] == ["revoked"]
        err = await refused(issue(attempt_key(wf, 0, 1)))  # nor gets attempt 1's token again
        assert err.reason == "attempt-superseded"
        assert await issue(f"{attempt_key(wf, 0, 12)}:x")  # attempt 12 is another attempt

        err = await refused(bc_api.call("pki", "tokens.revoke_attempt", {"workflowId": "x", "step": 0}))
        assert err.code is ErrorCode.INVALID_INPUT


async def test_secrets_revokes_a_step_attempts_values_and_refuses_late_ones(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    secrets = SecretsClient(bc_api)
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        attempt1 = secrets.for_step(tenant_id="acme", workflow_id=wf, step=0, attempt=1)
        keyed = await attempt1.put(b"one", idempotency_key=attempt_key(wf, 0, 1))
        named = await attempt1.put(b"two", idempotency_key="userdata")
        unkeyed = await attempt1.put(b"three")
        attempt12 = secrets.for_step(tenant_id="acme", workflow_id=wf, step=0, attempt=12)
        kept = await attempt12.put(b"four", idempotency_key="userdata")
        assert (await secrets.describe(ref=named)).idempotency_key == f"{attempt_key(wf, 0, 1)}:userdata"

        revoked = await secrets.revoke_attempt(workflow_id=wf, step=0, attempt=1)
        assert sorted(revoked.revoked) == sorted([keyed, named, unkeyed])
        for ref in (keyed, named, unkeyed):
            err = await refused(secrets.get(ref=ref))
            assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "secret-revoked")
            assert (await secrets.describe(ref=ref)).revoked_at is not None
        assert await secrets.get(ref=kept) == b"four"

        err = await refused(attempt1.put(b"late"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "attempt-superseded")
        err = await refused(attempt1.put(b"late", idempotency_key="userdata"))  # not even the old ref
        assert err.reason == "attempt-superseded"


async def test_the_command_queue_cancels_an_attempt_on_every_node_and_fences_it(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    cq = CommandQueueClient(bc_api)
    wf, other_wf = new_id("wf"), new_id("wf")
    nodes = [new_id("node"), new_id("node")]

    def command(node: str, key: str, workflow: str = wf) -> EnqueueCommand:
        return EnqueueCommand(
            node_id=node, site_id="lab1", kind="power.setPower", payload={"action": "on"}, key=key,
            target="site", workflow_id=workflow, step=0,
        )  # fmt: skip

    settings = msgspec.structs.replace(bc_settings, app="engine_test_app:app")
    async with CommandQueueService(settings):
        first = [
            await cq.enqueue(command(nodes[0], attempt_key(wf, 0, 1))),
            await cq.enqueue(command(nodes[1], f"{attempt_key(wf, 0, 1)}:other")),
        ]
        kept = await cq.enqueue(command(nodes[0], attempt_key(wf, 0, 12)))
        reply = await cq.cancel_under(key_prefix=attempt_key(wf, 0, 1), workflow_id=wf, fence=True)
        assert sorted(reply.cancelled) == sorted(c.id for c in first)
        assert reply.running == []  # none was claimed
        assert (await cq.get(id=kept.id)).state == "pending"

        err = await refused(cq.enqueue(command(nodes[1], f"{attempt_key(wf, 0, 1)}:late")))
        assert (err.code, err.reason, err.path) == (ErrorCode.INVALID_STATE, "attempt-superseded", "key")
        late = (await cq.list_commands(workflow_id=wf, state="cancelled")).commands
        assert {c.key for c in late} >= {f"{attempt_key(wf, 0, 1)}:late"}  # never went out
        assert (await cq.enqueue(command(nodes[1], attempt_key(other_wf, 0, 1), other_wf))).state == "pending"

        err = await refused(cq.cancel_under(key_prefix="wf:", workflow_id=wf, fence=True))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "keyPrefix")
