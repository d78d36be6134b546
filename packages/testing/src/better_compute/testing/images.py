"""A catalog image for tests and the demo, signed by the simulator's own key.

Every deploy verb resolves and verifies its image in the catalog before anything is booted, so a
test that deploys needs a signed image there. The simulator's app (``metal_sim.app``) and the
test apps trust ``SIM_IMAGE_SIGNER`` through their ``image_verifier`` (``sim_image_verifier``, a
real Ed25519 check), and ``register_sim_image`` puts ``name@version`` into the catalog signed by
it. The key is derived from a fixed string: it is a test key, never one to trust in production.
"""

from __future__ import annotations

import hashlib
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from ..clients import EngineClient
from ..metal.signatures import ImageSigner, sign_image, verify_image_signature
from ..wire.images import ImageView

__all__ = ["SIM_IMAGE", "SIM_IMAGE_SIGNER", "register_sim_image", "sim_image_verifier"]

SIM_IMAGE: Final = "ubuntu@24.04"
"""The image the simulator's tests and the demo deploy."""

SIM_IMAGE_SIGNER: Final = ed25519.Ed25519PrivateKey.from_private_bytes(
    hashlib.sha256(b"better-compute: the metal simulator's test image signer").digest()
)
_SIGNER: Final = ImageSigner(
    id="sim",
    algorithm="ed25519",
    public_key=SIM_IMAGE_SIGNER.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ),
)


async def sim_image_verifier(
    *, tenant_id: str, digest: str, signature: bytes, name: str, version: str, url: str, payload: bytes
) -> bool:
    """An ``image_verifier``: the signature is ``SIM_IMAGE_SIGNER``'s over the image's signing
    payload (name, version, digest and URL)."""
    return verify_image_signature(_SIGNER, signature, name=name, version=version, sha256=digest, url=url)


async def register_sim_image(
    engine: EngineClient,
    ref: str = SIM_IMAGE,
    *,
    tenant_id: str = "root",
    url: str | None = None,
    data: bytes | None = None,
) -> ImageView:
    """Register ``name@version`` signed by ``SIM_IMAGE_SIGNER`` (again: a no-op). ``data`` is
    the image's bytes, ``url`` where it is served (the signature covers the name, version, digest
    and URL)."""
    name, _, version = ref.partition("@")
    body = data if data is not None else f"simulated image {ref}".encode()
    digest = hashlib.sha256(body).hexdigest()
    url = url or f"http://images.sim.invalid/{name}-{version}.raw"
    return await engine.register_image(
        name=name,
        version=version,
        url=url,
        sha256=digest,
        signature=sign_image(SIM_IMAGE_SIGNER, name=name, version=version, sha256=digest, url=url),
        size=len(body),
        tenant_id=tenant_id,
    )


def main() -> None:
    """``python -m better_compute.testing.images [name@version] [--file F --url U]``: register the
    simulator's signed image (or the file ``F``, served at ``U``, signed by the same test key) in
    the deployment bcx talks to (the demo runs it after ``bcx sim up``)."""
    import argparse
    import asyncio
    from pathlib import Path

    from ..cli.common import engine_client
    from ..config import load_settings

    parser = argparse.ArgumentParser(prog="python -m better_compute.testing.images")
    parser.add_argument("ref", nargs="?", default=SIM_IMAGE, help="name@version")
    parser.add_argument("--file", help="the image's bytes (default: a simulated image's)")
    parser.add_argument("--url", help="where the image is served (with --file)")
    args = parser.parse_args()
    data = Path(args.file).read_bytes() if args.file else None

    async def run() -> None:
        async with engine_client(load_settings()) as engine:
            view = await register_sim_image(engine, args.ref, url=args.url, data=data)
        print(f"{view.name}@{view.version} in the catalog, signed by the simulator's test key")

    asyncio.run(run())


if __name__ == "__main__":
    main()
