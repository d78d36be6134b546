"""Signing, keys and sealing: what agents, approvers and services sign, verify and seal.

Every signature is over ``signing_payload(purpose, doc)``: a domain, the purpose (``agent.ack``,
``secrets.fetch``, ``cmdq.batch``, …) and the document as sorted JSON, so a signature made for
one purpose never verifies for another. The documents of each contract are built here too
(``fetch_document``, ``batch_document``, ``result_document``), next to the code that signs them.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
import re
import secrets as _random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

import bcrypt
import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .core.errors import BcError, ErrorCode
from .wire.agent import RESULT_PURPOSE, AgentEvent, event_purpose
from .wire.cmdq import BATCH_PURPOSE, BatchView
from .wire.pki import JoinResult
from .wire.secrets import SealedValue

__all__ = [
    "BUS_CERT_DAYS",
    "SIGNATURE_DOMAIN",
    "AgentIdentity",
    "AgentKey",
    "batch_document",
    "bcrypt_password",
    "fetch_document",
    "issue_bus_certificate",
    "issue_bus_client_certificate",
    "make_csr",
    "new_agent_key",
    "new_bus_ca",
    "open_sealed",
    "reply_public_key",
    "result_document",
    "seal_value",
    "sign_batch",
    "sign_bytes",
    "sign_event",
    "signing_payload",
]

SIGNATURE_DOMAIN: Final = b"bc-sig-v1"
_PURPOSE_RE: Final = re.compile(r"^[a-z][a-z0-9._-]{0,63}$")

AgentKey: TypeAlias = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey


# -- signing ------------------------------------------------------------------


def signing_payload(purpose: str, doc: Mapping[str, Any]) -> bytes:
    """The canonical bytes an agent signs: domain, purpose, then ``doc`` as sorted JSON.

    The purpose (``secrets.fetch``, ``agent.event``, …) is inside the signed bytes, so a
    signature made for one purpose never verifies for another.
    """
    if _PURPOSE_RE.match(purpose) is None:
        raise BcError(ErrorCode.INVALID_INPUT, f"bad signing purpose {purpose!r}", {"path": "purpose"})
    return b"\x00".join((SIGNATURE_DOMAIN, purpose.encode(), msgspec.json.encode(doc, order="sorted")))


def new_agent_key(kind: Literal["ed25519", "p256"] = "ed25519") -> AgentKey:
    """A new agent key: Ed25519 (default) or ECDSA P-256."""
    if kind == "p256":
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


def make_csr(key: AgentKey, *, common_name: str = "bc-agent") -> str:
    """A PKCS#10 request (PEM) for ``key``; the CA sets the subject itself."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM).decode()


def sign_bytes(key: AgentKey, data: bytes) -> bytes:
    """Ed25519 signature, or a DER ECDSA-SHA256 signature for a P-256 key."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


@dataclass(frozen=True)
class AgentIdentity:
    """An agent's certificate id and private key: what it signs events and requests with."""

    cert_id: str
    agent_id: str
    private_key: AgentKey = field(repr=False)

    @classmethod
    def from_join(cls, result: JoinResult, private_key: AgentKey) -> AgentIdentity:
        return cls(cert_id=result.cert_id, agent_id=result.agent_id, private_key=private_key)

    def sign(self, purpose: str, doc: Mapping[str, Any]) -> tuple[bytes, bytes]:
        """``(data, signature)`` for ``doc`` under ``purpose``."""
        data = signing_payload(purpose, doc)
        return data, sign_bytes(self.private_key, data)

    def signed_request(self, purpose: str, **fields: Any) -> dict[str, Any]:
        """``fields`` plus ``signerId``, ``signedAtMs``, ``nonce`` and a ``signature`` over them.

        The service rebuilds the document from the same fields, so nothing travels twice.
        """
        doc = {
            **fields,
            "signerId": self.cert_id,
            "signedAtMs": time.time_ns() // 1_000_000,
            "nonce": _random.token_hex(16),
        }
        _data, signature = self.sign(purpose, doc)
        return {**doc, "signature": base64.b64encode(signature).decode()}


# -- agent events and results ------------------------------------------------------


def sign_event(identity: AgentIdentity, kind: str, event: AgentEvent) -> bytes:
    """The event as JSON with its ``signature``, ready to publish on its subject."""
    doc: dict[str, Any] = msgspec.to_builtins(event)
    _data, signature = identity.sign(event_purpose(kind), doc)
    doc["signature"] = base64.b64encode(signature).decode()
    return msgspec.json.encode(doc)


def result_document(*, command_id: str, node_id: str, status: str, result: bytes) -> bytes:
    """The bytes a node signs over its result: command, node, status and the result's sha256."""
    return signing_payload(
        RESULT_PURPOSE,
        {
            "commandId": command_id,
            "nodeId": node_id,
            "status": status,
            "resultSha256": hashlib.sha256(result).hexdigest(),
        },
    )


# -- destructive batches --------------------------------------------------------------


def batch_document(
    *,
    batch_id: str,
    tenant_id: str,
    kinds: list[str],
    nodes: list[str],
    expires_at_ms: int,
    workflow_id: str | None,
    workflow_ids: list[str] | None = None,
) -> bytes:
    """The canonical bytes approvers sign for a batch (scope and expiry included).

    A bulk verb's batch names its set of workflows (``workflowIds``); other batches' documents
    have no such key, so they stay what they were.
    """
    scope: dict[str, Any] = {
        "batchId": batch_id,
        "tenantId": tenant_id,
        "kinds": sorted(set(kinds)),
        "nodes": sorted(set(nodes)),
        "expiresAtMs": expires_at_ms,
        "workflowId": workflow_id,
    }
    if workflow_ids:
        scope["workflowIds"] = sorted(set(workflow_ids))
    return signing_payload(BATCH_PURPOSE, scope)


def sign_batch(batch: BatchView, private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """Sign ``batch`` as an approver, after checking that its document is what its fields say.

    Raises:
        BcError: ``INVALID_STATE`` (reason ``document-mismatch``) when the document the
            service sent is not the canonical document of the batch's scope: signing it
            could approve something other than what is shown.
    """
    expected = batch_document(
        batch_id=batch.id,
        tenant_id=batch.tenant_id,
        kinds=batch.kinds,
        nodes=batch.nodes,
        expires_at_ms=batch.expires_at_ms,
        workflow_id=batch.workflow_id,
        workflow_ids=batch.workflow_ids,
    )
    if expected != batch.document:
        raise BcError(
            ErrorCode.INVALID_STATE,
            "the batch's document does not match its scope; not signing",
            {"reason": "document-mismatch"},
        )
    return private_key.sign(expected)


# -- secrets fetched by agents ------------------------------------------------------


def fetch_document(
    *, ref: str, signer_id: str, signed_at_ms: int, nonce: str, reply_key: str
) -> dict[str, Any]:
    """The document an agent signs (under ``FETCH_PURPOSE``) to fetch ``ref``."""
    return {
        "ref": ref,
        "signerId": signer_id,
        "signedAtMs": signed_at_ms,
        "nonce": nonce,
        "replyKey": reply_key,
    }


_SEAL_INFO: Final = b"bc-secrets-fetch-v1:"


def _seal_key(shared: bytes, ref: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SEAL_INFO + ref.encode()).derive(
        shared
    )


def reply_public_key(reply_key: str) -> X25519PublicKey:
    """``replyKey`` as an X25519 public key; ``INVALID_INPUT`` at ``replyKey`` when it is not one."""
    try:
        return X25519PublicKey.from_public_bytes(base64.b64decode(reply_key, validate=True))
    except ValueError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, "replyKey is not an X25519 public key", {"path": "replyKey"}
        ) from exc


def seal_value(reply_key: str, ref: str, value: bytes) -> SealedValue:
    """Seal ``value`` so that only the holder of ``reply_key``'s private half can open it."""
    peer = reply_public_key(reply_key)
    mine = X25519PrivateKey.generate()
    nonce = os.urandom(12)
    ciphertext = AESGCM(_seal_key(mine.exchange(peer), ref)).encrypt(nonce, value, ref.encode())
    return SealedValue(
        ephemeral_key=mine.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
        nonce=nonce,
        ciphertext=ciphertext,
    )


def open_sealed(private_key: X25519PrivateKey, ref: str, sealed: SealedValue) -> bytes:
    """The value inside ``sealed``, with the fetch's X25519 private key."""
    try:
        shared = private_key.exchange(X25519PublicKey.from_public_bytes(sealed.ephemeral_key))
        value: bytes = AESGCM(_seal_key(shared, ref)).decrypt(sealed.nonce, sealed.ciphertext, ref.encode())
    except (ValueError, InvalidTag) as exc:
        raise BcError(ErrorCode.INTERNAL, "the sealed value from bc-secrets does not open") from exc
    return value


# -- the bus's TLS and passwords (deploy/nats, `bcx bus`) ----------------------------------------

BUS_CERT_DAYS: Final = 825  # a server certificate's default lifetime


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def new_bus_ca(name: str, *, days: int = 3650) -> tuple[bytes, bytes]:
    """A CA for the bus's TLS (nats-server's client, route and leaf listeners): its certificate
    and private key, both PEM. It signs only the NATS servers' certificates; keep its key off the
    servers (``bcx bus ca``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Better Compute"),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.KeyUsage(
        digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(Encoding.PEM), _pem_key(key)


def _load_bus_ca(
    ca_cert_pem: bytes, ca_key_pem: bytes
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The bus CA's certificate and ECDSA key; ``INVALID_INPUT`` at ``ca`` when they are not."""
    try:
        ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
        ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    except ValueError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, "not a PEM CA certificate and key", {"path": "ca"}) from exc
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise BcError(ErrorCode.INVALID_INPUT, "the CA key is not an ECDSA key", {"path": "ca"})
    return ca_cert, ca_key


def _issue_from_bus_ca(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    name: str,
    days: int,
    usages: list[x509.ObjectIdentifier],
    alt: list[x509.GeneralName],
) -> tuple[bytes, bytes]:
    """A new key and its certificate (PEM) from the bus CA: ``name`` as its common name,
    ``usages`` as its extended key usage, ``alt`` (if any) as its subject alternative names."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Better Compute"),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if alt:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = (
        builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski.value), False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(Encoding.PEM), _pem_key(key)


def issue_bus_certificate(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    name: str,
    dns: list[str],
    ips: list[str],
    days: int = BUS_CERT_DAYS,
) -> tuple[bytes, bytes]:
    """A NATS server's certificate and key (PEM), signed by the bus CA, for the names and
    addresses its clients, routes and leaf nodes dial. It serves (``serverAuth``) and presents
    itself when it dials a route or a hub (``clientAuth``). ``INVALID_INPUT`` at ``dns``/``ip``
    when a name or address is not one, or none is given."""
    ca_cert, ca_key = _load_bus_ca(ca_cert_pem, ca_key_pem)
    alt: list[x509.GeneralName] = []
    for host in dns:
        if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})", host):
            raise BcError(ErrorCode.INVALID_INPUT, f"not a DNS name: {host!r}", {"path": "dns"})
        alt.append(x509.DNSName(host))
    for text in ips:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(text)))
        except ValueError:
            raise BcError(ErrorCode.INVALID_INPUT, f"not an IP address: {text!r}", {"path": "ip"}) from None
    if not alt:
        raise BcError(ErrorCode.INVALID_INPUT, "give the server's DNS names or addresses", {"path": "dns"})
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _issue_from_bus_ca(ca_cert, ca_key, name=name, days=days, usages=usages, alt=alt)


def issue_bus_client_certificate(
    ca_cert_pem: bytes, ca_key_pem: bytes, *, name: str, uris: list[str], days: int = BUS_CERT_DAYS
) -> tuple[bytes, bytes]:
    """A client certificate and key (PEM) from the bus CA, for a client of a site's leaf node
    that is not an agent: the auth callout's responder, or the site's joining identity
    (``urn:bc:join:<site>``). It can serve nothing (``clientAuth`` only)."""
    ca_cert, ca_key = _load_bus_ca(ca_cert_pem, ca_key_pem)
    alt: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    return _issue_from_bus_ca(ca_cert, ca_key, name=name, days=days, usages=usages, alt=alt)


def bcrypt_password(password: str, *, rounds: int = 11) -> str:
    """``password``'s bcrypt hash as nats-server takes it from the environment: in double quotes,
    since nats-server would read a bare ``$2b$…`` as a variable (``bcx bus password``)."""
    if not password or not password.isascii() or not password.isprintable():
        raise BcError(
            ErrorCode.INVALID_INPUT, "a password of printable ASCII characters", {"path": "password"}
        )
    return '"' + bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode() + '"'
