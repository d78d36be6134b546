"""Checking who signed an agent event.

An event's ``signerId`` names a certificate; its public key comes from bc-pki (``certs.get``)
and is cached here for ``cert_cache_seconds`` at most, so the hot path (every ack, progress
and result) is a local Ed25519 check. Revocation is honoured within that bound; sooner, in
practice, because bc-pki publishes ``bc.events.cert.<id>`` when it revokes a certificate and
every instance evicts it on that event.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import signing_payload
from better_compute.service.recent import Recent
from better_compute.wire.agent import FRESHNESS_MS, event_purpose

__all__ = ["Signer", "Signers"]

_UNKNOWN_FOR_S = 5.0
_PKI_DOWN = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INTERNAL})


def _refused(reason: str, message: str) -> BcError:
    return BcError(ErrorCode.UNAUTHENTICATED, message, {"reason": reason})


@dataclass(frozen=True)
class Signer:
    """A certificate that may sign agent events."""

    cert_id: str
    agent_id: str
    site_id: str
    tenant_id: str
    role: str
    not_after: dt.datetime
    public_key: Any = field(repr=False)
    fetched_at: float = 0.0

    def verifies(self, signature: bytes, data: bytes) -> bool:
        try:
            if isinstance(self.public_key, ed25519.Ed25519PublicKey):
                self.public_key.verify(signature, data)
            elif isinstance(self.public_key, ec.EllipticCurvePublicKey):
                self.public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
            else:
                return False
        except Exception:  # InvalidSignature, or a malformed signature
            return False
        return True


class Signers:
    """Certificates by id, fetched from bc-pki and cached for a bounded time."""

    def __init__(self, pki: PkiClient, *, ttl_seconds: float) -> None:
        self.pki = pki
        self.ttl = ttl_seconds
        # the certificates used within about their time, not every one ever seen (each
        # machine's every join makes one)
        self._cache: Recent[str, Signer] = Recent(ttl_seconds, lambda s: s.fetched_at)
        self._loading: dict[str, asyncio.Future[Signer]] = {}
        self._unknown: dict[str, float] = {}

    def evict(self, cert_id: str) -> None:
        self._cache.pop(cert_id)

    async def get(self, cert_id: str) -> Signer:
        """The valid certificate ``cert_id``.

        Raises:
            BcError: ``UNAUTHENTICATED`` (``unknown-signer``, ``cert-revoked``,
                ``cert-expired``); ``UNAVAILABLE`` when bc-pki cannot be asked.
        """
        now = time.monotonic()
        hit = self._cache.get(cert_id)
        if hit is not None and now - hit.fetched_at < self.ttl:
            if hit.not_after <= dt.datetime.now(dt.UTC):
                self.evict(cert_id)
                raise _refused("cert-expired", "the signer's certificate has expired")
            return hit
        unknown_until = self._unknown.get(cert_id)
        if unknown_until is not None:
            if now < unknown_until:
                raise _refused("unknown-signer", "no certificate for this signer")
            del self._unknown[cert_id]
        pending = self._loading.get(cert_id)
        if pending is not None:  # someone asks bc-pki for it already: share the answer
            return await asyncio.shield(pending)
        pending = asyncio.get_running_loop().create_future()
        self._loading[cert_id] = pending
        try:
            signer = await self._load(cert_id)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        except Exception as exc:
            if isinstance(exc, BcError) and exc.reason == "unknown-signer":
                # Events naming made-up certificates would each cost a bc-pki call otherwise.
                if len(self._unknown) > 10_000:
                    self._unknown.clear()
                self._unknown[cert_id] = now + _UNKNOWN_FOR_S
            pending.set_exception(exc)
            pending.exception()  # retrieved, even when nobody else waited
            raise
        else:
            pending.set_result(signer)
            return signer
        finally:
            self._loading.pop(cert_id, None)

    async def _load(self, cert_id: str) -> Signer:
        try:
            info = await self.pki.get_certificate(cert_id=cert_id)
        except BcError as err:
            if err.code in (ErrorCode.NOT_FOUND, ErrorCode.INVALID_INPUT):
                raise _refused("unknown-signer", "no certificate for this signer") from err
            if err.code in _PKI_DOWN:
                raise BcError(ErrorCode.UNAVAILABLE, "cannot check the signer's certificate now") from err
            raise
        if info.state == "revoked":
            raise _refused("cert-revoked", "the signer's certificate is revoked")
        if info.state == "pending":
            # a held token's join whose boot entry has not closed clean: not the node yet (the
            # agent says hello again until it is; nothing is dispatched to it meanwhile)
            raise _refused(
                "cert-pending", "the signer's certificate is held until its boot entry closes clean"
            )
        if info.state != "valid":
            raise _refused("cert-expired", "the signer's certificate has expired")
        cert = x509.load_pem_x509_certificate(info.certificate_pem.encode())
        signer = Signer(
            cert_id=info.cert_id,
            agent_id=info.agent_id,
            site_id=info.site_id,
            tenant_id=info.tenant_id,
            role=info.role,
            not_after=info.not_after,
            public_key=cert.public_key(),
            fetched_at=time.monotonic(),
        )
        if self.ttl > 0:
            self._cache[cert_id] = signer
        return signer

    @property
    def cached(self) -> int:
        """Certificates in the cache now."""
        return len(self._cache)

    async def check_event(
        self,
        *,
        site: str,
        agent: str,
        kind: str,
        doc: dict[str, Any],
        signature: bytes,
        freshness_ms: int = FRESHNESS_MS,
    ) -> Signer:
        """The signer of an event on ``bc.agent.<site>.<agent>.<kind>``, once it checks out:
        the document names that site and agent, the signature is recent and verifies, and the
        certificate belongs to that very agent of that site. ``freshness_ms``: how recently it
        must be signed (a result stored on the site's leaf waits there as long as its link is
        down: ``SiteResults`` allows the stream's age).

        Raises:
            BcError: ``UNAUTHENTICATED`` with a reason, or ``UNAVAILABLE``.
        """
        if doc.get("site") != site or doc.get("agent") != agent:
            raise _refused("subject-mismatch", "the event names another agent than its subject")
        signed_at = doc.get("signedAtMs")
        if isinstance(signed_at, bool) or not isinstance(signed_at, int):
            raise _refused("stale-signature", "the event carries no signing time")
        if abs(time.time_ns() // 1_000_000 - signed_at) > freshness_ms:
            raise _refused("stale-signature", "the event was not signed recently")
        cert_id = doc.get("signerId")
        if not isinstance(cert_id, str) or not cert_id.startswith("cert_"):
            raise _refused("unknown-signer", "the event names no certificate")
        signer = await self.get(cert_id)
        if signer.agent_id != agent or signer.site_id != site:
            raise _refused("wrong-signer", "the certificate belongs to another agent or site")
        if not signer.verifies(signature, signing_payload(event_purpose(kind), doc)):
            raise _refused("bad-signature", "the event's signature does not verify")
        return signer
