"""An agent's enrollment: join once with a token, keep the certificate and key across restarts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from ..clients.pki import PkiClient
from ..core.errors import BcError, ErrorCode
from ..crypto import AgentIdentity, AgentKey, make_csr, new_agent_key
from ..files import atomic_write
from ..wire.pki import JoinClaims

__all__ = ["Enrollment", "enroll", "load_enrollment", "save_enrollment"]


@dataclass(frozen=True, kw_only=True)
class Enrollment:
    """Who an agent is: its certificate, its site and role, and its private key."""

    agent_id: str
    cert_id: str
    site_id: str
    tenant_id: str
    role: str
    certificate_pem: str
    private_key: AgentKey = field(repr=False)

    @property
    def identity(self) -> AgentIdentity:
        return AgentIdentity(cert_id=self.cert_id, agent_id=self.agent_id, private_key=self.private_key)


async def enroll(
    pki: PkiClient,
    *,
    token: str,
    claims: JoinClaims | None = None,
    key_kind: Literal["ed25519", "p256"] = "ed25519",
    site_id: str | None = None,
    key: AgentKey | None = None,
) -> Enrollment:
    """Join through bc-pki with a join token; the private key never leaves this process.
    ``site_id``: the site the machine boots in, when it knows (a token of another site is refused).
    ``key``: the key to join with (a new ``key_kind`` key by default); a join asked again after
    an answer that never came passes the same key, and bc-pki answers it with the certificate
    the first ask got (docs/pki-and-secrets.md "Joins")."""
    key = key or new_agent_key(key_kind)
    joined = await pki.join(token=token, csr=make_csr(key), claims=claims, site_id=site_id)
    return Enrollment(
        agent_id=joined.agent_id,
        cert_id=joined.cert_id,
        site_id=joined.site_id,
        tenant_id=joined.tenant_id,
        role=joined.role,
        certificate_pem=joined.certificate_pem,
        private_key=key,
    )


def save_enrollment(path: str | Path, enrollment: Enrollment) -> None:
    """Write the enrollment (private key included) to ``path``, readable by its owner only."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    key_pem = enrollment.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    doc = {
        "agentId": enrollment.agent_id,
        "certId": enrollment.cert_id,
        "siteId": enrollment.site_id,
        "tenantId": enrollment.tenant_id,
        "role": enrollment.role,
        "certificatePem": enrollment.certificate_pem,
        "privateKeyPem": key_pem,
    }
    atomic_write(target, json.dumps(doc))


def load_enrollment(path: str | Path) -> Enrollment | None:
    """The enrollment saved at ``path``, or None when there is none yet.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``path`` when the file is there but unusable.
    """
    target = Path(path)
    if not target.exists():
        return None
    try:
        doc = json.loads(target.read_text())
        key = serialization.load_pem_private_key(doc["privateKeyPem"].encode(), password=None)
        if not isinstance(key, ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey):
            raise TypeError("unsupported key type")
        return Enrollment(
            agent_id=str(doc["agentId"]),
            cert_id=str(doc["certId"]),
            site_id=str(doc["siteId"]),
            tenant_id=str(doc["tenantId"]),
            role=str(doc["role"]),
            certificate_pem=str(doc["certificatePem"]),
            private_key=key,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"enrollment file is unusable: {type(exc).__name__}",
            {"path": str(target)},
        ) from exc
