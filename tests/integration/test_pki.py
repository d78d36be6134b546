"""bc-pki on a real nats-server and PostgreSQL: tokens, joins, certificates, signatures, keys."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
import stat
import time
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from nats.aio.client import Client as Nats

from bc_pki.service import PkiService
from better_compute.clients.audit import AuditClient
from better_compute.clients.pki import PkiClient
from better_compute.config import PkiSettings, Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.crypto import (
    AgentIdentity,
    make_csr,
    new_agent_key,
    sign_bytes,
    signing_payload,
)
from better_compute.keyring import rotate_key_file
from better_compute.service import ApiClient
from better_compute.testing import refused
from better_compute.wire import Subjects
from better_compute.wire.pki import IssuedJoinToken, JoinClaims, JoinResult
from pki_time import expire

MACHINE = JoinClaims(macs=["AA-BB-CC-00-11-22", "aa:bb:cc:00:11:23"], product_uuid="P-1", serial="S1")
OTHER_MACHINE = JoinClaims(macs=["aa:bb:cc:99:99:99"], product_uuid="p-2", serial="S2")


async def issue(pki: PkiClient, **kw: Any) -> IssuedJoinToken:
    args: dict[str, Any] = {
        "tenant_id": "root",
        "role": "node",
        "site_id": "site-a",
        "ttl_seconds": 600,
    }
    args.update(kw)
    return await pki.issue_join_token(**args)


async def join(
    pki: PkiClient, token: str, claims: JoinClaims = MACHINE, kind: Any = "ed25519"
) -> tuple[JoinResult, AgentIdentity]:
    key = new_agent_key(kind)
    result = await pki.join(token=token, csr=make_csr(key), claims=claims)
    return result, AgentIdentity.from_join(result, key)


@pytest.fixture
def pki(bc_api: ApiClient) -> PkiClient:
    return PkiClient(bc_api)


async def test_a_token_is_shown_once_and_only_its_hash_is_stored(
    bc_settings: Settings, pki: PkiClient
) -> None:
    async with PkiService(bc_settings):
        issued = await issue(pki, max_uses=2, expect={"mac": "AA:BB:CC:00:11:22"})
        assert issued.token.startswith("bcjt_")
        assert issued.id == issued.join_token_id
        assert issued.id.startswith("tok_")
        assert issued.token not in repr(issued)
        listed = await pki.list_join_tokens(tenant_id="root")
        assert [t.join_token_id for t in listed] == [issued.id]
        assert issued.token not in msgspec.json.encode(listed).decode()
        info = await pki.get_join_token(join_token_id=issued.id)
        assert (info.state, info.uses, info.max_uses) == ("active", 0, 2)
        assert info.expect.mac == "aa:bb:cc:00:11:22"

    conn = await asyncpg.connect(bc_settings.database_url)
    try:
        row = await conn.fetchrow("SELECT * FROM pki.join_tokens")
    finally:
        await conn.close()
    assert row["token_hash"] == hashlib.sha256(issued.token.encode()).digest()
    assert all(issued.token not in str(value) for value in dict(row).values())


async def test_issue_under_an_idempotency_key_gives_the_same_token_even_after_a_restart(
    bc_settings: Settings, pki: PkiClient
) -> None:
    secret = os.urandom(32)
    async with PkiService(bc_settings):
        first = await issue(pki, idempotency_key="wf:wf_1:0#1", mint_secret=secret)
        again = await issue(pki, idempotency_key="wf:wf_1:0#1", mint_secret=secret)
        other = await issue(pki, idempotency_key="wf:wf_1:0#2", mint_secret=secret)
        plain = [await issue(pki), await issue(pki)]
        err = await refused(issue(pki, idempotency_key="wf:wf_1:0#1", role="site", mint_secret=secret))
        # keyed without a mint secret: minted once, shown once
        shown = await issue(pki, idempotency_key="by-hand")
        once = await refused(issue(pki, idempotency_key="by-hand"))
        alone = await refused(issue(pki, mint_secret=secret))
    assert (again.id, again.token) == (first.id, first.token)
    assert other.token != first.token
    assert plain[0].token != plain[1].token
    assert (err.code, err.path) == (ErrorCode.CONFLICT, "idempotencyKey")
    assert (once.code, once.reason, once.details["joinTokenId"]) == (
        ErrorCode.CONFLICT,
        "already-issued",
        shown.id,
    )
    assert (alone.code, alone.path) == (ErrorCode.INVALID_INPUT, "mintSecret")

    async with PkiService(bc_settings):
        after_restart = await issue(pki, idempotency_key="wf:wf_1:0#1", mint_secret=secret)
        assert (after_restart.id, after_restart.token) == (first.id, first.token)
        assert len(await pki.list_join_tokens()) == 5


async def test_a_keyed_token_is_given_again_only_to_the_step_that_minted_it(
    bc_settings: Settings, pki: PkiClient
) -> None:
    """Issue 10 item 4: the idempotency key a listing shows must not give the token to anyone."""
    attempt_secret = os.urandom(32)  # what the engine keeps for the step attempt

    async def engine_step() -> bytes:
        return attempt_secret

    async def other_engine() -> bytes:
        return os.urandom(32)

    token_args: dict[str, Any] = {
        "tenant_id": "root", "role": "provisioned", "site_id": "site-a", "ttl_seconds": 600,
    }  # fmt: skip
    async with PkiService(bc_settings):
        minted = await pki.for_step(idempotency_key="wf:wf_1:0#1", before_mint=engine_step).issue_join_token(
            **token_args
        )
        # the step runs again (an engine crash, a service outage): it gets its token back
        rerun = await pki.for_step(idempotency_key="wf:wf_1:0#1", before_mint=engine_step).issue_join_token(
            **token_args
        )
        listed = await pki.list_join_tokens()
        # anyone else, with everything the listing shows, gets no token
        stolen = await refused(pki.issue_join_token(**token_args, idempotency_key=listed[0].idempotency_key))
        forged = await refused(
            pki.for_step(idempotency_key="wf:wf_1:0#1", before_mint=other_engine).issue_join_token(
                **token_args
            )
        )
        after = await pki.list_join_tokens()
    assert (rerun.id, rerun.token) == (minted.id, minted.token)
    for err in (stolen, forged):
        assert (err.code, err.reason, err.path) == (ErrorCode.CONFLICT, "already-issued", "idempotencyKey")
        assert err.details["joinTokenId"] == minted.id
        assert minted.token not in str(err.details) + err.message
    assert minted.token not in msgspec.json.encode(listed).decode()
    assert [t.join_token_id for t in after] == [minted.id]


async def test_a_join_earns_a_certificate_signed_by_the_ca_and_is_audited(
    bc_settings: Settings, pki: PkiClient
) -> None:
    async with PkiService(bc_settings):
        ca = await pki.ca()
        issued = await issue(pki, max_uses=2, expect={"mac": "aa:bb:cc:00:11:22", "serial": "S1"})
        first, _ = await join(pki, issued.token)
        second, _ = await join(pki, issued.token, kind="p256")
        info = await pki.get_join_token(join_token_id=issued.id)
        certs = await pki.list_certificates(join_token_id=issued.id)
        await pki.revoke_certificate(cert_id=second.cert_id, reason="test")
        # several ids in one call (bcx agents list): only those, revoked ones on request
        by_ids = await pki.certificates_page(cert_ids=[first.cert_id, second.cert_id, new_id("cert")])
        with_revoked = await pki.certificates_page(
            cert_ids=[first.cert_id, second.cert_id], include_revoked=True, limit=2
        )
        audit = await pki.list_joins(join_token_id=issued.id)

    assert (info.uses, info.state) == (2, "used")
    assert {c.cert_id for c in certs} == {first.cert_id, second.cert_id}
    assert [c.cert_id for c in by_ids.certificates] == [first.cert_id]
    assert {(c.cert_id, c.state) for c in with_revoked.certificates} == {
        (first.cert_id, "valid"),
        (second.cert_id, "revoked"),
    }
    assert [a.outcome for a in audit] == ["joined", "joined"]
    assert audit[0].claims is not None
    assert "aa:bb:cc:00:11:22" in audit[0].claims.macs
    ca_cert = x509.load_pem_x509_certificate(ca.certificate_pem.encode())
    assert first.ca_pem == ca.certificate_pem
    for result in (first, second):
        cert = x509.load_pem_x509_certificate(result.certificate_pem.encode())
        cert.verify_directly_issued_by(ca_cert)
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == (result.agent_id)
        assert result.agent_id.startswith("agent_")
        assert (result.role, result.site_id, result.tenant_id) == ("node", "site-a", "root")
    assert first.agent_id != second.agent_id
    ca_key = ca_cert.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    assert ca.fingerprint_sha256 == ca_cert.fingerprint(hashes.SHA256()).hex()


async def test_the_audit_of_a_certificate_revoke_names_the_certificate_not_its_token(
    bc_nats: Nats, bc_subjects: Subjects, bc_settings: Settings, pki: PkiClient
) -> None:
    """Issue 23 L5: the audit entry of ``certs.revoke`` was about the join token (the reply's
    ``joinTokenId`` came first), so an operator looking for who revoked a certificate found a token."""
    operator = PkiClient(ApiClient(bc_nats, bc_subjects, actor="alice@ops"))
    async with PkiService(bc_settings):
        issued = await issue(pki)
        joined, _ = await join(pki, issued.token)
        revoked = await operator.revoke_certificate(cert_id=joined.cert_id, reason="stolen laptop")
        entries = (await AuditClient(ApiClient(bc_nats, bc_subjects)).list_audit(service="pki")).entries
    (entry,) = [e for e in entries if e.action == "certs.revoke"]
    assert entry.actor == "alice@ops"
    assert entry.target is not None
    assert issued.id not in entry.target
    assert entry.target.startswith(joined.cert_id)
    assert revoked.serial in entry.target
    assert f"CN={joined.agent_id}" in entry.target
    assert entry.detail["reason"] == "stolen laptop"


async def test_a_join_asked_again_with_the_same_key_gets_its_certificate_and_burns_nothing(
    bc_settings: Settings, pki: PkiClient
) -> None:
    """A join whose answer was lost (the bc-pki that committed it was SIGKILLed before it
    answered, or the request timed out under load) is asked again by the same machine with the
    same key: it gets the certificate it already had. Before, it was ``token-used-up`` and the
    node's token burned as a second join: the machine never joined, its deploy failed, the node
    was quarantined. Another key with the same token is still refused."""
    async with PkiService(bc_settings):
        issued = await issue(pki, node_id=new_id("node"))
        key = new_agent_key()
        csr = make_csr(key)
        first = await pki.join(token=issued.token, csr=csr, claims=MACHINE)
        again = await pki.join(token=issued.token, csr=csr, claims=MACHINE)
        assert (again.cert_id, again.agent_id, again.certificate_pem) == (
            first.cert_id, first.agent_id, first.certificate_pem,
        )  # fmt: skip
        AgentIdentity.from_join(again, key)  # the certificate is this key's
        info = await pki.get_join_token(join_token_id=issued.id)
        assert (info.uses, info.state) == (1, "used")
        assert (await pki.get_certificate(cert_id=first.cert_id)).state == "valid"
        err = await refused(join(pki, issued.token))  # a second machine, its own key
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-used-up")


async def test_refused_joins_say_why_spend_nothing_and_are_audited(
    bc_settings: Settings, pki: PkiClient
) -> None:
    async with PkiService(bc_settings):
        issued = await issue(pki, expect={"mac": "aa:bb:cc:00:11:22", "productUuid": "p-1"})
        # another machine's claims: refused, and the token is not spent
        err = await refused(join(pki, issued.token, claims=OTHER_MACHINE))
        assert err.code is ErrorCode.PERMISSION_DENIED
        assert err.details == {"reason": "claims-mismatch", "claims": ["mac", "productUuid"]}
        assert (await pki.get_join_token(join_token_id=issued.id)).uses == 0
        # the right machine still joins, once
        await join(pki, issued.token)
        err = await refused(join(pki, issued.token))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-used-up")

        unknown = "bcjt_" + "A" * 43
        err = await refused(join(pki, unknown))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-unknown")

        revoked = await issue(pki)
        assert (await pki.revoke_join_token(join_token_id=revoked.id, reason="lost")).state == "revoked"
        err = await refused(join(pki, revoked.token))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-revoked")

        short = await issue(pki, ttl_seconds=90)
        info = await pki.get_join_token(join_token_id=short.id)
        assert info.expires_at - info.created_at == dt.timedelta(seconds=90)
        await expire(bc_settings, "token", short.id)  # 90 s on: moved, not slept
        err = await refused(join(pki, short.token))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "token-expired")
        assert (await pki.get_join_token(join_token_id=short.id)).state == "expired"

        fresh = await issue(pki)
        err = await refused(pki.join(token=fresh.token, csr="not a csr"))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "csr")
        rsa_like = make_csr(ec.generate_private_key(ec.SECP384R1()))
        err = await refused(pki.join(token=fresh.token, csr=rsa_like))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "csr")
        err = await refused(pki.join(token="guess", csr=make_csr(new_agent_key())))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "token")
        assert (await pki.get_join_token(join_token_id=fresh.id)).uses == 0

        outcomes = [a.outcome for a in await pki.list_joins(limit=20)]
    assert sorted(outcomes) == sorted(
        [
            "claims-mismatch", "joined", "token-used-up", "token-unknown", "token-revoked",
            "token-expired", "malformed", "malformed", "malformed",
        ]
    )  # fmt: skip


async def test_malformed_requests_are_invalid_input_with_a_path(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    cases = [
        ("tokens.issue", {"tenantId": "root", "role": "admin", "siteId": "a", "ttlSeconds": 5},
         "role"),
        ("tokens.issue", {"tenantId": "root", "role": "node", "siteId": "a", "ttlSeconds": 0},
         "ttlSeconds"),
        ("tokens.issue", {"tenantId": "root", "role": "node", "siteId": "a.b", "ttlSeconds": 5},
         "siteId"),
        ("tokens.issue", {"tenantId": "root", "role": "node", "siteId": "a", "ttlSeconds": 5,
                          "expect": {"mac": "zz"}}, "expect.mac"),
        ("tokens.issue", {"tenantId": "root", "role": "site", "siteId": "a", "ttlSeconds": 5,
                          "nodeId": "node_01JAAAAAAAAAAAAAAAAAAAAAAA"}, "nodeId"),
        ("tokens.issue", {"tenantId": "root", "role": "node", "siteId": "a", "ttlSeconds": 5,
                          "nodeId": "bogus"}, "nodeId"),
        ("tokens.revoke", {"joinTokenId": "cert_01JAAAAAAAAAAAAAAAAAAAAAAA"}, "joinTokenId"),
        ("agents.join", {"token": 7, "csr": "x"}, "token"),
        ("agents.join", {"token": "t", "csr": "x", "claims": {"macs": ["nope"]}},
         "claims.macs[0]"),
        ("signatures.verify", {"signerId": "x", "data": "AA==", "signature": "AA=="},
         "signerId"),
        ("signatures.verify", {"signerId": "cert_01JAAAAAAAAAAAAAAAAAAAAAAA", "data": "@@"},
         "data"),
        ("certs.get", {"certId": "tok_01JAAAAAAAAAAAAAAAAAAAAAAA"}, "certId"),
        ("certs.list", {"limit": 0}, "limit"),
        ("certs.list", {"certIds": ["cert_01JAAAAAAAAAAAAAAAAAAAAAAA", "x"]}, "certIds[1]"),
        ("certs.list", {"certIds": []}, "certIds"),
        ("certs.list", {"certIds": ["cert_01JAAAAAAAAAAAAAAAAAAAAAAA"] * 1001}, "certIds"),
    ]  # fmt: skip
    async with PkiService(bc_settings):
        for route, payload, path in cases:
            with pytest.raises(BcError) as info:
                await bc_api.call("pki", route, payload)
            assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, path), route
        with pytest.raises(BcError) as info:
            await bc_api.call("pki", "tokens.issue", b"{oops")
        assert info.value.code is ErrorCode.INVALID_INPUT
        for route, payload in [
            ("tokens.get", {"joinTokenId": new_id("tok")}),
            ("certs.get", {"certId": new_id("cert")}),
            ("certs.revoke", {"certId": new_id("cert")}),
        ]:
            with pytest.raises(BcError) as info:
                await bc_api.call("pki", route, payload)
            assert info.value.code is ErrorCode.NOT_FOUND


async def test_a_node_bound_token_makes_the_node_id_the_agent_id(
    bc_settings: Settings, pki: PkiClient
) -> None:
    node_id = new_id("node")
    secret = os.urandom(32)

    async def attempt_secret() -> bytes:
        return secret

    async with PkiService(bc_settings):
        step = pki.for_step(idempotency_key="wf:wf_1:0#1", node_id=node_id, before_mint=attempt_secret)
        token = await step.issue_join_token(
            tenant_id="root", role="provisioned", site_id="site-a", ttl_seconds=60
        )
        site_token = await step.issue_join_token(
            tenant_id="root", role="site", site_id="site-a", ttl_seconds=60, key="site"
        )
        err = await refused(
            step.issue_join_token(tenant_id="root", role="provisioned", site_id="a", ttl_seconds=60)
        )
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "idempotency-key-reused")
        # a re-run of the step: a new StepPki under the same key finds the same token
        rerun = await pki.for_step(
            idempotency_key="wf:wf_1:0#1", node_id=node_id, before_mint=attempt_secret
        ).issue_join_token(tenant_id="root", role="provisioned", site_id="site-a", ttl_seconds=60)
        assert (rerun.id, rerun.token) == (token.id, token.token)
        joined, identity = await join(pki, token.token)
        site_agent, _ = await join(pki, site_token.token)
        data, signature = identity.sign("agent.event", {"kind": "hello"})
        verified = await pki.verify(signer_id=node_id, data=data, signature=signature)
    assert joined.agent_id == node_id
    assert site_agent.agent_id.startswith("agent_")
    assert (verified.cert_id, verified.role) == (joined.cert_id, "provisioned")


async def test_a_held_tokens_join_is_pending_until_a_site_agent_of_its_site_confirms_it(
    bc_settings: Settings, pki: PkiClient
) -> None:
    node_id = new_id("node")
    async with PkiService(bc_settings):
        held = await issue(pki, node_id=node_id, held=True)
        err = await refused(issue(pki, role="site", held=True))  # only a node's ramdisk token is held
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "held")
        thief, thief_identity = await join(pki, held.token)
        assert (await pki.get_certificate(cert_id=thief.cert_id)).state == "pending"
        data, signature = thief_identity.sign("agent.event", {"kind": "hello"})
        err = await refused(pki.verify(signer_id=node_id, data=data, signature=signature))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "cert-pending")
        digest = hashlib.sha256(held.token.encode()).hexdigest()
        # the joiner cannot confirm itself, nor can a site agent of another site
        err = await refused(pki.confirm_join_token(identity=thief_identity, token_sha256=digest, mac="aa"))
        assert err.code is ErrorCode.UNAUTHENTICATED
        _, other_site = await join(pki, (await issue(pki, role="site", site_id="site-b")).token)
        err = await refused(pki.confirm_join_token(identity=other_site, token_sha256=digest, mac="aa"))
        assert (err.code, err.path) == (ErrorCode.NOT_FOUND, "tokenSha256")
        _, site_agent = await join(pki, (await issue(pki, role="site")).token)
        confirmed = await pki.confirm_join_token(identity=site_agent, token_sha256=digest, mac="aa")
        assert confirmed.cert_ids == [thief.cert_id]
        assert (await pki.verify(signer_id=node_id, data=data, signature=signature)).cert_id == thief.cert_id
        again = await pki.confirm_join_token(identity=site_agent, token_sha256=digest, mac="aa")
        assert again.cert_ids == []  # a repeat changes nothing
        # a held token confirmed before its join: the join is valid at once
        early = await issue(pki, node_id=new_id("node"), held=True)
        early_digest = hashlib.sha256(early.token.encode()).hexdigest()
        await pki.confirm_join_token(identity=site_agent, token_sha256=early_digest, mac="aa")
        joined, _ = await join(pki, early.token)
        assert (await pki.get_certificate(cert_id=joined.cert_id)).state == "valid"
        # a burn revokes what was pending, and a burn repeated answers the same
        late = await issue(pki, node_id=new_id("node"), held=True)
        late_digest = hashlib.sha256(late.token.encode()).hexdigest()
        pending, _ = await join(pki, late.token)
        burned = await pki.burn_join_token(
            identity=site_agent, token_sha256=late_digest, mac="aa", reason="boot-entry-fetched-twice"
        )
        assert burned.revoked_cert_ids == [pending.cert_id]
        assert (await pki.get_certificate(cert_id=pending.cert_id)).state == "revoked"
        repeat = await pki.burn_join_token(
            identity=site_agent, token_sha256=late_digest, mac="aa", reason="boot-entry-fetched-twice"
        )
        assert repeat.revoked_cert_ids == [pending.cert_id]
        err = await refused(pki.confirm_join_token(identity=site_agent, token_sha256=late_digest, mac="aa"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "token-revoked")


async def test_verify_checks_the_signer_certificate_and_freshness(
    bc_settings: Settings, pki: PkiClient
) -> None:
    async with PkiService(bc_settings):
        token = await issue(pki, max_uses=3)
        ed, ed_id = await join(pki, token.token)
        p256, p256_id = await join(pki, token.token, kind="p256")

        for result, ident in ((ed, ed_id), (p256, p256_id)):
            data, sig = ident.sign("agent.event", {"kind": "result", "commandId": "cmd_1"})
            by_cert = await pki.verify(signer_id=result.cert_id, data=data, signature=sig)
            by_agent = await pki.verify(signer_id=result.agent_id, data=data, signature=sig)
            assert by_cert == by_agent
            assert (by_cert.agent_id, by_cert.site_id) == (result.agent_id, "site-a")
            # the same bytes with one changed, or another signer's key: forged
            err = await refused(pki.verify(signer_id=result.cert_id, data=data + b" ", signature=sig))
            assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "bad-signature")
        forged = sign_bytes(new_agent_key(), b"hello")
        err = await refused(pki.verify(signer_id=ed.cert_id, data=b"hello", signature=forged))
        assert err.reason == "bad-signature"

        # once: the second verification of the same signed data is a replay
        now = time.time_ns() // 1_000_000
        data, sig = ed_id.sign("secrets.fetch", {"ref": "sec_x", "signedAtMs": now})
        await pki.verify(signer_id=ed.cert_id, data=data, signature=sig, once=True, signed_at_ms=now)
        err = await refused(
            pki.verify(signer_id=ed.cert_id, data=data, signature=sig, once=True, signed_at_ms=now)
        )
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "signature-replayed")
        # ECDSA signatures are malleable: a replay with (r, n - s) is still the same data
        pdata, psig = p256_id.sign("secrets.fetch", {"ref": "sec_y", "signedAtMs": now})
        await pki.verify(signer_id=p256.agent_id, data=pdata, signature=psig, once=True,
                         signed_at_ms=now)  # fmt: skip
        err = await refused(
            pki.verify(signer_id=p256.cert_id, data=pdata, signature=_malleate(psig), once=True,
                       signed_at_ms=now)
        )  # fmt: skip
        assert err.reason == "signature-replayed"
        old = now - 10 * 60 * 1000
        data, sig = ed_id.sign("secrets.fetch", {"ref": "sec_z", "signedAtMs": old})
        err = await refused(
            pki.verify(signer_id=ed.cert_id, data=data, signature=sig, once=True, signed_at_ms=old)
        )
        assert err.reason == "stale-signature"
        err = await refused(pki.verify(signer_id=ed.cert_id, data=data, signature=sig, once=True))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "signedAtMs")

        revoked = await pki.revoke_certificate(cert_id=ed.cert_id, reason="stolen")
        assert revoked.state == "revoked"
        assert (await pki.revoke_certificate(cert_id=ed.cert_id)).revoke_reason == "stolen"
        data, sig = ed_id.sign("agent.event", {"kind": "heartbeat"})
        err = await refused(pki.verify(signer_id=ed.cert_id, data=data, signature=sig))
        assert (err.code, err.reason) == (ErrorCode.UNAUTHENTICATED, "cert-revoked")
        # by agent id, the revoked certificate is simply not among the usable ones
        err = await refused(pki.verify(signer_id=ed.agent_id, data=data, signature=sig))
        assert err.reason == "cert-revoked"
        err = await refused(pki.verify(signer_id=new_id("cert"), data=data, signature=sig))
        assert err.reason == "unknown-signer"

        assert [c.cert_id for c in await pki.list_certificates()] == [p256.cert_id]
        everything = await pki.list_certificates(include_revoked=True)
        assert {c.cert_id for c in everything} == {ed.cert_id, p256.cert_id}


def _malleate(der_signature: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.utils import (
        decode_dss_signature,
        encode_dss_signature,
    )

    n = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256 order
    r, s = decode_dss_signature(der_signature)
    return encode_dss_signature(r, n - s)


async def test_signatures_for_one_purpose_do_not_verify_for_another(
    bc_settings: Settings, pki: PkiClient
) -> None:
    async with PkiService(bc_settings):
        result, ident = await join(pki, (await issue(pki)).token)
        doc = {"ref": "sec_1"}
        _data, sig = ident.sign("agent.event", doc)
        err = await refused(
            pki.verify(signer_id=result.cert_id, data=signing_payload("secrets.fetch", doc), signature=sig)
        )
    assert err.reason == "bad-signature"


async def test_two_instances_starting_together_share_one_ca_sealed_at_rest(
    bc_settings: Settings, pki: PkiClient
) -> None:
    first, second = PkiService(bc_settings), PkiService(bc_settings)
    try:
        await asyncio.gather(first.start(), second.start())
        assert first.ca is not None
        assert second.ca is not None
        assert first.ca.fingerprint == second.ca.fingerprint
        secret = os.urandom(32)
        token = await issue(pki, max_uses=10, idempotency_key="k1", mint_secret=secret)
        results = await asyncio.gather(*(join(pki, token.token) for _ in range(6)))
        assert len({r.cert_id for r, _ in results}) == 6
        again = await asyncio.gather(
            *(issue(pki, max_uses=10, idempotency_key="k1", mint_secret=secret) for _ in range(4))
        )
        assert {t.token for t in again} == {token.token}
    finally:
        await asyncio.gather(first.stop(), second.stop())

    key_file = Path(bc_settings.state_dir) / "keys" / "pki.key"
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    conn = await asyncpg.connect(bc_settings.database_url)
    try:
        rows = await conn.fetch("SELECT key_sealed, token_key_sealed FROM pki.ca")
    finally:
        await conn.close()
    assert len(rows) == 1
    assert b"PRIVATE KEY" not in rows[0]["key_sealed"]
    assert first.ca.key_pem() not in rows[0]["key_sealed"]


async def test_the_ca_survives_key_rotation_and_refuses_a_foreign_key_file(
    bc_settings: Settings, pki: PkiClient, tmp_path: Path
) -> None:
    async with PkiService(bc_settings):
        fingerprint = (await pki.ca()).fingerprint_sha256
        secret = os.urandom(32)
        token = await issue(pki, idempotency_key="rotating", mint_secret=secret)

    key_file = Path(bc_settings.state_dir) / "keys" / "pki.key"
    old_line = next(ln for ln in key_file.read_text().splitlines() if ln.startswith("bck1:"))
    new_kid = rotate_key_file(key_file)
    async with PkiService(bc_settings) as svc:
        assert svc.keyring is not None
        assert svc.keyring.current_key_id == new_kid
        assert (await pki.ca()).fingerprint_sha256 == fingerprint
        rewrapped = await pki.rewrap_keys()
        assert (rewrapped.key_id, rewrapped.rewrapped) == (new_kid, 2)
        assert (await pki.rewrap_keys()).rewrapped == 0

    # the old key can go now; tokens derived before rotation are still the same
    key_file.write_text("\n".join(ln for ln in key_file.read_text().splitlines() if ln != old_line))
    async with PkiService(bc_settings):
        assert (await issue(pki, idempotency_key="rotating", mint_secret=secret)).token == token.token

    foreign = msgspec.structs.replace(bc_settings, pki=PkiSettings(key_file=str(tmp_path / "foreign.key")))
    with pytest.raises(BcError) as info:
        async with PkiService(foreign):
            pass
    assert info.value.code is ErrorCode.INVALID_CONFIG
