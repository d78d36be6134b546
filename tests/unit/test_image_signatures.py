"""Image signatures: Ed25519 and P-256 signers, key formats, and what is refused."""

from __future__ import annotations

import base64
import hashlib

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.images import parse_image_ref
from better_compute.metal.signatures import (
    image_signer,
    image_signing_payload,
    is_digest_only_signature,
    sign_image,
    verify_image_signature,
)

pytestmark = pytest.mark.unit

DIGEST = hashlib.sha256(b"ubuntu-24.04 image").hexdigest()
IMAGE = {"name": "ubuntu-24.04", "version": "2024.06.1", "url": "https://images.example.com/u.raw"}


def sign_test_image(key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey, digest: str) -> bytes:
    """This image's signature under ``digest`` (the test's shorthand)."""
    return sign_image(key, sha256=digest, **IMAGE)


def verify(signer: object, digest: str, signature: bytes) -> bool:
    return verify_image_signature(signer, signature, sha256=digest, **IMAGE)  # type: ignore[arg-type]


ED = ed25519.Ed25519PrivateKey.generate()
P256 = ec.generate_private_key(ec.SECP256R1())


def spki(key: object, encoding: serialization.Encoding) -> bytes:
    return key.public_key().public_bytes(encoding, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def test_ed25519_signatures_verify_from_any_key_form() -> None:
    raw = ED.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    forms = [
        spki(ED, serialization.Encoding.PEM).decode(),
        base64.b64encode(spki(ED, serialization.Encoding.DER)).decode(),
        base64.b64encode(raw).decode(),
    ]
    signature = sign_test_image(ED, DIGEST)
    for form in forms:
        signer = image_signer("acme-release", form)
        assert signer.algorithm == "ed25519"
        assert verify(signer, DIGEST, signature)


def test_p256_signatures_verify_in_der_and_raw_form() -> None:
    signer = image_signer("acme-p256", spki(P256, serialization.Encoding.PEM).decode())
    assert signer.algorithm == "ecdsa-p256-sha256"
    der = sign_test_image(P256, DIGEST)
    r, s = decode_dss_signature(der)
    raw = r.to_bytes(32) + s.to_bytes(32)
    assert verify(signer, DIGEST, der)
    assert verify(signer, DIGEST, raw)


def test_p256_signs_the_sha256_of_the_payload_as_openssl_dgst_does() -> None:
    from cryptography.hazmat.primitives import hashes

    payload = image_signing_payload(sha256=DIGEST, **IMAGE)
    signature = P256.sign(payload, ec.ECDSA(hashes.SHA256()))  # openssl dgst -sha256 -sign payload
    signer = image_signer("acme-p256", base64.b64encode(spki(P256, serialization.Encoding.DER)).decode())
    assert verify(signer, DIGEST, signature)


@pytest.mark.parametrize("key", [ED, P256], ids=["ed25519", "p256"])
def test_a_flipped_byte_anywhere_is_refused(
    key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey,
) -> None:
    signer = image_signer("s", spki(key, serialization.Encoding.PEM).decode())
    signature = sign_test_image(key, DIGEST)
    for i in range(len(signature)):
        flipped = bytearray(signature)
        flipped[i] ^= 0x01
        assert not verify(signer, DIGEST, bytes(flipped)), i
    other = f"{int(DIGEST[0], 16) ^ 1:x}" + DIGEST[1:]
    assert not verify(signer, other, signature)
    assert not verify(signer, DIGEST, b"")


def test_another_signers_signature_is_refused() -> None:
    signer = image_signer("acme-release", spki(ED, serialization.Encoding.PEM).decode())
    assert not verify(signer, DIGEST, sign_test_image(ed25519.Ed25519PrivateKey.generate(), DIGEST))
    assert not verify(signer, DIGEST, sign_test_image(P256, DIGEST))


@pytest.mark.parametrize(
    ("key", "path"),
    [
        (
            spki(rsa.generate_private_key(65537, 2048), serialization.Encoding.PEM).decode(),
            "signer.publicKey",
        ),
        (
            spki(ec.generate_private_key(ec.SECP384R1()), serialization.Encoding.PEM).decode(),
            "signer.publicKey",
        ),
        ("not base64!", "signer.publicKey"),
        (base64.b64encode(b"short").decode(), "signer.publicKey"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "signer.publicKey"),
    ],
)
def test_keys_other_than_ed25519_and_p256_are_refused(key: str, path: str) -> None:
    with pytest.raises(BcError) as info:
        image_signer("s", key)
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_CONFIG, path)


def test_signer_ids_and_digests_are_checked() -> None:
    pem = spki(ED, serialization.Encoding.PEM).decode()
    with pytest.raises(BcError) as info:
        image_signer("bad id", pem, path="images.signers[0]")
    assert info.value.path == "images.signers[0].id"
    with pytest.raises(BcError) as info:
        verify(image_signer("s", pem), DIGEST.upper(), b"x")
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "sha256")


@pytest.mark.parametrize("ref", ["ubuntu", "ubuntu@", "@1", "Ubuntu@1", "a@b@c", "a b@1", 3, None])
def test_an_image_ref_is_name_at_version(ref: object) -> None:
    with pytest.raises(BcError) as info:
        parse_image_ref(ref)
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, "image")
    assert parse_image_ref("ubuntu-24.04@2024.06.1+b2") == ("ubuntu-24.04", "2024.06.1+b2")


def test_deploy_resolves_images_through_the_catalog() -> None:
    from better_compute.metal.images import resolve_image_ref
    from better_compute.metal.steps import deploy

    assert deploy.resolve_image_ref is resolve_image_ref


def test_the_signing_payload_is_the_documented_text() -> None:
    """Issue 23 L3: what a signer signs names the image, its version, digest and URL (docs/images.md)."""
    assert (
        image_signing_payload(sha256=DIGEST, **IMAGE)
        == (
            "better-compute image signature v1\n"
            "name: ubuntu-24.04\n"
            "version: 2024.06.1\n"
            f"sha256: {DIGEST}\n"
            "url: https://images.example.com/u.raw\n"
        ).encode()
    )
    for field, bad in (("name", "a\nurl: x"), ("version", ""), ("url", "https://x/\x00")):
        with pytest.raises(BcError) as info:
            image_signing_payload(sha256=DIGEST, **{**IMAGE, field: bad})
        assert (info.value.code, info.value.path) == (ErrorCode.INVALID_INPUT, field)


@pytest.mark.parametrize("key", [ED, P256], ids=["ed25519", "p256"])
def test_a_signature_binds_name_version_and_url_and_digest_only_ones_are_recognised(
    key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey,
) -> None:
    signer = image_signer("s", spki(key, serialization.Encoding.PEM).decode())
    signature = sign_image(key, sha256=DIGEST, **IMAGE)
    assert verify_image_signature(signer, signature, sha256=DIGEST, **IMAGE)
    for field, other in (("name", "ubuntu-evil"), ("version", "2024.06.2"), ("url", "https://evil/u.raw")):
        assert not verify_image_signature(signer, signature, sha256=DIGEST, **{**IMAGE, field: other}), field
    assert not is_digest_only_signature(signer, DIGEST, signature)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        old = key.sign(bytes.fromhex(DIGEST))
    else:
        from cryptography.hazmat.primitives import hashes

        old = key.sign(bytes.fromhex(DIGEST), ec.ECDSA(hashes.SHA256()))
    assert not verify_image_signature(signer, old, sha256=DIGEST, **IMAGE)
    assert is_digest_only_signature(signer, DIGEST, old)


async def test_the_simulators_image_helper_signs_what_its_verifier_checks() -> None:
    """The VM lab and the simulator register their test images with ``register_sim_image`` and
    trust them through ``sim_image_verifier``: both speak the signing payload."""
    from better_compute.testing.images import register_sim_image, sim_image_verifier

    class Engine:
        async def register_image(self, **body: object) -> dict[str, object]:
            self.body = body
            return body

    engine = Engine()
    await register_sim_image(engine, "tos@1", url="http://10.0.2.2:8000/os.raw", data=b"an os")  # type: ignore[arg-type]
    body = engine.body
    args = {k: body[k] for k in ("name", "version", "url")}
    digest = str(body["sha256"])
    payload = image_signing_payload(sha256=digest, **args)  # type: ignore[arg-type]
    signature = body["signature"]
    assert isinstance(signature, bytes)
    kw = {"tenant_id": "root", "digest": digest, "signature": signature, "payload": payload}
    assert await sim_image_verifier(**kw, **args)  # type: ignore[arg-type]
    moved = {**args, "url": "http://10.0.2.2:8000/other.raw"}
    assert not await sim_image_verifier(**kw, **moved)  # type: ignore[arg-type]


def test_an_image_verifier_that_does_not_take_the_payload_is_refused_at_start() -> None:
    from better_compute.provision import provision_module

    async def old(*, tenant_id: str, digest: str, signature: bytes) -> bool:
        return True

    async def new(**kw: object) -> bool:
        return True

    with pytest.raises(BcError) as info:
        provision_module(image_verifier=old)  # type: ignore[arg-type]
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_CONFIG, "image_verifier")
    assert "payload" in info.value.message
    assert provision_module(image_verifier=new).image_verifier is new  # type: ignore[arg-type]
