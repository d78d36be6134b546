"""Attacks an operator fears, against bc-pki and bc-secrets running as their own processes.

Each attack is refused with its code, refused joins and fetches are audited, and the
services' logs never hold a token or a secret value.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from better_compute.agent import Enrollment, enroll
from better_compute.clients.cmdq import CommandQueueClient
from better_compute.clients.pki import PkiClient
from better_compute.clients.secrets import SecretsClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import (
    AgentIdentity,
    make_csr,
    new_agent_key,
    sign_bytes,
    signing_payload,
)
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcess, ServiceProcesses, refused
from better_compute.wire.cmdq import CommandView
from better_compute.wire.pki import JoinClaims
from better_compute.wire.secrets import FETCH_PURPOSE
from pki_time import expire
from secrets_test_app import APP, enqueue_ref, settle

MACHINE_A = JoinClaims(macs=["aa:bb:cc:00:00:0a"], product_uuid="uuid-a", serial="SER-A")
MACHINE_B = JoinClaims(macs=["aa:bb:cc:00:00:0b"], product_uuid="uuid-b", serial="SER-B")
EXPECT_A = {"mac": "AA:BB:CC:00:00:0A", "productUuid": "UUID-A", "serial": "SER-A"}
P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


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


async def test_join_token_attacks(
    bc_processes: ServiceProcesses, bc_api: ApiClient, bc_settings: Settings
) -> None:
    proc = bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    pki = PkiClient(bc_api)
    tokens: list[str] = []

    async def mint(**kw: Any) -> Any:
        args = {"tenant_id": "root", "role": "provisioned", "site_id": "site-a", "ttl_seconds": 300}
        issued = await pki.issue_join_token(**(args | kw))
        tokens.append(issued.token)
        return issued

    # replay: the request that joined once gets the same certificate again (the joiner asking
    # again after a lost answer; a replayer gets a public certificate without its key), and
    # nothing more; any other key is refused
    once = await mint(expect=EXPECT_A)
    key = new_agent_key()
    request = {"token": once.token, "csr": make_csr(key), "claims": msgspec.to_builtins(MACHINE_A)}
    first = await bc_api.call("pki", "agents.join", request)
    again = await bc_api.call("pki", "agents.join", request)
    assert (again["certId"], again["certificatePem"]) == (first["certId"], first["certificatePem"])
    assert (await pki.get_join_token(join_token_id=once.id)).uses == 1
    err = await refused(join(pki, once.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-used-up")

    # another machine's claims: refused, and the token is not spent by it
    for_a = await mint(expect=EXPECT_A)
    err = await refused(join(pki, for_a.token, MACHINE_B))
    assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "claims-mismatch")
    half_right = JoinClaims(macs=MACHINE_A.macs, product_uuid="uuid-a", serial="SER-B")
    err = await refused(join(pki, for_a.token, half_right))
    assert err.details["claims"] == ["serial"]
    assert (await pki.get_join_token(join_token_id=for_a.id)).uses == 0
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

    expired = await mint(ttl_seconds=60)
    await expire(bc_settings, "token", expired.id)  # a minute on: moved, not slept
    err = await refused(join(pki, expired.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-expired")

    revoked = await mint()
    await pki.revoke_join_token(join_token_id=revoked.id, reason="leaked in a ticket")
    err = await refused(join(pki, revoked.token))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-revoked")

    guessed = "bcjt_" + base64.urlsafe_b64encode(b"\x00" * 32).decode().rstrip("=")
    err = await refused(join(pki, guessed))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-unknown")

    outcomes = [a.outcome for a in await pki.list_joins(limit=100)]
    assert outcomes.count("joined") == 3 + 1  # and the replay answered again, audited
    for refusal in ("token-used-up", "claims-mismatch", "token-expired", "token-revoked",
                    "token-unknown"):  # fmt: skip
        assert refusal in outcomes
    assert outcomes.count("token-used-up") == 1 + 7
    assert_nothing_leaked([proc], *tokens)
    assert '"event": "join_refused"' in proc.output()


async def test_secret_fetch_attacks(
    bc_processes: ServiceProcesses, bc_settings: Settings, bc_api: ApiClient, tmp_path: Path
) -> None:
    bc_processes.settings = msgspec.structs.replace(bc_settings, app=APP)  # a kind carrying a ref
    procs = [bc_processes.start(s) for s in ("bc-pki", "bc-secrets", "bc-command-queue")]
    await bc_processes.wait_ready()
    pki, secrets, cq = PkiClient(bc_api), SecretsClient(bc_api), CommandQueueClient(bc_api)
    wf = new_id("wf")
    value = b"root-password: " + new_id("sec").encode()
    tokens: list[str] = []

    async def agent(site: str = "site-a") -> Enrollment:
        """A node's bcd (agent id = node id), joined with a token minted for that node."""
        t = await pki.issue_join_token(
            tenant_id="root", role="node", site_id=site, ttl_seconds=60, node_id=new_id("node")
        )
        tokens.append(t.token)
        return await enroll(pki, token=t.token, claims=MACHINE_A)

    async def command(key: str) -> CommandView:
        return await enqueue_ref(
            cq, node_id=bcd.agent_id, site_id="site-a", key=key, payload={"ref": ref}, workflow_id=wf, step=3
        )

    bcd, other_bcd, elsewhere_bcd = await agent(), await agent(), await agent("site-b")
    owner, other, elsewhere = bcd.identity, other_bcd.identity, elsewhere_bcd.identity
    ref = (await secrets.put(value=value, tenant_id="acme", workflow_id=wf, step=3)).ref
    unsent = (await secrets.put(value=value + b"!", tenant_id="acme", workflow_id=wf, step=3)).ref
    errors: list[BcError] = []

    async def denied(identity: AgentIdentity, what: str, code: ErrorCode) -> BcError:
        err = await refused(secrets.fetch(ref=what, identity=identity))
        assert err.code is code, (err, what)
        errors.append(err)
        return err

    # a fetch with no command at all
    await denied(owner, ref, ErrorCode.PERMISSION_DENIED)
    first = await command(f"wf:{wf}:3#1")
    assert await secrets.fetch(ref=ref, identity=owner) == value
    # a fetch by another agent, of this site or another
    await denied(other, ref, ErrorCode.PERMISSION_DENIED)
    await denied(elsewhere, ref, ErrorCode.PERMISSION_DENIED)
    # a ref of the same step that the command does not carry
    await denied(owner, unsent, ErrorCode.PERMISSION_DENIED)
    # the same signed request again
    reply_key = base64.b64encode(os.urandom(32)).decode()
    signed = owner.signed_request(FETCH_PURPOSE, ref=ref, replyKey=reply_key)
    await bc_api.call("secrets", "secrets.fetch", signed)
    err = await refused(bc_api.call("secrets", "secrets.fetch", signed))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "signature-replayed")
    errors.append(err)
    # another agent presenting the owner's certificate id, signing with its own key
    forged = AgentIdentity(cert_id=owner.cert_id, agent_id=owner.agent_id, private_key=other.private_key)
    err = await denied(forged, ref, ErrorCode.UNAUTHENTICATED)
    assert err.reason == "bad-signature"
    garbage = {**owner.signed_request(FETCH_PURPOSE, ref=ref, replyKey=reply_key), "signature": "AAAA"}
    err = await refused(bc_api.call("secrets", "secrets.fetch", garbage))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "bad-signature")
    # a fetch after the command settled: the owner's agent ran it to its end
    settled = await settle(bc_api, bcd, first.id, tmp_path)
    assert (settled.state, settled.agent_id, settled.attested) == ("succeeded", bcd.agent_id, True)
    await denied(owner, ref, ErrorCode.PERMISSION_DENIED)
    # a revoked certificate, even with a live command
    second = await command(f"wf:{wf}:3#2")
    assert await secrets.fetch(ref=ref, identity=owner) == value
    await pki.revoke_certificate(cert_id=owner.cert_id, reason="disk stolen")
    err = await denied(owner, ref, ErrorCode.UNAUTHENTICATED)
    assert err.reason == "cert-revoked"
    assert (await cq.get(id=second.id)).state == "dispatched"

    audit = await secrets.list_fetches(limit=100)
    reasons = sorted(a.reason or "" for a in audit if a.outcome == "denied")
    assert reasons == sorted(
        ["no-live-command"] * 5 + ["signature-replayed", "bad-signature", "bad-signature",
                                    "cert-revoked"]
    )  # fmt: skip
    assert [a.command_id for a in audit if a.outcome == "granted"] == [second.id, first.id, first.id]
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
    await pki.revoke_certificate(cert_id=victim.cert_id)
    assert await bad(victim.cert_id, data, sig) == "cert-revoked"
    assert await bad(victim.agent_id, data, sig) == "cert-revoked"
    assert await bad(new_id("agent"), data, sig) == "unknown-signer"
    assert_nothing_leaked([proc], token.token)
    assert '"event": "signature_refused"' in proc.output()


async def test_an_expired_certificate_signs_nothing(
    bc_processes: ServiceProcesses, bc_api: ApiClient, bc_settings: Settings
) -> None:
    bc_processes.extra_env["BC_PKI_CERT_TTL"] = "2h"
    bc_processes.start("bc-pki")
    await bc_processes.wait_ready()
    pki = PkiClient(bc_api)
    token = await pki.issue_join_token(tenant_id="root", role="site", site_id="s", ttl_seconds=60)
    agent = await join(pki, token.token)
    cert = await pki.get_certificate(cert_id=agent.cert_id)
    lifetime = cert.not_after - dt.datetime.now(dt.UTC)
    assert dt.timedelta(minutes=119) < lifetime <= dt.timedelta(hours=2)  # the setting
    await expire(bc_settings, "certificate", agent.cert_id)  # two hours on: moved, not slept
    data, sig = agent.sign("agent.event", {"kind": "heartbeat"})
    err = await refused(pki.verify(signer_id=agent.cert_id, data=data, signature=sig))
    assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "cert-expired")
    assert (await pki.get_certificate(cert_id=agent.cert_id)).state == "expired"
