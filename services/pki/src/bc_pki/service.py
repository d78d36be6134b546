"""The bc-pki service process: start-up, the CA and its keys, routes and side loops.

The routes are split by concern, each part a plain class given what it needs:

* ``join_tokens``: issue, list, get and revoke join tokens, and fence a step attempt's mints;
* ``joins``: a machine joins with a token and gets a certificate; every try is audited;
* ``signatures``: signature checks for the other services (``once``: fresh and never replayed);
* ``certificates``: get, list and revoke the certificates joins issued;
* ``store``: every SQL statement.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import secrets
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.keyring import Keyring, load_service_keyring
from better_compute.service import ApiRequest, Handler, Service
from better_compute.wire.pki import CaInfo, RewrapResult

from . import store
from .burns import Burns
from .ca import CertificateAuthority
from .certificates import Certificates
from .join_tokens import JoinTokens
from .joins import Joins
from .signatures import Signatures

__all__ = ["PkiService"]

_CA_KEY_AAD = b"bc-pki:ca:key"
_TOKEN_KEY_AAD = b"bc-pki:ca:token-key"


class Parts(NamedTuple):
    """The service's parts, made at start (they need the database and the CA)."""

    tokens: JoinTokens
    joins: Joins
    signatures: Signatures
    certificates: Certificates
    burns: Burns


class PkiService(Service):
    """PKI: certificate authority, join tokens, joins, signature verification"""

    name: ClassVar[str] = "bc-pki"
    api_name: ClassVar[str] = "pki"
    schema: ClassVar[str | None] = "pki"
    migrations_package: ClassVar[str | None] = "bc_pki.migrations"
    description: ClassVar[str] = "PKI: certificate authority, join tokens, joins, signature verification"
    audit_routes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "tokens.issue": ("tenantId", "role", "siteId", "ttlSeconds", "maxUses", "note"),
        "tokens.revoke": ("joinTokenId", "reason"),
        "tokens.burn": ("mac", "reason", "signerId"),
        "tokens.confirm": ("mac", "signerId"),
        "certs.revoke": ("certId", "reason"),
        "keys.rewrap": (),
    }

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.keyring: Keyring | None = None
        self.ca: CertificateAuthority | None = None
        self.ca_created_at: dt.datetime | None = None
        self._token_key = b""
        self._parts: Parts | None = None
        self.cert_lifetime = dt.timedelta(milliseconds=settings.pki.cert_ttl.ms)

    # -- start ------------------------------------------------------------------

    async def on_start(self) -> None:
        self.keyring = load_service_keyring(self.settings, self.settings.pki.key_file, "pki", self.log)
        await self._load_ca()
        assert self.db is not None
        assert self.ca is not None
        db, log = self.db, self.log
        signatures = Signatures(db=db, log=log)
        self._parts = Parts(
            tokens=JoinTokens(db=db, log=log, token_key=self._token_key),
            joins=Joins(
                db=db,
                log=log,
                ca=self.ca,
                cert_lifetime=self.cert_lifetime,
                instance=self.instance,
                publish_event=self.publish_event,
            ),
            signatures=signatures,
            certificates=Certificates(db=db, log=log, publish_event=self.publish_event),
            burns=Burns(db=db, log=log, signatures=signatures, publish_event=self.publish_event),
        )

    async def _load_ca(self) -> None:
        assert self.db is not None
        assert self.keyring is not None
        async with self.db.transaction() as conn:
            # Instances starting together: the first creates the CA, the others wait and load it.
            await conn.execute(store.CA_LOCK)
            row = await conn.fetchrow(store.CA_SELECT)
            if row is None:
                ca = CertificateAuthority.create(name=f"Better Compute CA {secrets.token_hex(4)}")
                await conn.execute(
                    store.CA_INSERT,
                    ca.certificate_pem,
                    ca.fingerprint,
                    self.keyring.seal(ca.key_pem(), aad=_CA_KEY_AAD),
                    self.keyring.seal(secrets.token_bytes(32), aad=_TOKEN_KEY_AAD),
                )
                self.log.info("ca_created", fingerprint=ca.fingerprint)
                row = await conn.fetchrow(store.CA_SELECT)
        self.ca = CertificateAuthority.load(
            row["certificate_pem"], self.keyring.open(row["key_sealed"], aad=_CA_KEY_AAD)
        )
        self._token_key = self.keyring.open(row["token_key_sealed"], aad=_TOKEN_KEY_AAD)
        self.ca_created_at = row["created_at"]
        self.log.info("ca_loaded", fingerprint=self.ca.fingerprint)

    def audit_target(self, route: str, body: Any, result: Any) -> str | None:
        # a certificate's reply names the join token it came from before the certificate itself
        if route == "certs.revoke" and isinstance(result, dict):
            cert_id, serial, agent_id = result.get("certId"), result.get("serial"), result.get("agentId")
            if isinstance(cert_id, str) and isinstance(serial, str) and isinstance(agent_id, str):
                return f"{cert_id} serial {serial} CN={agent_id}"[:200]
        return super().audit_target(route, body, result)

    @property
    def parts(self) -> Parts:
        assert self._parts is not None, "the service has not started"
        return self._parts

    def routes(self) -> Mapping[str, Handler]:
        tokens, joins, certs = self.parts.tokens, self.parts.joins, self.parts.certificates
        return {
            "tokens.issue": tokens.issue_token,
            "tokens.list": tokens.list_tokens,
            "tokens.get": tokens.get_token,
            "tokens.revoke": tokens.revoke_token,
            "tokens.revoke_attempt": tokens.revoke_attempt,
            "tokens.burn": self.parts.burns.burn,
            "tokens.confirm": self.parts.burns.confirm,
            "agents.join": joins.join,
            "joins.list": joins.list_joins,
            "signatures.verify": self.parts.signatures.verify,
            "certs.get": certs.get_cert,
            "certs.list": certs.list_certs,
            "certs.revoke": certs.revoke_cert,
            "ca.get": self.get_ca,
            "keys.rewrap": self.rewrap,
        }

    def side_loops(self) -> Mapping[str, Any]:
        return {"purge_seen_signatures": self._purge_seen}

    async def _purge_seen(self) -> None:
        assert self.db is not None
        while True:
            await self.db.execute(store.SEEN_PURGE)
            await asyncio.sleep(60.0)

    @property
    def _ca(self) -> CertificateAuthority:
        if self.ca is None:
            raise BcError(ErrorCode.UNAVAILABLE, "the CA is not loaded yet")
        return self.ca

    # -- CA and keys --------------------------------------------------------------

    async def get_ca(self, _req: ApiRequest) -> CaInfo:
        ca = self._ca
        assert self.ca_created_at is not None
        return CaInfo(
            certificate_pem=ca.certificate_pem,
            fingerprint_sha256=ca.fingerprint,
            created_at=self.ca_created_at,
        )

    async def rewrap(self, _req: ApiRequest) -> RewrapResult:
        """Re-seal the CA key and the token key under the key file's current key."""
        assert self.db is not None
        assert self.keyring is not None
        ring = self.keyring
        async with self.db.transaction() as conn:
            await conn.execute(store.CA_LOCK)
            row = await conn.fetchrow(store.CA_SELECT)
            key = ring.reseal(row["key_sealed"], aad=_CA_KEY_AAD)
            token_key = ring.reseal(row["token_key_sealed"], aad=_TOKEN_KEY_AAD)
            count = (key is not None) + (token_key is not None)
            if count:
                await conn.execute(
                    store.CA_UPDATE_SEALED,
                    key or row["key_sealed"],
                    token_key or row["token_key_sealed"],
                )
        self.log.info("keys_rewrapped", key_id=ring.current_key_id, rewrapped=count)
        return RewrapResult(key_id=ring.current_key_id, rewrapped=count)
