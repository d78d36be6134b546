"""The deployment's certificate authority: an ECDSA P-256 root that signs agent certificates."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["CertificateAuthority", "ParsedCsr", "parse_csr", "signature_valid"]

CA_VALIDITY = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class ParsedCsr:
    public_key: ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey
    public_key_der: bytes
    key_type: str


def _key_usage(
    *, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False
) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def parse_csr(pem: str) -> ParsedCsr:
    """A PKCS#10 request with a valid self-signature over an Ed25519 or P-256 key.

    Anything else is ``INVALID_INPUT`` at ``csr``.
    """

    def bad(message: str) -> BcError:
        return BcError(ErrorCode.INVALID_INPUT, message, {"path": "csr"})

    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError:
        raise bad("csr is not a PEM certificate request") from None
    key = csr.public_key()
    if isinstance(key, ed25519.Ed25519PublicKey):
        key_type = "ed25519"
    elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        key_type = "ecdsa-p256"
    else:
        raise bad("csr key must be Ed25519 or ECDSA P-256")
    if not csr.is_signature_valid:
        raise bad("csr signature does not verify")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return ParsedCsr(public_key=key, public_key_der=der, key_type=key_type)


def signature_valid(public_key_der: bytes, data: bytes, signature: bytes) -> bool:
    """Ed25519, or DER ECDSA-SHA256 for a P-256 key."""
    key = serialization.load_der_public_key(public_key_der)
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


class CertificateAuthority:
    """A loaded CA: its certificate and private key."""

    def __init__(self, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.certificate = certificate
        self.key = key
        self.certificate_pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
        self.fingerprint = certificate.fingerprint(hashes.SHA256()).hex()

    @classmethod
    def create(cls, *, name: str) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Better Compute"),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, certificate_pem: str, key_pem: bytes) -> CertificateAuthority:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise BcError(ErrorCode.INVALID_CONFIG, "stored CA key is not an ECDSA key")
        return cls(x509.load_pem_x509_certificate(certificate_pem.encode()), key)

    def key_pem(self) -> bytes:
        """The private key, PKCS#8 PEM, unencrypted: seal it before it leaves memory."""
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def issue(
        self,
        csr: ParsedCsr,
        *,
        agent_id: str,
        tenant_id: str,
        site_id: str,
        role: str,
        lifetime: dt.timedelta,
        cert_id: str | None = None,
    ) -> x509.Certificate:
        """An end-entity certificate for ``csr``'s key; the subject is ours, not the CSR's.
        ``cert_id`` (``urn:bc:cert:``) lets a site's NATS auth callout ask bc-pki about it."""
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, tenant_id),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                x509.NameAttribute(NameOID.LOCALITY_NAME, site_id),
                x509.NameAttribute(NameOID.COMMON_NAME, agent_id),
            ]
        )
        ca_ski = self.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.certificate.subject)
            .public_key(csr.public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.UniformResourceIdentifier(f"urn:bc:agent:{agent_id}"),
                        x509.UniformResourceIdentifier(f"urn:bc:site:{site_id}"),
                        *([x509.UniformResourceIdentifier(f"urn:bc:cert:{cert_id}")] if cert_id else []),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(csr.public_key), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski.value),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
