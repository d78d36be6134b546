"""Key-encryption keys from a key file, and AES-256-GCM blobs sealed under them.

A key file holds one key per line, ``bck1:<key id>:<base64url key>``; ``#`` starts a comment.
The first key seals new blobs; every key in the file opens blobs. Rotation is therefore:
put a new key on top (``python -m bc_pki.keyring rotate PATH``), restart, re-seal the stored
blobs (``keys.rewrap``), and only then drop the old line.

A blob names the key that sealed it, so opening never guesses:
``0x01 | len(key id) | key id | 12-byte nonce | ciphertext+tag``. Callers pass associated
data (the row the blob belongs to), so a blob copied into another row does not open.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.files import atomic_write

__all__ = ["Keyring", "generate_key_line", "key_file_path", "load_service_keyring", "rotate_key_file"]

_VERSION = 1
_PREFIX = "bck1"
_HEADER = (
    "# Better Compute key file. The first key seals new data; every key opens old data.\n"
    "# Keep it 0600 and back it up: without it the encrypted rows cannot be read.\n"
)


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"bc-keyring-id\x00" + key).hexdigest()[:12]


def generate_key_line() -> str:
    """A fresh ``bck1:<id>:<key>`` line (256-bit key)."""
    key = secrets.token_bytes(32)
    return f"{_PREFIX}:{_key_id(key)}:{base64.urlsafe_b64encode(key).decode().rstrip('=')}"


def key_file_path(settings: Settings, explicit: str | None, name: str) -> Path:
    """``explicit`` (a service's ``key_file`` setting) when set, else ``<state_dir>/keys/<name>.key``."""
    if explicit:
        return Path(explicit)
    return Path(settings.state_dir) / "keys" / f"{name}.key"


def load_service_keyring(settings: Settings, explicit: str | None, name: str, log: Any) -> Keyring:
    """A service's keyring at ``key_file_path``, created on its first start; logs
    ``key_file_created`` then, and warns ``key_file_readable_by_others`` when the file's
    permissions are loose."""
    path = key_file_path(settings, explicit, name)
    ring, created = Keyring.load_or_create(path)
    if created:
        log.info("key_file_created", path=str(path), key_id=ring.current_key_id)
    if ring.loose_permissions():
        log.warning("key_file_readable_by_others", path=str(path))
    return ring


def _write_new(path: Path, text: str) -> bool:
    """Create ``path`` (0600) with ``text`` unless it exists; True when this call created it.

    Written to a private temporary file then hard-linked into place, so two instances
    starting together end up with one file and never read a half-written one.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        atomic_write(path, text, exclusive=True)
    except FileExistsError:
        return False
    return True


def rotate_key_file(path: Path) -> str:
    """Put a new key on top of the key file (creating it if absent); returns the new key id."""
    line = generate_key_line()
    old = path.read_text() if path.exists() else ""
    body = "".join(ln + "\n" for ln in old.splitlines() if ln.strip() and not ln.startswith("#"))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, _HEADER + line + "\n" + body)
    return line.split(":")[1]


class Keyring:
    """The keys of one key file; seals with the first, opens with any."""

    def __init__(self, keys: Sequence[tuple[str, bytes]], *, source: str = "") -> None:
        if not keys:
            raise BcError(ErrorCode.INVALID_CONFIG, "the key file holds no key", {"path": source})
        self._keys = dict(keys)
        self._current = keys[0][0]
        self.source = source

    @classmethod
    def load_or_create(cls, path: Path) -> tuple[Keyring, bool]:
        """Load ``path``, creating it with one new key when it does not exist.

        Returns the keyring and whether this call created the file.
        """
        created = False if path.exists() else _write_new(path, _HEADER + generate_key_line() + "\n")
        return cls.load(path), created

    @classmethod
    def load(cls, path: Path) -> Keyring:
        try:
            text = path.read_text()
        except OSError as exc:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"cannot read key file: {exc.strerror}",
                {"path": str(path)},
            ) from exc
        keys: list[tuple[str, bytes]] = []
        for n, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(":")
            try:
                if len(parts) != 3 or parts[0] != _PREFIX:
                    raise ValueError
                key = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4))
                if len(key) != 32 or _key_id(key) != parts[1]:
                    raise ValueError
            except ValueError:
                # never echo the line: it holds key material
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"key file line {n} is not a bck1 key",
                    {"path": str(path), "line": n},
                ) from None
            keys.append((parts[1], key))
        return cls(keys, source=str(path))

    @property
    def current_key_id(self) -> str:
        return self._current

    @property
    def key_ids(self) -> list[str]:
        return list(self._keys)

    def mac(self, data: bytes) -> str:
        """``<key id>:<base64url HMAC-SHA256>`` of ``data`` under the current key: a proof of
        holding the key file (``check_mac`` with any key of it)."""
        tag = hmac.new(self._keys[self._current], data, hashlib.sha256).digest()
        return f"{self._current}:{base64.urlsafe_b64encode(tag).decode().rstrip('=')}"

    def check_mac(self, data: bytes, mac: str) -> bool:
        """Whether ``mac`` (from ``mac``) was made over ``data`` with a key of this file."""
        kid, _, _tag = mac.partition(":")
        key = self._keys.get(kid)
        if key is None:
            return False
        expected = hmac.new(key, data, hashlib.sha256).digest()
        return hmac.compare_digest(f"{kid}:{base64.urlsafe_b64encode(expected).decode().rstrip('=')}", mac)

    def loose_permissions(self) -> bool:
        """Whether group or others may read the key file."""
        try:
            mode = os.stat(self.source).st_mode
        except OSError:
            return False
        return bool(mode & (stat.S_IRWXG | stat.S_IRWXO))

    def seal(self, plaintext: bytes, *, aad: bytes) -> bytes:
        """Encrypt under the current key; ``aad`` must be given again to open."""
        kid = self._current.encode()
        nonce = secrets.token_bytes(12)
        ct = AESGCM(self._keys[self._current]).encrypt(nonce, plaintext, aad)
        return bytes([_VERSION, len(kid)]) + kid + nonce + ct

    @staticmethod
    def key_id_of(blob: bytes) -> str:
        """The id of the key that sealed ``blob``."""
        if len(blob) < 2 or blob[0] != _VERSION:
            raise BcError(ErrorCode.INTERNAL, "stored blob has an unknown format")
        return blob[2 : 2 + blob[1]].decode("ascii", "replace")

    def open(self, blob: bytes, *, aad: bytes) -> bytes:
        """Decrypt ``blob``: ``INVALID_CONFIG`` when its key is not in the file,
        ``INTERNAL`` when it does not authenticate (tampered, or moved to another row)."""
        kid = self.key_id_of(blob)
        key = self._keys.get(kid)
        if key is None:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"data sealed with key {kid}, which the key file does not hold",
                {"path": self.source, "keyId": kid},
            )
        body = blob[2 + blob[1] :]
        try:
            return AESGCM(key).decrypt(body[:12], body[12:], aad)
        except InvalidTag:
            raise BcError(ErrorCode.INTERNAL, "stored blob does not authenticate", {"keyId": kid}) from None

    def reseal(self, blob: bytes, *, aad: bytes) -> bytes | None:
        """``blob`` sealed under the current key, or None when it already is."""
        if self.key_id_of(blob) == self._current:
            return None
        return self.seal(self.open(blob, aad=aad), aad=aad)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("rotate", "create"):
        print("usage: python -m better_compute.keyring {create|rotate} KEY_FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "create":
        _ring, created = Keyring.load_or_create(path)
        print("created" if created else "exists", path)
        return 0
    print(f"new key {rotate_key_file(path)} on top of {path}; restart, then rewrap")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
