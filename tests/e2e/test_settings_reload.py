"""bc.toml changed under running services (issue 26): the approvers written inline in
``[cmdq.quorum]`` and the image signers of ``[images]`` are in force without a restart, and a
wrong file is logged with its code and path while the settings in force stay."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from better_compute.clients import CommandQueueClient, EngineClient
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.core.ids import new_id
from better_compute.metal.signatures import image_signing_payload
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.approvers import approver_keys, public_b64


def _signer_key(key: ed25519.Ed25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def _write(path: Path, text: str) -> None:
    """As an editor saving it, or configuration management: a new file in its place."""
    staged = path.with_suffix(".next")
    staged.write_text(text)
    os.replace(staged, path)


def _bc_toml(
    approvers: dict[str, ed25519.Ed25519PrivateKey], signers: dict[str, str], ramdisk: str | None = None
) -> str:
    lines = ["[cmdq.quorum]", "threshold = 1"] if approvers else []
    if ramdisk is not None:
        lines += ["[ramdisk]", f'kernel = "{ramdisk}/vmlinuz"', f'initrd = "{ramdisk}/initrd.img"']
    for name, key in approvers.items():
        lines += ["[[cmdq.quorum.approvers]]", f'id = "{name}"', f'publicKey = "{public_b64(key)}"']
    for name, public in signers.items():
        lines += ["[[images.signers]]", f'id = "{name}"', f'publicKey = "{public}"']
    return "\n".join(lines) + "\n"


async def _register(engine: EngineClient, signer: str, key: ed25519.Ed25519PrivateKey, version: str) -> None:
    url, sha = f"https://images.example/acme-{version}.raw", hashlib.sha256(version.encode()).hexdigest()
    payload = image_signing_payload(name="acme", version=version, sha256=sha, url=url)
    await engine.register_image(
        name="acme", version=version, url=url, sha256=sha, signer=signer, signature=key.sign(payload)
    )


async def _configured_ramdisk(settings: Settings) -> dict[str, Any] | None:
    """What the engines boot instead of the ramdisk they started with (row 2, set by a reload)."""
    conn = await asyncpg.connect(settings.database_url)
    try:
        doc = await conn.fetchval("SELECT doc FROM engine.ramdisk_override WHERE id = 2")
    finally:
        await conn.close()
    return json.loads(doc) if doc is not None else None


async def test_inline_approvers_and_image_signers_change_with_the_file(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    carol, dave = approver_keys(["carol", "dave"]).values()
    old_signer, new_signer = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    config = tmp_path / "bc.toml"
    _write(
        config, _bc_toml({"carol": carol}, {"acme-old": _signer_key(old_signer)}, "https://boot.example/a")
    )
    bc_processes.extra_env.update(BC_CONFIG=str(config))
    cmdq = bc_processes.start("bc-command-queue")
    engine_proc = bc_processes.start("bc-engine")
    await bc_processes.wait_ready()
    cq, engine = CommandQueueClient(bc_api), EngineClient(bc_api)
    assert [a.id for a in (await cq.quorum()).approvers] == ["carol"]
    await _register(engine, "acme-old", old_signer, "1")
    batch = await cq.create_batch(kinds=["node.wipe"], nodes=[new_id("node")], ttl_seconds=600)

    # dave replaces carol, acme-new replaces acme-old, ramdisk b replaces a: no restart
    _write(config, _bc_toml({"dave": dave}, {"acme-new": _signer_key(new_signer)}, "https://boot.example/b"))

    async def dave_in_force() -> bool:
        return [a.id for a in (await cq.quorum()).approvers] == ["dave"]

    await until(dave_in_force, timeout=30, what="dave the approver")
    approved = await cq.approve_batch(
        batch_id=batch.id, approver_id="dave", signature=dave.sign(batch.document)
    )
    assert approved.state == "approved"

    async def new_signer_in_force() -> bool:
        return [s.id for s in (await engine.list_image_signers()).signers] == ["acme-new"]

    await until(new_signer_in_force, timeout=30, what="acme-new the only signer")
    await _register(engine, "acme-new", new_signer, "2")
    with pytest.raises(BcError) as refused:
        await _register(engine, "acme-old", old_signer, "3")
    assert refused.value.details.get("reason") == "unknown-signer"
    # the shipped profiles' metal.ensureRamdisk boots b from its next run (configured_in_force)
    change = await _configured_ramdisk(bc_settings)
    assert change is not None
    assert (change["replaces"]["kernel"], change["doc"]["kernel"]) == (
        "https://boot.example/a/vmlinuz", "https://boot.example/b/vmlinuz",
    )  # fmt: skip
    assert "settings_reloaded" in cmdq.output()
    assert "settings_reloaded" in engine_proc.output()

    # a wrong file (a key that is no key; the quorum dropped, which only a restart may do): each
    # service says so with the code and the path, and keeps what is in force
    _write(config, _bc_toml({}, {"acme-new": "not a key"}))

    async def both_refused() -> bool:
        return "settings_invalid" in cmdq.output() and "settings_invalid" in engine_proc.output()

    await until(both_refused, timeout=30, what="the wrong file logged by both services")
    assert '"path": "cmdq.quorum.approvers"' in cmdq.output()
    assert "turning the quorum off takes a restart" in cmdq.output()
    assert "images.signers[0]" in engine_proc.output()
    assert [a.id for a in (await cq.quorum()).approvers] == ["dave"]
    assert [s.id for s in (await engine.list_image_signers()).signers] == ["acme-new"]
    assert await _configured_ramdisk(bc_settings) == change  # the wrong file changed nothing
    assert cmdq.alive()
    assert engine_proc.alive()
