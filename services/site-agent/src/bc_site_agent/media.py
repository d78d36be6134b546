"""The ramdisk's token on a virtual medium: built in memory, served once, to the BMC alone.

For a node whose BMC has Redfish virtual media (``NodeBmc.tokenDelivery`` ``media``),
``metal.ensureRamdisk`` sends ``media.insert`` with ``joinTokenRef`` instead of a token on the
boot entry. The site agent fetches the token through the secrets gate, builds a small ISO 9660
image labelled ``BCBOOT`` (``token``, and the bus CA when it has one: ``bus-ca.pem``), keeps it
in memory only, and hands the BMC ``<public_url>/media/<capability>`` (128 random bits) over the
authenticated Redfish session. The boot network never carries the token.

``MediaImages`` serves an image once, to the BMC's addresses (the driver's host, resolved when
the image is put); a HEAD from the BMC before that fetch does not count (a BMC may check the
size first). The image is dropped after that fetch, or when the command's deadline passes
unfetched. Its capability stays known for ``REMEMBER_S`` more: any later ask for it, and any
ask from another address, is a *burn* (the URL leaked): nothing is served and the agent
reports the token to bc-pki (``tokens.burn``, reason ``boot-medium-fetched-twice``), which
revokes it and what it issued; the engine quarantines the node.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime.iso import iso_image
from better_compute.wire.metal import BOOT_MEDIUM_LABEL

__all__ = ["LABEL", "REMEMBER_S", "MediaImages", "Taken", "bmc_addresses", "token_image"]

LABEL: Final = BOOT_MEDIUM_LABEL
REMEMBER_S: Final = 3600.0
"""How long a capability is remembered after its image went: an ask for it then is a burn."""


def token_image(token: str, *, bus_ca: bytes | None = None) -> bytes:
    """The ISO 9660 image (Rock Ridge and Joliet names) labelled ``BCBOOT``: ``token`` and,
    when given, ``bus-ca.pem``. Built in memory; nothing is written to disk."""
    files = [("/TOKEN.;1", "token", token.encode() + b"\n")]
    if bus_ca:
        files.append(("/BUSCA.PEM;1", "bus-ca.pem", bus_ca))
    return iso_image(LABEL, files)


def bmc_addresses(address: str) -> frozenset[str]:
    """The IP addresses of the BMC that ``address`` (a driver URL, or a host) names, resolved
    once: only these may fetch the image."""
    host = urlsplit(address if "://" in address else f"//{address}").hostname or ""
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        raise BcError(
            ErrorCode.UNAVAILABLE, f"cannot resolve the BMC's address {host}", {"path": "bmc.address"}
        ) from exc
    return frozenset(found)


@dataclass
class _Image:
    body: bytes | None = field(repr=False)
    allowed: frozenset[str]
    not_after: float
    token_sha256: str
    node_id: str
    mac: str
    fetched: bool = False
    burned: bool = False


@dataclass(frozen=True)
class Taken:
    """What an ask for ``/media/<capability>`` gets: the image, or a burn report (``burn``, the
    mark ``Reports.burn`` takes), or neither (an unknown or forgotten capability)."""

    body: bytes | None
    burn: dict[str, Any] | None


class MediaImages:
    """Token images by capability, in memory."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._by_cap: dict[str, _Image] = {}

    def put(
        self, body: bytes, *, allowed: frozenset[str], not_after: float, token: str, node_id: str, mac: str
    ) -> str:
        """Keep ``body`` for the addresses ``allowed`` until ``not_after``; its capability."""
        cap = secrets.token_hex(16)  # 128 bits
        digest = hashlib.sha256(token.encode()).hexdigest()
        with self._lock:
            self._forget()
            self._by_cap[cap] = _Image(
                body=body, allowed=allowed, not_after=not_after, token_sha256=digest, node_id=node_id, mac=mac
            )
        return cap

    def take(self, cap: str, *, source: str) -> Taken:
        """The ask for ``cap`` from ``source`` (see the module)."""
        with self._lock:
            self._forget()
            image = self._by_cap.get(cap)
            if image is None:
                return Taken(body=None, burn=None)
            if not image.fetched and image.body is not None and source in image.allowed:
                body, image.body, image.fetched = image.body, None, True
                return Taken(body=body, burn=None)
            image.body = None  # leaked: nobody gets it now, the BMC neither
            first = not image.burned
            image.burned = True
            mark = {
                "tokenSha256": image.token_sha256,
                "mac": image.mac,
                "reason": "boot-medium-fetched-twice",
            }
            return Taken(body=None, burn=mark if first else None)

    def peek(self, cap: str, *, source: str) -> bytes | None:
        """The image, without taking it, for a HEAD from its BMC before the fetch (a BMC may
        check the size first); None otherwise (the caller then treats the ask as a GET)."""
        with self._lock:
            self._forget()
            image = self._by_cap.get(cap)
            if image is None or image.fetched or image.body is None or source not in image.allowed:
                return None
            return image.body

    def drop(self, cap: str) -> None:
        """The insert failed: its image goes, its capability stays known (a late ask burns)."""
        with self._lock:
            image = self._by_cap.get(cap)
            if image is not None:
                image.body = None

    def _forget(self) -> None:
        now = self.clock()
        for cap, image in list(self._by_cap.items()):
            if now > image.not_after:
                image.body = None
            if now > image.not_after + REMEMBER_S:
                del self._by_cap[cap]

    def count(self) -> int:
        """Images still waiting for their BMC (for tests; ``/healthz`` does not tell)."""
        with self._lock:
            self._forget()
            return sum(1 for i in self._by_cap.values() if i.body is not None)
