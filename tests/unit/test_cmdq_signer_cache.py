"""The command queue's cache of agents' certificates stays as large as the certificates in use,
not every certificate it ever checked (issue 25 item 3: each machine's every join makes one)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from bc_command_queue.signers import Signers
from better_compute.crypto import new_agent_key
from better_compute.wire.pki import CertificateInfo

pytestmark = pytest.mark.unit

NOW = dt.datetime.now(dt.UTC)


def _pem() -> str:
    key = new_agent_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(NOW)
        .not_valid_after(NOW + dt.timedelta(days=1)).sign(key, None)
    )  # fmt: skip
    return cert.public_bytes(serialization.Encoding.PEM).decode()


class Pki:
    """bc-pki's ``certs.get``: one certificate, named by any id."""

    def __init__(self) -> None:
        self.pem = _pem()
        self.asked = 0

    async def get_certificate(self, *, cert_id: str) -> CertificateInfo:
        self.asked += 1
        return CertificateInfo(
            cert_id=cert_id, agent_id=f"node_{cert_id}", tenant_id="root", site_id="s1", role="node",
            join_token_id=None, serial="1", key_type="ed25519", state="valid", not_before=NOW,
            not_after=NOW + dt.timedelta(days=1), created_at=NOW, certificate_pem=self.pem,
        )  # fmt: skip


async def test_certificates_past_their_time_leave_the_cache_as_new_ones_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("bc_command_queue.signers.time.monotonic", lambda: clock[0])
    pki = Pki()
    signers = Signers(pki, ttl_seconds=30)  # type: ignore[arg-type]
    for n in range(5000):  # a fleet's joins, a second apart: each certificate used once
        await signers.get(f"cert_{n}")
        clock[0] += 1.0
    assert signers.cached <= 1024
    # one still in use within its time is answered from the cache
    asked = pki.asked
    got: Any = await signers.get("cert_4999")
    assert got.agent_id == "node_cert_4999"
    assert pki.asked == asked
