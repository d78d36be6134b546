"""What bcd needs to reach a site's TLS-only leaf node, delivered by the boot path (issue 23).

The boot entry's kernel line names where the site agent serves the bus files
(``bcd.bus=http://<site agent>/bus``) and the bus CA's SHA-256 (``bcd.bus_ca_sha256=<hex>``).
bcd fetches ``ca.pem`` and trusts it only when its digest is the one the kernel line names: a
site agent or network in between cannot make bcd trust another NATS server. It also fetches
``join.pem``, the site's joining certificate and key, which lets a machine without a
certificate ask bc-pki to join and nothing else (docs/security.md, "The bus"). Both are kept in
bcd's state folder for the joins and runs that follow.

``BC_NATS_CA``, ``BC_NATS_JOIN_CERT`` and ``BC_NATS_JOIN_KEY`` in the environment win over them.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.files import atomic_write

__all__ = ["BUS_CA_FILE", "JOIN_FILE", "fetch_bus_files"]

BUS_CA_FILE: Final = "bus-ca.pem"
JOIN_FILE: Final = "join.pem"  # the joining certificate and its key, one PEM file (0600)
MAX_BYTES: Final = 64 * 1024
_HEX64: Final = re.compile(r"^[0-9a-f]{64}$")


def _get(url: str, what: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            data: bytes = resp.read(MAX_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BcError(
            ErrorCode.UNAVAILABLE, f"cannot fetch {what} from {url}: {exc}", {"path": "bcd.bus", "url": url}
        ) from exc
    if len(data) > MAX_BYTES:
        raise BcError(ErrorCode.INVALID_INPUT, f"{what} from {url} is too large", {"path": "bcd.bus"})
    return data


def fetch_bus_files(cmdline: dict[str, str], folder: Path) -> bool:
    """Fetch the bus CA (checked against ``bcd.bus_ca_sha256``) and the joining certificate
    from ``bcd.bus`` into ``folder``; False when the kernel line names no bus.

    Raises:
        BcError: ``INVALID_CONFIG`` at ``bcd.bus_ca_sha256`` when the CA's digest differs (nothing
            is stored) or the kernel line names a bus without a digest; ``UNAVAILABLE`` when
            the site agent does not answer.
    """
    base = cmdline.get("bus", "").rstrip("/")
    if not base:
        return False
    expected = cmdline.get("bus_ca_sha256", "").lower()
    if not _HEX64.match(expected):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "the kernel line names a bus (bcd.bus=) without the SHA-256 of its CA: nothing to check it by",
            {"path": "bcd.bus_ca_sha256"},
        )
    if not base.startswith(("http://", "https://")):
        raise BcError(ErrorCode.INVALID_CONFIG, "bcd.bus= is an http(s) URL", {"path": "bcd.bus"})
    ca = _get(f"{base}/ca.pem", "the bus CA")
    got = hashlib.sha256(ca).hexdigest()
    if got != expected:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"the bus CA from {base}/ca.pem has SHA-256 {got}, not the {expected} the kernel line names:"
            " refused (a wrong site agent, or someone in between)",
            {"path": "bcd.bus_ca_sha256", "url": f"{base}/ca.pem"},
        )
    join = _get(f"{base}/join.pem", "the joining certificate")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(folder / BUS_CA_FILE, ca)
    atomic_write(folder / JOIN_FILE, join)  # private: its key is in it
    return True


def bus_ca(folder: Path) -> str | None:
    """The bus CA to check NATS with: ``BC_NATS_CA``, else the one the boot path delivered."""
    env = os.environ.get("BC_NATS_CA")
    if env:
        return env
    saved = folder / BUS_CA_FILE
    return str(saved) if saved.exists() else None


def joining_files(folder: Path) -> tuple[str | None, str | None]:
    """The joining certificate and key: ``BC_NATS_JOIN_CERT``/``_KEY``, else the boot path's."""
    cert, key = os.environ.get("BC_NATS_JOIN_CERT"), os.environ.get("BC_NATS_JOIN_KEY")
    if cert or key:
        return cert, key
    saved = folder / JOIN_FILE
    return (str(saved), str(saved)) if saved.exists() else (None, None)
