"""Image signatures: allowlisted signers (Ed25519, or ECDSA P-256 over SHA-256) and their check.

What is signed is the image's **signing payload** (``image_signing_payload``): five lines of
UTF-8 text naming the image, its version, its SHA-256 digest and its URL, so a signature made
for one image cannot be replayed under another name, version or URL::

    better-compute image signature v1
    name: ubuntu-24.04
    version: 2024.06.1
    sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    url: https://images.example.com/ubuntu.raw

(each line ends with ``\n``, the last one too). Ed25519 signs those bytes; ECDSA P-256 signs
their SHA-256 (``openssl dgst -sha256 -sign``), DER-encoded, or ``r || s`` as 64 raw bytes.
``bcx images payload`` prints it and ``bcx images sign`` signs it; with OpenSSL::

    bcx images payload ubuntu-24.04@2024.06.1 --url https://… --file ubuntu.raw > payload
    openssl pkeyutl -sign -rawin -inkey ed25519.pem -in payload -out image.sig   # Ed25519
    openssl dgst -sha256 -sign p256.pem -out image.sig payload                   # P-256

A signature over the digest alone (how images were signed before) no longer counts: it is
refused with reason ``digest-only-signature`` and told to re-sign (``is_digest_only_signature``
recognises it). A signer's public key is written as PEM (``-----BEGIN PUBLIC KEY-----``), as
base64 of the DER SubjectPublicKeyInfo, or (Ed25519) as base64 of the raw 32-byte key.
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
    "PAYLOAD_HEADER",
    "SIGNER_ID_PATTERN",
    "Algorithm",
    "ImageSigner",
    "image_signer",
    "image_signing_payload",
    "is_digest_only_signature",
    "sign_image",
    "verify_image_signature",
]

Algorithm = Literal["ed25519", "ecdsa-p256-sha256"]
SIGNER_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
PAYLOAD_HEADER: Final = "better-compute image signature v1"
"""The first line of every signing payload: names the scheme, so a later one cannot be confused."""


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


def image_signing_payload(*, name: str, version: str, sha256: str, url: str) -> bytes:
    """The bytes a signer signs for the image ``name@version`` at ``url`` with digest ``sha256``.

    Raises:
        BcError: ``INVALID_INPUT`` at the field that is empty or holds a control character (a
            line break would let one field pass for another), or at ``sha256``.
    """
    _digest(sha256)
    for path, value in (("name", name), ("version", version), ("url", url)):
        if not isinstance(value, str) or not value or _CONTROL.search(value):
            raise _bad(
                ErrorCode.INVALID_INPUT, path, f"{path} must be non-empty text without control characters"
            )
    lines = (PAYLOAD_HEADER, f"name: {name}", f"version: {version}", f"sha256: {sha256}", f"url: {url}")
    return "".join(line + "\n" for line in lines).encode()


def _verifies(signer: ImageSigner, data: bytes, signature: bytes) -> bool:
    key = serialization.load_der_public_key(signer.public_key)
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
            return True
        if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
            if len(signature) == 64:  # r || s, as some signers write it
                r, s = int.from_bytes(signature[:32]), int.from_bytes(signature[32:])
                signature = encode_dss_signature(r, s)
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
            return True
    except (InvalidSignature, ValueError):
        return False
    return False


def verify_image_signature(
    signer: ImageSigner, signature: bytes, *, name: str, version: str, sha256: str, url: str
) -> bool:
    """Whether ``signature`` is ``signer``'s over the image's signing payload."""
    payload = image_signing_payload(name=name, version=version, sha256=sha256, url=url)
    return _verifies(signer, payload, signature)


def is_digest_only_signature(signer: ImageSigner, sha256: str, signature: bytes) -> bool:
    """Whether ``signature`` is ``signer``'s over the digest's 32 bytes alone: the scheme before
    signing payloads, which no longer counts (its holder must re-sign)."""
    return _verifies(signer, _digest(sha256), signature)


def sign_image(
    private_key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey,
    *,
    name: str,
    version: str,
    sha256: str,
    url: str,
) -> bytes:
    """Sign an image's payload the way ``verify_image_signature`` checks it (``bcx images sign``,
    tests)."""
    payload = image_signing_payload(name=name, version=version, sha256=sha256, url=url)
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        return private_key.sign(payload)
    return private_key.sign(payload, ec.ECDSA(hashes.SHA256()))
