"""Image signatures: allowlisted signers (Ed25519, or ECDSA P-256 over SHA-256) and their check.

What is signed is the image's SHA-256 digest: its 32 raw bytes (not the hex text). Ed25519 signs
those bytes; ECDSA P-256 signs their SHA-256 (``openssl dgst -sha256 -sign``), DER-encoded, or
``r || s`` as 64 raw bytes. With OpenSSL, for an image whose digest is ``$SHA``::

    printf %s "$SHA" | xxd -r -p > digest.bin
    openssl pkeyutl -sign -rawin -inkey ed25519.pem -in digest.bin -out image.sig   # Ed25519
    openssl dgst -sha256 -sign p256.pem -out image.sig digest.bin                   # P-256

A signer's public key is written as PEM (``-----BEGIN PUBLIC KEY-----``), as base64 of the DER
SubjectPublicKeyInfo, or (Ed25519) as base64 of the raw 32-byte key.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from better_compute.core.errors import BcError, ErrorCode

__all__ = [
    "SIGNER_ID_PATTERN",
    "Algorithm",
    "ImageSigner",
    "image_signer",
    "sign_image_digest",
    "verify_image_signature",
]

Algorithm = Literal["ed25519", "ecdsa-p256-sha256"]
SIGNER_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class ImageSigner:
    """An allowlisted signer: its id, algorithm and DER SubjectPublicKeyInfo."""

    id: str
    algorithm: Algorithm
    public_key: bytes


def _bad(code: ErrorCode, path: str, message: str) -> BcError:
    return BcError(code, message, {"path": path})


def _load(text: str) -> ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey | None:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text.encode())
        except ValueError:
            return None
    else:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(raw) == 32:
            return ed25519.Ed25519PublicKey.from_public_bytes(raw)
        try:
            key = serialization.load_der_public_key(raw)
        except ValueError:
            return None
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    return None


def image_signer(
    id: str, public_key: str, *, path: str = "signer", code: ErrorCode = ErrorCode.INVALID_CONFIG
) -> ImageSigner:
    """An allowlisted signer from its id and public key (PEM, base64 DER, or base64 raw Ed25519).

    Raises:
        BcError: ``code`` at ``path.id`` or ``path.publicKey`` (an RSA or P-384 key, say).
    """
    if not isinstance(id, str) or re.fullmatch(SIGNER_ID_PATTERN, id) is None:
        raise _bad(code, f"{path}.id", "a signer id is 1 to 64 letters, digits and ._- (like acme-release)")
    key = _load(public_key) if isinstance(public_key, str) else None
    if key is None:
        raise _bad(
            code,
            f"{path}.publicKey",
            "expected an Ed25519 or ECDSA P-256 public key: PEM, base64 of its DER form, or base64"
            " of the raw 32-byte Ed25519 key",
        )
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    algorithm: Algorithm = "ed25519" if isinstance(key, ed25519.Ed25519PublicKey) else "ecdsa-p256-sha256"
    return ImageSigner(id=id, algorithm=algorithm, public_key=der)


def _digest(sha256: str) -> bytes:
    if not isinstance(sha256, str) or _SHA256.match(sha256) is None:
        raise _bad(ErrorCode.INVALID_INPUT, "sha256", "sha256 is 64 lowercase hex digits")
    return bytes.fromhex(sha256)


def verify_image_signature(signer: ImageSigner, sha256: str, signature: bytes) -> bool:
    """Whether ``signature`` is ``signer``'s over the image digest ``sha256`` (hex)."""
    digest = _digest(sha256)
    key = serialization.load_der_public_key(signer.public_key)
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, digest)
            return True
        if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
            if len(signature) == 64:  # r || s, as some signers write it
                r, s = int.from_bytes(signature[:32]), int.from_bytes(signature[32:])
                signature = encode_dss_signature(r, s)
            key.verify(signature, digest, ec.ECDSA(hashes.SHA256()))
            return True
    except (InvalidSignature, ValueError):
        return False
    return False


def sign_image_digest(
    private_key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey, sha256: str
) -> bytes:
    """Sign an image digest (hex) the way ``verify_image_signature`` checks it (tests, tools)."""
    digest = _digest(sha256)
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        return private_key.sign(digest)
    return private_key.sign(digest, ec.ECDSA(hashes.SHA256()))
