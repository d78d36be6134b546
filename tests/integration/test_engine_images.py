"""The image catalog through the engine API, and resolve_image_ref on the engine's database."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from bc_engine.service import EngineService
from bc_engine.steps.context import EngineSql
from better_compute.config import ImageSignerSetting, ImagesSettings, Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.images import resolve_image_ref
from better_compute.service import ApiClient
from better_compute.testing import refused

ED = ed25519.Ed25519PrivateKey.generate()
P256 = ec.generate_private_key(ec.SECP256R1())
OTHER = ed25519.Ed25519PrivateKey.generate()


def pem(key: Any) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def raw_ed25519(key: ed25519.Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


SIGNERS = [
    ImageSignerSetting(id="acme-release", public_key=raw_ed25519(ED)),
    ImageSignerSetting(id="acme-p256", public_key=pem(P256)),
]


def sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def payload(name: str, version: str, digest: str, url: str) -> bytes:
    """The signing payload as docs/images.md writes it (what an operator signs with openssl)."""
    return (
        f"better-compute image signature v1\nname: {name}\nversion: {version}\nsha256: {digest}\nurl: {url}\n"
    ).encode()


def sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))  # type: ignore[no-any-return]


def image(
    name: str, version: str, *, key: Any = ED, signer: str = "acme-release", **kw: Any
) -> dict[str, Any]:
    digest = kw.pop("sha256", sha(f"{name}@{version}"))
    url = kw.pop("url", f"https://images.example.com/{name}/{version}.raw.zst")
    signature = kw.pop("signature", sign(key, payload(name, version, digest, url)))
    return {
        "name": name,
        "version": version,
        "url": url,
        "sha256": digest,
        "format": "raw.zst",
        "size": 2_147_483_648,
        "signer": signer,
        "signature": base64.b64encode(signature).decode(),
        **kw,
    }


@asynccontextmanager
async def engine(
    settings: Settings, *, signers: list[ImageSignerSetting], app: str = ""
) -> AsyncIterator[EngineService]:
    changes: dict[str, Any] = {"images": ImagesSettings(signers=signers)}
    if app:
        changes["app"] = app
    svc = EngineService(msgspec.structs.replace(settings, **changes))
    async with svc:
        run = asyncio.create_task(svc.run())
        try:
            yield svc
        finally:
            svc.request_stop()
            await asyncio.wait_for(run, 10)


async def register(api: ApiClient, body: dict[str, Any], tenant: str = "acme") -> dict[str, Any]:
    return await api.call("engine", "images.register", {"tenantId": tenant, **body})


async def test_ed25519_and_p256_signed_images_register_and_resolve(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    async with engine(bc_settings, signers=SIGNERS) as svc:
        ed = await register(bc_api, image("ubuntu-24.04", "2024.06.1"))
        p256 = await register(bc_api, image("flatcar", "3815.2.5", key=P256, signer="acme-p256"))
        assert (ed["ref"], ed["signer"], p256["signer"]) == (
            "ubuntu-24.04@2024.06.1",
            "acme-release",
            "acme-p256",
        )
        assert "signature" not in ed
        got = await resolve_image_ref(EngineSql(svc.db.pool), "acme", "flatcar@3815.2.5")
        assert got == {
            "name": "flatcar", "version": "3815.2.5", "url": "https://images.example.com/flatcar/3815.2.5.raw.zst",
            "sha256": sha("flatcar@3815.2.5"), "format": "raw.zst", "size": 2_147_483_648,
            "signer": "acme-p256", "tenantId": "acme",
        }  # fmt: skip
        shown = await bc_api.call(
            "engine", "images.get", {"tenantId": "acme", "ref": "ubuntu-24.04@2024.06.1"}
        )
        assert (shown["sha256"], shown["signerStatus"]) == (sha("ubuntu-24.04@2024.06.1"), "allowlisted")
        # registering the same image again changes nothing; other contents are a conflict
        assert (await register(bc_api, image("ubuntu-24.04", "2024.06.1")))["createdAt"] == ed["createdAt"]
        err = await refused(register(bc_api, image("ubuntu-24.04", "2024.06.1", sha256=sha("other"))))
        assert (err.code, err.path) == (ErrorCode.CONFLICT, "version")


async def test_a_flipped_byte_and_an_unknown_signer_are_refused(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    good = image("ubuntu-24.04", "2024.06.1")
    sig = bytearray(base64.b64decode(good["signature"]))
    sig[7] ^= 0x01
    digest = bytearray.fromhex(good["sha256"])
    digest[0] ^= 0x80
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({**good, "signature": base64.b64encode(bytes(sig)).decode()}, "signature", "bad-signature"),
        ({**good, "sha256": digest.hex()}, "signature", "bad-signature"),
        (image("ubuntu-24.04", "2024.06.1", key=P256, signer="acme-release"), "signature", "bad-signature"),
        (image("ubuntu-24.04", "2024.06.1", key=OTHER, signer="mallory"), "signer", "unknown-signer"),
    ]
    async with engine(bc_settings, signers=SIGNERS):
        for body, path, reason in cases:
            err = await refused(register(bc_api, body))
            assert (err.code, err.path, err.reason) == (ErrorCode.PERMISSION_DENIED, path, reason), (
                err.message
            )
        err = await refused(
            bc_api.call("engine", "images.get", {"tenantId": "acme", "ref": "ubuntu-24.04@2024.06.1"})
        )
        assert err.code is ErrorCode.NOT_FOUND
        # a malformed request is INVALID_INPUT at its field
        for bad, path in [({"sha256": "ABC"}, "sha256"), ({"signature": "%%%"}, "signature"),
                          ({"url": "ftp://x"}, "url"), ({"format": "vmdk"}, "format")]:  # fmt: skip
            err = await refused(register(bc_api, {**good, **bad}))
            assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, path)


async def test_a_signature_binds_name_version_and_url_and_digest_only_ones_are_refused(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 23 L3: a signature covered only the digest, so a signed image could be registered
    again under any name, version or URL. It now covers all four; a signature over the digest
    alone (the old scheme) is refused with a reason that says to re-sign."""
    good = image("ubuntu-24.04", "2024.06.1")
    digest = good["sha256"]
    signature = good["signature"]
    moved = [
        {**good, "name": "ubuntu-evil"},
        {**good, "version": "2024.06.2"},
        {**good, "url": "https://evil.example.com/ubuntu.raw.zst"},
    ]
    old = [
        {**good, "signature": base64.b64encode(ED.sign(bytes.fromhex(digest))).decode()},
        image("flatcar", "1", key=P256, signer="acme-p256",
              signature=P256.sign(bytes.fromhex(sha("flatcar@1")), ec.ECDSA(hashes.SHA256()))),
    ]  # fmt: skip
    async with engine(bc_settings, signers=SIGNERS) as svc:
        for body in moved:
            err = await refused(register(bc_api, body))
            assert (err.code, err.path, err.reason) == (
                ErrorCode.PERMISSION_DENIED,
                "signature",
                "bad-signature",
            )
        for body in old:
            err = await refused(register(bc_api, body))
            assert (err.code, err.path, err.reason) == (
                ErrorCode.PERMISSION_DENIED, "signature", "digest-only-signature",
            )  # fmt: skip
            assert "re-sign" in err.message
        assert (await register(bc_api, good))["signer"] == "acme-release"
        # a catalog entry signed the old way (before this change) does not resolve either
        await svc.db.pool.execute(
            "INSERT INTO images (tenant_id, name, version, url, sha256, format, size, signer, signature,"
            " public) VALUES ('acme', 'legacy', '1', 'https://images.example.com/legacy.raw', $1, 'raw',"
            " NULL, 'acme-release', $2, false)",
            digest, ED.sign(bytes.fromhex(digest)),
        )  # fmt: skip
        err = await refused(resolve_image_ref(EngineSql(svc.db.pool), "acme", "legacy@1"))
        assert (err.code, err.path, err.reason) == (ErrorCode.INVALID_STATE, "image", "digest-only-signature")
        assert "re-sign" in err.message
    assert signature == good["signature"]


async def test_a_signer_removed_after_registration_is_refused_at_resolve(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    async with engine(bc_settings, signers=SIGNERS):
        await register(bc_api, image("ubuntu-24.04", "2024.06.1"))
        await register(bc_api, image("flatcar", "3815.2.5", key=P256, signer="acme-p256"))
    # the operator drops acme-release from [images] signers and restarts the engine
    async with engine(bc_settings, signers=SIGNERS[1:]) as svc:
        sql = EngineSql(svc.db.pool)
        err = await refused(resolve_image_ref(sql, "acme", "ubuntu-24.04@2024.06.1"))
        assert (err.code, err.path, err.reason) == (ErrorCode.INVALID_STATE, "image", "signer-removed")
        assert "acme-release" in err.message
        assert (await resolve_image_ref(sql, "acme", "flatcar@3815.2.5"))["signer"] == "acme-p256"
        shown = await bc_api.call(
            "engine", "images.get", {"tenantId": "acme", "ref": "ubuntu-24.04@2024.06.1"}
        )
        assert shown["signerStatus"] == "removed"
        listed = await bc_api.call("engine", "images.list", {"tenantId": "acme"})
        assert {i["ref"]: i["signerStatus"] for i in listed["images"]} == {
            "flatcar@3815.2.5": "allowlisted", "ubuntu-24.04@2024.06.1": "removed",
        }  # fmt: skip
        # and new registrations by it are refused
        err = await refused(register(bc_api, image("ubuntu-24.04", "2024.07.1")))
        assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "unknown-signer")
    # a key swapped under the same id: its old signatures no longer verify
    swapped = [ImageSignerSetting(id="acme-p256", public_key=pem(ec.generate_private_key(ec.SECP256R1())))]
    async with engine(bc_settings, signers=swapped) as svc:
        err = await refused(resolve_image_ref(EngineSql(svc.db.pool), "acme", "flatcar@3815.2.5"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "bad-signature")


async def test_the_tenant_image_wins_then_a_public_one(bc_settings: Settings, bc_api: ApiClient) -> None:
    async with engine(bc_settings, signers=SIGNERS) as svc:
        sql = EngineSql(svc.db.pool)
        await register(bc_api, image("ubuntu-24.04", "2024.06.1", public=True), tenant="vendor")
        await register(bc_api, image("talos", "1.7.0"), tenant="vendor")  # private
        assert (await resolve_image_ref(sql, "acme", "ubuntu-24.04@2024.06.1"))["tenantId"] == "vendor"
        own = image("ubuntu-24.04", "2024.06.1", sha256=sha("acme's own build"))
        await register(bc_api, own)
        got = await resolve_image_ref(sql, "acme", "ubuntu-24.04@2024.06.1")
        assert (got["tenantId"], got["sha256"]) == ("acme", sha("acme's own build"))
        assert (await resolve_image_ref(sql, "initech", "ubuntu-24.04@2024.06.1"))["tenantId"] == "vendor"
        for ref in ("talos@1.7.0", "ubuntu-24.04@2099.1"):
            err = await refused(resolve_image_ref(sql, "acme", ref))
            assert (err.code, err.path) == (ErrorCode.NOT_FOUND, "image")
        err = await refused(resolve_image_ref(sql, "acme", "Ubuntu 24.04"))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "image")
        # delete: only the tenant's own; afterwards the public one resolves again
        err = await refused(
            bc_api.call("engine", "images.delete", {"tenantId": "acme", "ref": "talos@1.7.0"})
        )
        assert err.code is ErrorCode.NOT_FOUND
        await bc_api.call("engine", "images.delete", {"tenantId": "acme", "ref": "ubuntu-24.04@2024.06.1"})
        assert (await resolve_image_ref(sql, "acme", "ubuntu-24.04@2024.06.1"))["tenantId"] == "vendor"


async def test_images_list_pages_through_own_and_public(bc_settings: Settings, bc_api: ApiClient) -> None:
    async with engine(bc_settings, signers=SIGNERS):
        for minor in range(5):
            await register(bc_api, image("ubuntu-24.04", f"2024.0{minor}.1"))
        await register(bc_api, image("flatcar", "1", public=True), tenant="vendor")
        await register(bc_api, image("hidden", "1"), tenant="vendor")
        seen: list[str] = []
        cursor = None
        while True:
            page = await bc_api.call(
                "engine", "images.list", {"tenantId": "acme", "limit": 2, "cursor": cursor}
            )
            assert len(page["images"]) <= 2
            seen += [i["ref"] for i in page["images"]]
            if (cursor := page["next"]) is None:
                break
        assert seen == ["flatcar@1", *(f"ubuntu-24.04@2024.0{m}.1" for m in range(5))]
        only = await bc_api.call("engine", "images.list", {"tenantId": "acme", "name": "flatcar"})
        assert [i["tenantId"] for i in only["images"]] == ["vendor"]


async def test_the_apps_image_verifier_replaces_the_allowlist(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    def ok(digest: str, url: str) -> str:
        return base64.b64encode(f"ok:{digest}:{url}".encode()).decode()

    body: Callable[..., dict[str, Any]] = lambda **kw: image("custom", "1", **kw)  # noqa: E731
    async with engine(bc_settings, signers=[], app="images_test_app:app") as svc:
        good = body(signer="anyone")
        got = await register(bc_api, {**good, "signature": ok(good["sha256"], good["url"])})
        assert got["signer"] is None
        err = await refused(register(bc_api, body()))  # an Ed25519 signature means nothing to it
        assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "bad-signature")
        sql = EngineSql(svc.db.pool)
        verifier = svc.app.provision.image_verifier  # type: ignore[union-attr]
        assert (await resolve_image_ref(sql, "acme", "custom@1", verifier=verifier))["name"] == "custom"
        err = await refused(resolve_image_ref(sql, "blocked", "custom@1", verifier=verifier))
        assert err.code is ErrorCode.NOT_FOUND  # acme's image is private
        # without the verifier, the allowlist decides, and it has no signer for this image
        err = await refused(resolve_image_ref(sql, "acme", "custom@1"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "signer-removed")


async def test_a_key_that_is_not_ed25519_or_p256_stops_the_engine(bc_settings: Settings) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    bad = [SIGNERS[0], ImageSignerSetting(id="rsa", public_key=pem(rsa.generate_private_key(65537, 2048)))]
    with pytest.raises(BcError) as info:
        async with engine(bc_settings, signers=bad):
            pass
    assert (info.value.code, info.value.path) == (ErrorCode.INVALID_CONFIG, "images.signers[1].publicKey")


async def test_a_deploy_of_an_image_whose_signer_was_removed_starts_nothing(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    """Every deploy verifies its image before it starts: an image whose signer left the allowlist
    fails the verb (INVALID_STATE at image), the node stays ready and no workflow starts."""
    async with engine(bc_settings, signers=SIGNERS):
        await register(bc_api, image("ubuntu-24.04", "2024.06.1"))
    async with engine(bc_settings, signers=SIGNERS[1:]) as svc:
        node = await bc_api.call("engine", "metal.enroll", {"siteId": "lab1", "tenantId": "acme"})
        await svc.db.pool.execute("UPDATE nodes SET state = 'ready' WHERE id = $1", node["id"])
        for profile in ("metal.deploy", None):
            body = {"nodeId": node["id"], "image": "ubuntu-24.04@2024.06.1", "profile": profile}
            err = await refused(bc_api.call("engine", "metal.deploy", body))
            assert (err.code, err.path, err.reason) == (ErrorCode.INVALID_STATE, "image", "signer-removed")
            assert "nothing was started" in err.message
        shown = await bc_api.call("engine", "nodes.get", {"id": node["id"]})
        assert (shown["state"], shown.get("workflowId"), shown.get("image")) == ("ready", None, None)
        listed = await bc_api.call("engine", "workflows.list", {"nodeId": node["id"]})
        assert listed["workflows"] == []


async def test_an_operator_adds_and_removes_a_signer_while_the_engine_runs(
    bc_settings: Settings, bc_api: ApiClient
) -> None:
    """Issue 26: a signer added with ``images.signers.add`` is in force for the next registration
    with no restart, survives an engine's start (which rewrites only the configured signers), and
    once removed its images stop resolving."""
    tools = image("tools", "1", key=OTHER, signer="ops-ci")
    async with engine(bc_settings, signers=SIGNERS) as svc:
        err = await refused(register(bc_api, tools))
        assert (err.code, err.reason) == (ErrorCode.PERMISSION_DENIED, "unknown-signer")
        added = await bc_api.call("engine", "images.signers.add", {"id": "ops-ci", "publicKey": pem(OTHER)})
        assert (added["id"], added["algorithm"], added["source"]) == ("ops-ci", "ed25519", "operator")
        assert (await register(bc_api, tools))["signer"] == "ops-ci"  # the next registration, no restart
        err = await refused(
            bc_api.call("engine", "images.signers.add", {"id": "ops-ci", "publicKey": raw_ed25519(ED)})
        )
        assert (err.code, err.path) == (ErrorCode.CONFLICT, "id")
        err = await refused(bc_api.call("engine", "images.signers.add", {"id": "bad", "publicKey": "nope"}))
        assert (err.code, err.path) == (ErrorCode.INVALID_INPUT, "publicKey")
        err = await refused(bc_api.call("engine", "images.signers.remove", {"id": "acme-release"}))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "configured-signer")
    async with engine(bc_settings, signers=SIGNERS) as svc:  # a start keeps the operator's signer
        listed = await bc_api.call("engine", "images.signers.list", {})
        assert {s["id"]: s["source"] for s in listed["signers"]} == {
            "acme-p256": "config", "acme-release": "config", "ops-ci": "operator",
        }  # fmt: skip
        sql = EngineSql(svc.db.pool)
        assert (await resolve_image_ref(sql, "acme", "tools@1"))["signer"] == "ops-ci"
        removed = await bc_api.call("engine", "images.signers.remove", {"id": "ops-ci"})
        assert removed["id"] == "ops-ci"
        err = await refused(resolve_image_ref(sql, "acme", "tools@1"))
        assert (err.code, err.reason) == (ErrorCode.INVALID_STATE, "signer-removed")
