"""Attacks an operator fears, against bc-pki and bc-secrets running as their own processes.

Each attack is refused with its code, refused joins and fetches are audited, and the
services' logs never hold a token or a secret value.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.pki_client import (
    AgentIdentity,
    JoinClaims,
    PkiClient,
    make_csr,
    new_agent_key,
    sign_bytes,
    signing_payload,
)
from better_compute.secrets_client import FETCH_PURPOSE, SecretsClient
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcess, ServiceProcesses
from better_compute.wire import Subjects, encode_ok
from better_compute.wire.cmdq import LiveWithRef, LiveWithRefReply

MACHINE_A = JoinClaims(macs=["aa:bb:cc:00:00:0a"], product_uuid="uuid-a", serial="SER-A")
MACHINE_B = JoinClaims(macs=["aa:bb:cc:00:00:0b"], product_uuid="uuid-b", serial="SER-B")
EXPECT_A = {"mac": "AA:BB:CC:00:00:0A", "productUuid": "UUID-A", "serial": "SER-A"}
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class FakeCommandQueueResponder:
    """Plays bc-command-queue's ``commands.live_with_ref`` on the real bus.

    It stands in for issue 4 (the command-queue service) until that lands; then these tests
    start ``bc-command-queue`` and enqueue real commands instead. It answers as
    ``wire.cmdq.LiveWithRef`` says: a live command for the agent, whose key is the prefix or
    continues it with ``#``/``:``, and whose payload holds the ref as a string value.
    """

    def __init__(self, nc: Nats, subjects: Subjects) -> None:
        self.nc = nc
        self.subject = subjects.api("command-queue", "commands", "live_with_ref")
        self.commands: dict[str, dict[str, Any]] = {}
        self._sub: Subscription | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> FakeCommandQueueResponder:
        self._sub = await self.nc.subscribe(self.subject, cb=self._answer)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    def add(self, *, agent_id: str, key: str, payload: Any, state: str = "running") -> str:
        command_id = f"cmd_fake{next(self._ids)}"
        self.commands[command_id] = {
            "agent_id": agent_id, "key": key, "payload": payload, "state": state,
        }  # fmt: skip
        return command_id

    def settle(self, command_id: str, state: str = "succeeded") -> None:
        self.commands[command_id]["state"] = state

    async def _answer(self, msg: Msg) -> None:
        ask = msgspec.json.decode(msg.data, type=LiveWithRef)
        live = next(
            (
                cid
                for cid, c in self.commands.items()
                if c["agent_id"] == ask.agent_id
                and c["state"] in ("pending", "dispatched", "acked", "running")
                and (c["key"] == ask.key_prefix or c["key"][: len(ask.key_prefix) + 1]
                     in (ask.key_prefix + "#", ask.key_prefix + ":"))
                and ask.ref in json.dumps(c["payload"])
            ),
            None,
        )  # fmt: skip
        await msg.respond(encode_ok(LiveWithRefReply(live=live is not None, command_id=live)))


async def refused(coro: Any) -> BcError:
    with pytest.raises(BcError) as info:
        await coro
    return info.value


def assert_nothing_leaked(procs: list[ServiceProcess], *secrets: str | bytes) -> None:
    """No secret, nor its base64, in any process's log: and the logs did record the attacks."""
    forms: list[str] = []
    for s in secrets:
        raw = s if isinstance(s, bytes) else s.encode()
        forms += [
            raw.decode(),
            base64.b64encode(raw).decode(),
            base64.urlsafe_b64encode(raw).decode(),
        ]
    for proc in procs:
        log = proc.output()
        assert "service_started" in log
        for form in forms:
            assert form not in log, f"{proc.service} logged a secret"


async def join(pki: PkiClient, token: str, claims: JoinClaims = MACHINE_A) -> AgentIdentity:
    key = new_agent_key()
    return AgentIdentity.from_join(await pki.join(token=token, csr=make_csr(key), claims=claims), key)


async def test_join_token_attacks(bc_processes: ServiceProcesses, bc_api: ApiClient) -> None:
    proc = bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    pki = PkiClient(bc_api)
    tokens: list[str] = []

    async def mint(**kw: Any) -> Any:
        args = {"tenant_id": "root", "role": "provisioned", "site_id": "site-a", "ttl_seconds": 300}
        issued = await pki.issue_join_token(**(args | kw))
        tokens.append(issued.token)
        return issued

    # replay: the request that joined once is refused the second time, as is any other
    once = await mint(expect=EXPECT_A)
    key = new_agent_key()
    request = {"token": once.token, "csr": make_csr(key), "claims": msgspec.to_builtins(MACHINE_A)}
    await bc_api.call("pki", "agents.join", request)
    err = await refused(bc_api.call("pki", "agents.join", request))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-used-up")
    err = await refused(join(pki, once.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-used-up")

    # another machine's claims: refused, and the token is not spent by it
    for_a = await mint(expect=EXPECT_A)
    err = await refused(join(pki, for_a.token, MACHINE_B))
    assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "claims-mismatch")
    half_right = JoinClaims(macs=MACHINE_A.macs, product_uuid="uuid-a", serial="SER-B")
    err = await refused(join(pki, for_a.token, half_right))
    assert err.details["claims"] == ["serial"]
    assert (await pki.get_join_token(for_a.id)).uses == 0
    machine_a = await join(pki, for_a.token)
    assert machine_a.agent_id

    # a race for a single-use token: exactly one join wins
    race = await mint()
    results = await asyncio.gather(
        *(join(pki, race.token, MACHINE_B) for _ in range(8)), return_exceptions=True
    )
    winners = [r for r in results if isinstance(r, AgentIdentity)]
    losers = [r for r in results if isinstance(r, BcError)]
    assert len(winners) == 1
    assert {(e.code, e.reason) for e in losers} == {(ErrorCode.UNAUTHENTICATED, "token-used-up")}

    expired = await mint(ttl_seconds=1)
    await asyncio.sleep(1.5)
    err = await refused(join(pki, expired.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-expired")

    revoked = await mint()
    await pki.revoke_join_token(revoked.id, reason="leaked in a ticket")
    err = await refused(join(pki, revoked.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-revoked")

    guessed = "bcjt_" + base64.urlsafe_b64encode(b"\x00" * 32).decode().rstrip("=")
    err = await refused(join(pki, guessed))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-unknown")

    outcomes = [a.outcome for a in await pki.list_joins(limit=100)]
    assert outcomes.count("joined") == 3
    for refusal in ("token-used-up", "claims-mismatch", "token-expired", "token-revoked",
                    "token-unknown"):  # fmt: skip
        assert refusal in outcomes
    assert outcomes.count("token-used-up") == 2 + 7
    assert_nothing_leaked([proc], *tokens)
    assert '"event": "join_refused"' in proc.output()


async def test_secret_fetch_attacks(
    bc_processes: ServiceProcesses, bc_api: ApiClient, bc_nats: Nats, bc_subjects: Subjects
) -> None:
    procs = [bc_processes.start("bc-pki"), bc_processes.start("bc-secrets")]
    await bc_processes.wait_ready()
    pki, secrets = PkiClient(bc_api), SecretsClient(bc_api)
    wf = new_id("wf")
    value = b"root-password: " + new_id("sec").encode()
    tokens: list[str] = []

    async def agent(site: str = "site-a") -> AgentIdentity:
        t = await pki.issue_join_token(tenant_id="root", role="node", site_id=site, ttl_seconds=60)
        tokens.append(t.token)
        return await join(pki, t.token)

    async with FakeCommandQueueResponder(bc_nats, bc_subjects) as cmdq:
        owner, other, elsewhere = await agent(), await agent(), await agent("site-b")
        ref = (await secrets.put(value, tenant_id="acme", workflow_id=wf, step=3)).ref
        unsent = (await secrets.put(value + b"!", tenant_id="acme", workflow_id=wf, step=3)).ref
        errors: list[BcError] = []

        async def denied(identity: AgentIdentity, what: str, code: ErrorCode) -> BcError:
            err = await refused(secrets.fetch(what, identity=identity))
            assert err.code is code, (err, what)
            errors.append(err)
            return err

        # a fetch with no command at all
        await denied(owner, ref, ErrorCode.PERMISSION_DENIED)
        command = cmdq.add(agent_id=owner.agent_id, key=f"wf:{wf}:3#1", payload={"ref": ref})
        assert await secrets.fetch(ref, identity=owner) == value
        # a fetch by another agent, of this site or another
        await denied(other, ref, ErrorCode.PERMISSION_DENIED)
        await denied(elsewhere, ref, ErrorCode.PERMISSION_DENIED)
        # a ref of the same step that the command does not carry
        await denied(owner, unsent, ErrorCode.PERMISSION_DENIED)
        # the same signed request again
        signed = owner.signed_request(FETCH_PURPOSE, ref=ref)
        await bc_api.call("secrets", "secrets.fetch", signed)
        err = await refused(bc_api.call("secrets", "secrets.fetch", signed))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "signature-replayed")
        errors.append(err)
        # another agent presenting the owner's certificate id, signing with its own key
        forged = AgentIdentity(cert_id=owner.cert_id, agent_id=owner.agent_id, private_key=other.private_key)
        err = await denied(forged, ref, ErrorCode.UNAUTHENTICATED)
        assert err.reason == "bad-signature"
        garbage = {**owner.signed_request(FETCH_PURPOSE, ref=ref), "signature": "AAAA"}
        err = await refused(bc_api.call("secrets", "secrets.fetch", garbage))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "bad-signature")
        # a fetch after the command settled
        cmdq.settle(command)
        await denied(owner, ref, ErrorCode.PERMISSION_DENIED)
        # a revoked certificate, even with a live command
        cmdq.add(agent_id=owner.agent_id, key=f"wf:{wf}:3#2", payload={"ref": ref})
        assert await secrets.fetch(ref, identity=owner) == value
        await pki.revoke_certificate(owner.cert_id, reason="disk stolen")
        err = await denied(owner, ref, ErrorCode.UNAUTHENTICATED)
        assert err.reason == "cert-revoked"

        audit = await secrets.list_fetches(limit=100)

    reasons = sorted(a.reason or "" for a in audit if a.outcome == "denied")
    assert reasons == sorted(
        ["no-live-command"] * 5 + ["signature-replayed", "bad-signature", "bad-signature",
                                    "cert-revoked"]
    )  # fmt: skip
    assert [a.outcome for a in audit].count("granted") == 3
    for e in errors:
        assert value.decode() not in f"{e.message} {e.details}"
    assert_nothing_leaked(procs, value, value + b"!", *tokens)
    assert '"event": "secret_fetch_denied"' in procs[1].output()


async def test_forged_reused_and_revoked_signatures(
    bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    proc = bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    pki = PkiClient(bc_api)
    token = await pki.issue_join_token(
        tenant_id="root", role="node", site_id="site-a", ttl_seconds=60, max_uses=3
    )
    victim, attacker = await join(pki, token.token), await join(pki, token.token)
    p256_key = new_agent_key("p256")
    p256 = AgentIdentity.from_join(await pki.join(token=token.token, csr=make_csr(p256_key)), p256_key)
    result = {"kind": "result", "commandId": "cmd_1", "state": "succeeded"}
    data, sig = victim.sign("agent.result", result)
    assert (await pki.verify(signer_id=victim.cert_id, data=data, signature=sig)).agent_id == (
        victim.agent_id
    )

    async def bad(signer: str, d: bytes, s: bytes, **kw: Any) -> str | None:
        err = await refused(pki.verify(signer_id=signer, data=d, signature=s, **kw))
        assert err.code is ErrorCode.UNAUTHENTICATED
        return err.reason

    # forged: a changed result, random bytes, or the attacker's key under the victim's name
    tampered = signing_payload("agent.result", {**result, "state": "failed"})
    assert await bad(victim.cert_id, tampered, sig) == "bad-signature"
    assert await bad(victim.cert_id, data, b"\x00" * 64) == "bad-signature"
    _d, attacker_sig = attacker.sign("agent.result", result)
    assert await bad(victim.cert_id, data, attacker_sig) == "bad-signature"
    assert await bad(victim.agent_id, data, attacker_sig) == "bad-signature"
    # a signature made for one purpose, presented for another
    assert await bad(victim.cert_id, signing_payload("secrets.fetch", result), sig) == ("bad-signature")
    # re-used where freshness is required, including a malleated ECDSA signature
    now = time.time_ns() // 1_000_000
    fresh = signing_payload("secrets.fetch", {"ref": "sec_1", "signedAtMs": now, "nonce": "n1"})
    ps = sign_bytes(p256_key, fresh)
    await pki.verify(signer_id=p256.cert_id, data=fresh, signature=ps, once=True, signed_at_ms=now)
    assert await bad(p256.cert_id, fresh, ps, once=True, signed_at_ms=now) == "signature-replayed"
    r, s = decode_dss_signature(ps)
    malleated = encode_dss_signature(r, P256_ORDER - s)
    assert await bad(p256.agent_id, fresh, malleated, once=True, signed_at_ms=now) == ("signature-replayed")
    # a revoked certificate
    await pki.revoke_certificate(victim.cert_id)
    assert await bad(victim.cert_id, data, sig) == "cert-revoked"
    assert await bad(victim.agent_id, data, sig) == "cert-revoked"
    assert await bad(new_id("agent"), data, sig) == "unknown-signer"
    assert_nothing_leaked([proc], token.token)
    assert '"event": "signature_refused"' in proc.output()


async def test_an_expired_certificate_signs_nothing(
    bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    bc_processes.extra_env["BC_PKI_CERT_TTL_SECONDS"] = "1"
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    pki = PkiClient(bc_api)
    token = await pki.issue_join_token(tenant_id="root", role="site", site_id="s", ttl_seconds=60)
    agent = await join(pki, token.token)
    await asyncio.sleep(1.5)
    data, sig = agent.sign("agent.event", {"kind": "heartbeat"})
    err = await refused(pki.verify(signer_id=agent.cert_id, data=data, signature=sig))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "cert-expired")
    assert (await pki.get_certificate(agent.cert_id)).state == "expired"
