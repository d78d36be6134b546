"""Destructive-batch approvers for tests: their keys, and the quorum file that names them
(``BC_CMDQ_QUORUM_FILE``, or ``[cmdq.quorum]`` of ``bc.toml``)."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

__all__ = ["approver_keys", "public_b64", "write_approvers"]


def approver_keys(names: Iterable[str]) -> dict[str, ed25519.Ed25519PrivateKey]:
    """A new Ed25519 key for each approver."""
    return {name: ed25519.Ed25519PrivateKey.generate() for name in names}


def public_b64(key: ed25519.Ed25519PrivateKey) -> str:
    """The raw public key, base64: how the quorum file gives it."""
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def write_approvers(path: Path, keys: Mapping[str, ed25519.Ed25519PrivateKey], *, threshold: int = 2) -> Path:
    """Write the quorum file: ``threshold`` and one ``[[approvers]]`` table a key."""
    lines = [f"threshold = {threshold}"]
    for name, key in keys.items():
        lines += ["[[approvers]]", f'id = "{name}"', f'publicKey = "{public_b64(key)}"']
    path.write_text("\n".join(lines) + "\n")
    return path
