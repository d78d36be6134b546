"""``bc-pki callout``'s own logic: how it asks bc-pki about revocation, whom it cuts off, and its
config (the process against a real leaf: tests/integration/test_deploy_callout.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from bc_pki.callout import Connections, Revocations, load_config
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.service.bus_auth import Admitted, AgentCertificate
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
    for change, path in [  # a path for every mistake
        ({"site_id": "eu.1"}, "site_id"), ({"cache_seconds": -1}, "cache_seconds"),
        ({"nats_urll": "x"}, "nats_urll"), ({"nats_url": None}, "nats_url"), ({"nats_ca": 3}, "nats_ca"),
    ]:  # fmt: skip
        doc = {**good, **change}
        text = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in doc.items() if v is not None)
        (tmp_path / "c.toml").write_text(text)
        with pytest.raises(BcError) as err:
            load_config(tmp_path / "c.toml")
        assert (err.value.code, err.value.details["path"]) == (ErrorCode.INVALID_CONFIG, path)
