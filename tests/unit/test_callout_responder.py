"""``bc-pki callout``'s own logic: how it asks bc-pki about revocation, whom it cuts off, and its
config (the process against a real leaf: tests/integration/test_deploy_callout.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bc_pki import callout
from bc_pki.callout import Connections, Revocations, Swept, load_config, sweep
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.service.bus_auth import Admitted, AgentCertificate, cert_id_of_user, user_name
from better_compute.wire.pki import CertificateInfo

AGENT = AgentCertificate(agent_id="agent_a1", site_id="eu1", serial="ab12", not_after=2e9, cert_id="cert_1")


def _info(state: str = "valid", serial: str = "ab12") -> CertificateInfo:
    now = dt.datetime.now(dt.UTC)
    return CertificateInfo(
        cert_id="cert_1", agent_id="agent_a1", tenant_id="root", site_id="eu1", role="node",
        join_token_id=None, serial=serial, key_type="ed25519", state=state,  # type: ignore[arg-type]
        not_before=now, not_after=now, created_at=now, certificate_pem="",
    )  # fmt: skip


class Pki:
    """bc-pki's certs.get, as the responder sees it."""

    def __init__(self) -> None:
        self.answer: CertificateInfo | BcError = _info()
        self.asked = 0

    async def get_certificate(self, *, cert_id: str) -> CertificateInfo:
        self.asked += 1
        if isinstance(self.answer, BcError):
            raise self.answer
        return self.answer


def _revocations(pki: Pki, now: list[float]) -> Revocations:
    return Revocations(pki, fresh=10, stale=300, log=get_logger(), clock=lambda: now[0])  # type: ignore[arg-type]


async def test_bc_pki_is_asked_again_once_its_answer_is_old_and_a_revocation_counts_at_once() -> None:
    pki, now = Pki(), [0.0]
    revocations = _revocations(pki, now)
    assert await revocations.revoked(AGENT) is False
    now[0] = 9.0
    assert await revocations.revoked(AGENT) is False
    assert pki.asked == 1  # a fresh answer holds
    now[0] = 11.0
    pki.answer = _info("revoked")
    assert await revocations.revoked(AGENT) is True
    assert pki.asked == 2
    pki.answer = _info()  # what was revoked stays revoked for the responder
    assert await revocations.revoked(AGENT) is True
    other = Revocations(Pki(), fresh=10, stale=300, log=get_logger())  # type: ignore[arg-type]
    assert await other.revoked(AGENT) is False
    other.heard_revoked("cert_1")  # the event feed: no need to ask
    assert await other.revoked(AGENT) is True


async def test_with_bc_pki_away_only_a_recent_good_answer_lets_an_agent_in() -> None:
    pki, now = Pki(), [0.0]
    revocations = _revocations(pki, now)
    assert await revocations.revoked(AGENT) is False
    pki.answer = BcError(ErrorCode.UNAVAILABLE, "no bc-pki instance is running")
    now[0] = 200.0
    assert await revocations.revoked(AGENT) is False  # stale, but bc-pki cannot be asked
    now[0] = 400.0
    with pytest.raises(BcError) as err:
        await revocations.revoked(AGENT)
    assert err.value.code is ErrorCode.UNAUTHENTICATED
    # never asked before and bc-pki away: refused
    with pytest.raises(BcError):
        await _revocations(pki, [0.0]).revoked(AGENT)


async def test_a_pending_certificate_is_refused_as_pending_and_asked_about_again() -> None:
    """Issue 23: the responder logged the refusal of a pending certificate (a held join whose
    boot entry has not closed clean) as "the certificate is revoked". It says pending, and asks
    bc-pki again at the next try, since a pending certificate becomes valid at the confirm."""
    pki, now = Pki(), [0.0]
    pki.answer = _info("pending")
    revocations = _revocations(pki, now)
    for _ in range(2):
        with pytest.raises(BcError) as err:
            await revocations.revoked(AGENT)
        assert err.value.code is ErrorCode.UNAUTHENTICATED
        assert "pending" in err.value.message
        assert "revoked" not in err.value.message
    assert pki.asked == 2
    pki.answer = _info()
    assert await revocations.revoked(AGENT) is False


async def test_a_revoked_certificate_costs_bc_pki_one_question_however_often_it_tries() -> None:
    """A revoked bcd tries again every few seconds for a long while (bcd.daemon.REFUSED_BACKOFF):
    the responder asks bc-pki about it once and refuses every later try from what it knows."""
    pki, now = Pki(), [0.0]
    pki.answer = _info("revoked")
    revocations = _revocations(pki, now)
    for step in range(50):
        now[0] = step * 10.0
        assert await revocations.revoked(AGENT) is True
    assert pki.asked == 1


async def test_confirmed_certificates_past_their_time_are_forgotten_as_new_ones_come() -> None:
    """Every join makes a certificate: the responder kept bc-pki's good answer about each one it
    ever let in. It keeps those it may still use (up to ``stale`` old, for when bc-pki is away)."""
    pki, now = Pki(), [0.0]
    revocations = _revocations(pki, now)  # fresh 10 s, stale 300 s
    for n in range(5000):  # a fleet's joins, a second apart: each certificate let in once
        assert await revocations.revoked(dataclasses.replace(AGENT, cert_id=f"cert_{n}")) is False
        now[0] += 1.0
    assert revocations.confirmed <= 1024
    # one confirmed 200 s ago still lets its agent in while bc-pki cannot be asked
    pki.answer, asked = BcError(ErrorCode.UNAVAILABLE, "no bc-pki instance is running"), pki.asked
    assert await revocations.revoked(dataclasses.replace(AGENT, cert_id="cert_4800")) is False
    assert pki.asked == asked + 1


@pytest.mark.parametrize(
    "case",
    ["unknown", "other-serial", "no-cert-id"],
)
async def test_a_certificate_bc_pki_cannot_vouch_for_is_refused(case: str) -> None:
    pki = Pki()
    agent = AGENT
    if case == "unknown":
        pki.answer = BcError(ErrorCode.NOT_FOUND, "no such certificate")
    elif case == "other-serial":
        pki.answer = _info(serial="ff00")
    else:
        agent = AgentCertificate(agent_id="agent_a1", site_id="eu1", serial="ab12", not_after=2e9)
    with pytest.raises(BcError) as err:
        await _revocations(pki, [0.0]).revoked(agent)
    assert err.value.code is ErrorCode.UNAUTHENTICATED


def test_a_revocation_cuts_every_connection_of_that_certificate_once() -> None:
    conns = Connections()
    other = AgentCertificate(agent_id="agent_a2", site_id="eu1", serial="cd", not_after=2e9, cert_id="cert_2")
    conns.admitted(Admitted(agent=AGENT, server_id="S1", client_id=7))
    conns.admitted(Admitted(agent=AGENT, server_id="S1", client_id=9))
    conns.admitted(Admitted(agent=other, server_id="S1", client_id=8))
    assert conns.take("cert_1") == [("S1", 7), ("S1", 9)]
    assert conns.take("cert_1") == []
    assert conns.take("cert_2") == [("S1", 8)]


def test_the_config_names_the_key_that_is_wrong(tmp_path: Path) -> None:
    good: dict[str, Any] = {
        "site_id": "eu1", "nats_url": "tls://127.0.0.1:4222", "nats_ca": "ca.pem", "cert_file": "c.pem",
        "key_file": "k.pem", "password_file": "pw", "issuer_seed_file": "seed", "pki_ca_file": "pki.pem",
    }  # fmt: skip
    example = Path(__file__).parents[2] / "deploy" / "callout.example.toml"
    assert load_config(example).site_id == "eu1"
    mistakes: list[tuple[dict[str, Any], str]] = [  # a path for every mistake
        ({"site_id": "eu.1"}, "site_id"), ({"cache_seconds": -1}, "cache_seconds"),
        ({"sweep_seconds": 0}, "sweep_seconds"),
        ({"nats_urll": "x"}, "nats_urll"), ({"nats_url": None}, "nats_url"), ({"nats_ca": 3}, "nats_ca"),
    ]  # fmt: skip
    for change, path in mistakes:
        doc = {**good, **change}
        text = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in doc.items() if v is not None)
        (tmp_path / "c.toml").write_text(text)
        with pytest.raises(BcError) as err:
            load_config(tmp_path / "c.toml")
        assert (err.value.code, err.value.details["path"]) == (ErrorCode.INVALID_CONFIG, path)


class Leaf:
    """The leaf's connz, as the responder asks it (one page)."""

    def __init__(self, connections: list[dict[str, Any]] | None) -> None:
        self.connections = connections

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        if self.connections is None:
            raise TimeoutError
        doc = {"data": {"connections": self.connections}}
        return type("Msg", (), {"data": json.dumps(doc).encode()})()


def _pem_and_digest(name: str) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return pem, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


async def test_a_sweep_cuts_off_the_connections_bc_pki_no_longer_vouches_for() -> None:
    """The sweep asks bc-pki afresh about the certificate each agent connection's user names
    (``<agent>/<cert>``) and cuts off the revoked, the unknown and one showing another
    certificate; a valid one and a joining connection stay."""
    assert user_name(AGENT) == "agent_a1/cert_1"
    assert cert_id_of_user("agent_a1/cert_1") == "cert_1"
    assert cert_id_of_user("joining") is None
    assert cert_id_of_user("agent_a1") is None
    good_pem, good = _pem_and_digest("good")
    gone_pem, gone = _pem_and_digest("gone")
    _other_pem, other = _pem_and_digest("other")

    def conn(cid: int, user: str, digest: str) -> dict[str, Any]:
        return {"cid": cid, "authorized_user": user, "tls_peer_certs": [{"cert_sha256": digest}]}

    class Answers:
        asked: list[str] = []

        async def get_certificate(self, *, cert_id: str) -> CertificateInfo:
            self.asked.append(cert_id)
            if cert_id == "cert_unknown":
                raise BcError(ErrorCode.NOT_FOUND, "no such certificate")
            info = _info("revoked" if cert_id == "cert_gone" else "valid")
            return msgspec.structs.replace(
                info, certificate_pem=gone_pem if cert_id == "cert_gone" else good_pem
            )

    leaf = Leaf([
        conn(1, "agent_a/cert_good", good), conn(2, "agent_b/cert_gone", gone),
        conn(3, "agent_b/cert_gone", gone), conn(4, "agent_c/cert_unknown", other),
        conn(5, "agent_a/cert_good", other), conn(6, "joining", other),
    ])  # fmt: skip
    pki = Answers()
    cut = await sweep(leaf, pki, "SRV", "SITE", get_logger())  # type: ignore[arg-type]
    assert cut == [
        Swept("cert_good", "SRV", 5, "other-certificate"), Swept("cert_gone", "SRV", 2, "revoked"),
        Swept("cert_gone", "SRV", 3, "revoked"), Swept("cert_unknown", "SRV", 4, "unknown"),
    ]  # fmt: skip
    assert sorted(pki.asked) == ["cert_gone", "cert_good", "cert_unknown"]  # once per certificate

    # bc-pki or the leaf away: nothing is cut, the next sweep tries again
    away = Pki()
    away.answer = BcError(ErrorCode.UNAVAILABLE, "no responders")
    assert await sweep(leaf, away, "SRV", "SITE", get_logger()) is None  # type: ignore[arg-type]
    assert await sweep(Leaf(None), pki, "SRV", "SITE", get_logger()) is None  # type: ignore[arg-type]


async def test_sweeps_run_at_the_start_on_a_reconnect_and_again_soon_after_one_that_could_not_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first sweep runs at once; one that could not ask (None: the leaf's link or bc-pki
    away) or failed is tried again after SWEEP_RETRY_S, not the hour-long period given here;
    a reconnect (``wanted``) asks for one at once; each connection found is cut."""
    monkeypatch.setattr(callout, "SWEEP_RETRY_S", 0.01)
    found = Swept("cert_1", "SRV", 7, "revoked")
    answers: list[Any] = [None, RuntimeError("boom"), [found], []]
    calls: list[int] = []
    cut: list[Swept] = []
    wanted, stop, reached = asyncio.Event(), asyncio.Event(), asyncio.Event()
    wanted.set()

    async def once() -> list[Swept] | None:
        calls.append(len(calls))
        answer = answers[len(calls) - 1]
        if len(calls) == len(answers):
            reached.set()
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def cut_off(conn: Swept) -> None:
        cut.append(conn)
        wanted.set()  # as a reconnect would: the fourth sweep at once, not after the period

    task = asyncio.create_task(
        callout.sweeps(once, cut_off, wanted=wanted, stop=stop, period=3600, log=get_logger())
    )
    try:
        await asyncio.wait_for(reached.wait(), timeout=10)
    finally:
        stop.set()
        task.cancel()
    assert cut == [found]
    assert len(calls) == 4
