"""bc-secrets on a real nats-server and PostgreSQL: sealed values and the agent fetch gate."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bc_command_queue.service import CommandQueueService
from bc_pki.service import PkiService
from bc_secrets.service import SecretsService
from better_compute.agent import Enrollment
from better_compute.agent.sim import join_agent
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import AgentIdentity, new_agent_key
from better_compute.keyring import rotate_key_file
from better_compute.service import ApiClient, connect
from better_compute.testing import refused
from better_compute.wire import Subjects
from better_compute.wire.cmdq import CommandView, LiveWithRef
from better_compute.wire.secrets import FETCH_PURPOSE
from secrets_test_app import APP, enqueue_ref, settle

VALUE = b"#cloud-config\npassword: hunter2-the-real-one\n"


async def new_node_agent(api: ApiClient, *, site: str = "site-a") -> Enrollment:
    """A node's bcd, joined through bc-pki: its agent id is the node id."""
    return await join_agent(api, site_id=site, role="node", node_id=new_id("node"))


class AskedForRefs:
    """Listens (without answering) to what bc-secrets asks bc-command-queue's
    ``commands.live_with_ref``: the service answers, this only records the questions."""

    def __init__(self, nc: Nats, subjects: Subjects) -> None:
        self.nc = nc
        self.subject = subjects.api("command-queue", "commands", "live_with_ref")
        self.asked: list[LiveWithRef] = []
        self._sub: Subscription | None = None

    async def __aenter__(self) -> AskedForRefs:
        self._sub = await self.nc.subscribe(self.subject, cb=self._record)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _record(self, msg: Msg) -> None:
        self.asked.append(msgspec.json.decode(msg.data, type=LiveWithRef))


@pytest.fixture
def bc_settings(bc_settings: Settings) -> Settings:
    """Every service here loads the app with ``test.useSecret``, a kind carrying a ref."""
    return msgspec.structs.replace(bc_settings, app=APP)


@pytest.fixture
def secrets(bc_api: ApiClient) -> SecretsClient:
    return SecretsClient(bc_api)


async def test_values_are_sealed_at_rest_and_listed_without_them(
    bc_settings: Settings, secrets: SecretsClient
) -> None:
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        info = await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=3, label="userdata")
        assert info.ref.startswith("sec_")
        assert (info.size, info.step, info.label) == (len(VALUE), 3, "userdata")
        assert await secrets.get(ref=info.ref) == VALUE
        listed = await secrets.list_secrets(workflow_id=wf)
        assert [s.ref for s in listed] == [info.ref]
        assert await secrets.describe(ref=info.ref) == info
        encoded = msgspec.json.encode(listed)
        assert b"hunter2" not in encoded
        assert base64.b64encode(VALUE) not in encoded

    conn = await asyncpg.connect(bc_settings.database_url)
    try:
        row = await conn.fetchrow("SELECT * FROM secrets.secrets")
    finally:
        await conn.close()
    assert b"hunter2" not in row["sealed"]
    assert all(b"hunter2" not in str(v).encode() for v in dict(row).values())


async def test_put_under_an_idempotency_key_keeps_the_first_ref(
    bc_settings: Settings, secrets: SecretsClient
) -> None:
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        step = secrets.for_step(tenant_id="acme", workflow_id=wf, step=1)
        first = await step.put(VALUE, idempotency_key="wf:k#1")
        again = await step.put(b"re-rendered", idempotency_key="wf:k#1")
        other = await step.put(VALUE)
        err = await refused(
            secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=2, idempotency_key="wf:k#1")
        )
        assert await secrets.get(ref=again) == VALUE
    assert again == first
    assert other != first
    assert (err.code, err.path) == (ErrorCode.CONFLICT, "idempotencyKey")


async def test_malformed_requests_are_invalid_input_with_a_path(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    wf = new_id("wf")
    put = {"tenantId": "acme", "workflowId": wf, "step": 0, "value": "aGk="}
    cases = [
        ("secrets.put", {**put, "step": -1}, "step"),
        ("secrets.put", {**put, "workflowId": "nope"}, "workflowId"),
        ("secrets.put", {**put, "value": "***"}, "value"),
        ("secrets.put", {**put, "tenantId": "a b"}, "tenantId"),
        ("secrets.put", {**put, "value": base64.b64encode(b"x" * (512 * 1024 + 1)).decode()},
         "value"),
        ("secrets.get", {"ref": "tok_01JAAAAAAAAAAAAAAAAAAAAAAA"}, "ref"),
        ("secrets.get", {}, ""),
        ("secrets.fetch", {"ref": "sec_x"}, ""),
        ("secrets.list", {"limit": 5000}, "limit"),
    ]  # fmt: skip
    async with SecretsService(bc_settings):
        for route, payload, path in cases:
            with pytest.raises(BcError) as info:
                await bc_api.call("secrets", route, payload)
            assert info.value.code is ErrorCode.INVALID_INPUT, route
            assert info.value.path == path or (path == "" and info.value.path is not None), route
        with pytest.raises(BcError) as info:
            await bc_api.call("secrets", "secrets.get", {"ref": new_id("sec")})
        assert info.value.code is ErrorCode.NOT_FOUND


async def test_an_agent_fetches_only_through_a_live_command_of_the_creating_step(
    bc_settings: Settings, bc_api: ApiClient, bc_nats: Nats, bc_subjects: Subjects, tmp_path: Path
) -> None:
    cq, secrets = CommandQueueClient(bc_api), SecretsClient(bc_api)
    wf = new_id("wf")
    async with (
        PkiService(bc_settings),
        SecretsService(bc_settings),
        CommandQueueService(bc_settings),
        AskedForRefs(bc_nats, bc_subjects) as tap,
    ):
        bcd, stranger = await new_node_agent(bc_api), await new_node_agent(bc_api)
        node, agent = bcd.agent_id, bcd.identity

        async def command(key: str, payload: Any, *, workflow: str = wf, step: int = 2) -> CommandView:
            return await enqueue_ref(
                cq, node_id=node, site_id="site-a", key=key, payload=payload, workflow_id=workflow, step=step
            )

        ref = (await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=2)).ref
        other_ref = (await secrets.put(value=b"other-value", tenant_id="acme", workflow_id=wf, step=2)).ref

        # no command at all
        err = await refused(secrets.fetch(ref=ref, identity=agent))
        assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "no-live-command")

        # a live command of step 2, for this agent, carrying the ref
        cmd = await command(f"wf:{wf}:2#1:media", {"ref": {"secretRef": ref}, "note": "user data"})
        # another client on the bus that reads every reply (as agents of one site sharing a NATS
        # user could) sees the value only sealed to the fetching agent's one-time key
        spy = await connect(bc_settings.nats_url, name="spy")
        seen: list[bytes] = []

        async def tap_replies(msg: Any) -> None:
            seen.append(msg.data)

        await spy.subscribe("_INBOX.>", cb=tap_replies)
        await spy.flush()
        assert await secrets.fetch(ref=ref, identity=agent) == VALUE
        await spy.flush()
        await spy.close()
        replies = [json.loads(d) for d in seen if b"sealed" in d]
        assert replies, "the spy saw the reply"
        assert all(VALUE not in d and base64.b64encode(VALUE) not in d for d in seen)
        assert replies[0]["result"]["value"] == ""
        assert tap.asked[-1] == LiveWithRef(agent_id=node, ref=ref, key_prefix=f"wf:{wf}:2")
        # ... which opens only the ref it carries, and only for its own agent
        err = await refused(secrets.fetch(ref=other_ref, identity=agent))
        assert err.code is ErrorCode.PERMISSION_DENIED
        err = await refused(secrets.fetch(ref=ref, identity=stranger.identity))
        assert err.code is ErrorCode.PERMISSION_DENIED
        # the agent runs the command to its end; then a command of step 20 (same digits
        # first) or of another workflow opens nothing
        assert (await settle(bc_api, bcd, cmd.id, tmp_path)).state == "succeeded"
        await command(f"wf:{wf}:20#1", {"ref": ref}, step=20)
        await command(f"wf:{new_id('wf')}:2#1", {"ref": ref}, workflow=new_id("wf"))
        err = await refused(secrets.fetch(ref=ref, identity=agent))
        assert err.code is ErrorCode.PERMISSION_DENIED
        # a bare step key (no #attempt) is the step too, until it is cancelled
        bare = await command(f"wf:{wf}:2", {"ref": ref})
        assert await secrets.fetch(ref=ref, identity=agent) == VALUE
        assert await cq.cancel(id=bare.id, reason="step cancelled") == [bare.id]
        err = await refused(secrets.fetch(ref=ref, identity=agent))
        assert err.code is ErrorCode.PERMISSION_DENIED
        # an unknown ref looks exactly like one the agent may not read
        unknown = await refused(secrets.fetch(ref=new_id("sec"), identity=agent))
        assert (unknown.code, unknown.message, unknown.details) == (
            err.code, err.message, err.details,
        )  # fmt: skip

        audit = await secrets.list_fetches(limit=50)
    granted = [a for a in audit if a.outcome == "granted"]
    assert [(a.ref, a.agent_id) for a in granted] == [(ref, node)] * 2
    assert [a.command_id for a in granted] == [bare.id, cmd.id]
    denied = [a.reason for a in audit if a.outcome == "denied"]
    assert sorted(denied) == sorted(["no-live-command"] * 5 + ["unknown-ref"])
    assert all(a.code == "PERMISSION_DENIED" for a in audit if a.outcome == "denied")


async def test_fetches_are_refused_without_a_valid_fresh_signature(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    pki, secrets = PkiClient(bc_api), SecretsClient(bc_api)
    wf = new_id("wf")
    async with (
        PkiService(bc_settings),
        SecretsService(bc_settings),
        CommandQueueService(bc_settings),
    ):
        bcd = await new_node_agent(bc_api)
        agent = bcd.identity
        ref = (await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=0)).ref
        await enqueue_ref(
            CommandQueueClient(bc_api), node_id=bcd.agent_id, site_id="site-a", key=f"wf:{wf}:0#1",
            payload={"ref": ref}, workflow_id=wf, step=0,
        )  # fmt: skip

        signed = agent.signed_request(
            FETCH_PURPOSE, ref=ref, replyKey=base64.b64encode(os.urandom(32)).decode()
        )
        got = await bc_api.call("secrets", "secrets.fetch", signed)
        assert (got["value"], sorted(got["sealed"])) == ("", ["ciphertext", "ephemeralKey", "nonce"])
        err = await refused(bc_api.call("secrets", "secrets.fetch", signed))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "signature-replayed")

        # signed by a key that is not the certificate's
        impostor = AgentIdentity(cert_id=agent.cert_id, agent_id=agent.agent_id, private_key=new_agent_key())
        err = await refused(secrets.fetch(ref=ref, identity=impostor))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "bad-signature")
        # a signed request for another ref, with the ref swapped
        reply_key = base64.b64encode(os.urandom(32)).decode()
        swapped = {**agent.signed_request(FETCH_PURPOSE, ref=new_id("sec"), replyKey=reply_key), "ref": ref}
        err = await refused(bc_api.call("secrets", "secrets.fetch", swapped))
        assert err.reason == "bad-signature"

        await pki.revoke_certificate(cert_id=agent.cert_id)
        err = await refused(secrets.fetch(ref=ref, identity=agent))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "cert-revoked")

        audit = await secrets.list_fetches(outcome="denied")
    assert sorted(a.reason or "" for a in audit) == [
        "bad-signature", "bad-signature", "cert-revoked", "signature-replayed",
    ]  # fmt: skip


async def test_a_fetch_without_a_reply_key_is_refused_never_answered_in_clear(
    bc_settings: Settings, bc_api: ApiClient, bc_nats: Nats
) -> None:
    """Issue 10 item 5: sealing is mandatory, even for a well-signed request of the right agent."""
    secrets = SecretsClient(bc_api)
    wf = new_id("wf")
    async with (
        PkiService(bc_settings),
        SecretsService(bc_settings),
        CommandQueueService(bc_settings),
    ):
        bcd = await new_node_agent(bc_api)
        ref = (await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=0)).ref
        await enqueue_ref(
            CommandQueueClient(bc_api), node_id=bcd.agent_id, site_id="site-a", key=f"wf:{wf}:0#1",
            payload={"ref": ref}, workflow_id=wf, step=0,
        )  # fmt: skip
        seen: list[bytes] = []

        async def tap_replies(msg: Msg) -> None:
            seen.append(msg.data)

        spy = await bc_nats.subscribe("_INBOX.>", cb=tap_replies)
        # signed exactly as an agent signs it, only without asking for a sealed reply
        clear = bcd.identity.signed_request(FETCH_PURPOSE, ref=ref)
        err = await refused(bc_api.call("secrets", "secrets.fetch", clear))
        # nor with a reply key nothing can be sealed to
        junk = bcd.identity.signed_request(FETCH_PURPOSE, ref=ref, replyKey="!" * 44)
        junk_err = await refused(bc_api.call("secrets", "secrets.fetch", junk))
        await bc_nats.flush()
        await spy.unsubscribe()
        # the agent's own (sealed) fetch still works
        assert await secrets.fetch(ref=ref, identity=bcd.identity) == VALUE
        audit = await secrets.list_fetches()
    assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "replyKey")
    assert (junk_err.code, junk_err.path) == (ErrorCode.INVALID_INPUT, "replyKey")
    assert seen, "the spy saw the replies"
    assert all(b"hunter2" not in d and base64.b64encode(VALUE) not in d for d in seen)
    assert [(a.outcome, a.reason) for a in audit] == [
        ("granted", None), ("denied", "malformed"), ("denied", "malformed"),
    ]  # fmt: skip


async def test_fetch_fails_closed_when_pki_or_the_command_queue_is_away(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    secrets = SecretsClient(bc_api)
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        async with PkiService(bc_settings):
            agent = (await new_node_agent(bc_api)).identity
            ref = (await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=0)).ref
            # pki answers, no command queue does
            err = await refused(secrets.fetch(ref=ref, identity=agent))
            assert err.code is ErrorCode.UNAVAILABLE
        err = await refused(secrets.fetch(ref=ref, identity=agent))
        assert err.code is ErrorCode.UNAVAILABLE
        reasons = [a.reason for a in await secrets.list_fetches(ref=ref)]
    assert reasons == ["pki-unavailable", "command-queue-unavailable"]


async def test_values_survive_key_rotation_and_rewrap(bc_settings: Settings, secrets: SecretsClient) -> None:
    wf = new_id("wf")
    async with SecretsService(bc_settings):
        old = await secrets.put(value=VALUE, tenant_id="acme", workflow_id=wf, step=0)
    key_file = Path(bc_settings.state_dir) / "keys" / "secrets.key"
    old_line = next(ln for ln in key_file.read_text().splitlines() if ln.startswith("bck1:"))
    new_kid = rotate_key_file(key_file)

    async with SecretsService(bc_settings):
        assert await secrets.get(ref=old.ref) == VALUE
        new = await secrets.put(value=b"second-value", tenant_id="acme", workflow_id=wf, step=0)
        assert (new.key_id, (await secrets.describe(ref=old.ref)).key_id) == (new_kid, old.key_id)
        assert (await secrets.rewrap_keys()).rewrapped == 1
        assert (await secrets.describe(ref=old.ref)).key_id == new_kid

    key_file.write_text("\n".join(ln for ln in key_file.read_text().splitlines() if ln != old_line))
    async with SecretsService(bc_settings):
        assert await secrets.get(ref=old.ref) == VALUE
        assert await secrets.get(ref=new.ref) == b"second-value"


async def test_refused_fetches_of_any_shape_are_typed_and_audited_with_what_they_name(
    bc_settings: Settings, bc_nats: Nats, bc_subjects: Subjects, secrets: SecretsClient
) -> None:
    """Issue 10 item 1: a fetch that fails to decode still leaves an audit row, naming the ref
    and the signer as far as the request names them well-formed."""
    ref, cert = new_id("sec"), new_id("cert")
    named = {"ref": ref, "signerId": cert, "signedAtMs": 1, "signature": "", "replyKey": "x"}
    shapes = [
        b"not json",
        b'{"ref": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        json.dumps({**named, "nonce": "n\x00" * 10}).encode(),
        json.dumps({**named, "signedAtMs": 2**64, "nonce": "n" * 16}).encode(),
        json.dumps({"ref": "sec_\x00", "signerId": cert}).encode(),
    ]
    async with SecretsService(bc_settings):
        replies = []
        for data in shapes:
            msg = await bc_nats.request(bc_subjects.api("secrets", "secrets", "fetch"), data, timeout=5)
            replies.append(msgspec.json.decode(msg.data)["error"])
        audit = await secrets.list_fetches()
    assert [r["code"] for r in replies] == ["INVALID_INPUT"] * len(shapes)
    assert all("path" in r["details"] for r in replies)
    assert [(a.outcome, a.reason) for a in audit] == [("denied", "malformed")] * len(shapes)
    # newest first: the last two name a well-formed ref and signer, the NUL one only its signer
    assert [(a.ref, a.signer_id) for a in audit] == [
        (None, cert), (ref, cert), (ref, cert), (None, None), (None, None),
    ]  # fmt: skip


async def test_a_template_secret_is_read_by_the_control_plane_never_fetched_by_an_agent(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    """An enrollment rule's BMC credential: the engine copies it into each enrolled node's own
    standing secret; even a live command for the agent that carries its ref opens nothing."""
    cq, secrets = CommandQueueClient(bc_api), SecretsClient(bc_api)
    async with PkiService(bc_settings), SecretsService(bc_settings), CommandQueueService(bc_settings):
        bcd = await new_node_agent(bc_api)
        template = (await secrets.put_template(VALUE, tenant_id="acme", label="bmc (rule)")).ref
        assert await secrets.get(ref=template) == VALUE
        await enqueue_ref(
            cq, node_id=bcd.agent_id, site_id="site-a", key=f"wf:{new_id('wf')}:0#1",
            payload={"ref": template}, workflow_id=None, step=0,
        )  # fmt: skip
        err = await refused(secrets.fetch(ref=template, identity=bcd.identity))
        assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "no-live-command")
        audit = await secrets.list_fetches(limit=10)
        assert [(a.ref, a.reason) for a in audit if a.outcome == "denied"] == [(template, "template")]
        # one owner at most: a template is neither a workflow step's nor a node's
        both = {"tenantId": "acme", "template": True, "nodeId": bcd.agent_id, "value": "aGk="}
        with pytest.raises(BcError) as info:
            await bc_api.call("secrets", "secrets.put", both)
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "workflowId")
