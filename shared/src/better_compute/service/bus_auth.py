"""Per-agent NATS identities from the project's PKI: nats-server's auth callout (issue 23 item 1).

A NATS server configured with ``authorization { auth_callout { issuer, auth_users, account } }``
and TLS ``verify`` sends every other connection to ``$SYS.REQ.USER.AUTH``, with the client's
verified certificate chain. ``CalloutResponder`` answers: the chain's leaf must be an agent
certificate of bc-pki's CA (``urn:bc:agent:`` and ``urn:bc:site:`` names) for this server's site,
in date, and not revoked; the connection then becomes a user of its own, with
``agent_permissions`` only: its own events, its own consumer, its own inbox. Anything else gets a
refusal, which nats-server turns into an authorization violation.

This is the building block of docs/security.md's design ("The bus"); the deployment does not use
it yet (the agents do not present their certificates to NATS yet).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nkeys
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from ..core.errors import BcError, ErrorCode
from ..wire.subjects import Subjects

__all__ = ["AUTH_SUBJECT", "AgentCertificate", "CalloutResponder", "agent_certificate", "agent_permissions"]

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
USER_TTL_S = 3600  # a connection re-authenticates at least this often (a revocation's upper bound)


@dataclass(frozen=True)
class AgentCertificate:
    """What an agent certificate of bc-pki says about its holder."""

    agent_id: str
    site_id: str
    serial: str  # hex, as bc-pki lists it
    not_after: float  # epoch seconds


def agent_certificate(pem: str, ca_pem: bytes, *, now: float | None = None) -> AgentCertificate:
    """The agent named by ``pem``, once it is shown to be an agent certificate issued by the CA of
    ``ca_pem`` and in date; ``UNAUTHENTICATED`` otherwise."""

    def no(why: str) -> BcError:
        return BcError(ErrorCode.UNAUTHENTICATED, f"not an agent certificate of this CA: {why}")

    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise no(type(exc).__name__) from None
    moment = dt.datetime.fromtimestamp(now if now is not None else time.time(), dt.UTC)
    if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
        raise no("out of date")
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise no("no agent names") from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise no("not for clients")
    uris = names.get_values_for_type(x509.UniformResourceIdentifier)
    agents = [u.removeprefix("urn:bc:agent:") for u in uris if u.startswith("urn:bc:agent:")]
    sites = [u.removeprefix("urn:bc:site:") for u in uris if u.startswith("urn:bc:site:")]
    if len(agents) != 1 or len(sites) != 1:
        raise no("no agent names")
    return AgentCertificate(
        agent_id=agents[0],
        site_id=sites[0],
        serial=format(cert.serial_number, "x"),
        not_after=cert.not_valid_after_utc.timestamp(),
    )


def agent_permissions(
    subjects: Subjects, site_id: str, agent_id: str, *, js_api: str = "$JS.API"
) -> dict[str, Any]:
    """An agent's NATS permissions (nats-server's user claims): its own events, join and fetch,
    pulling and acking on its own consumer of its site's stream, and its own inbox. ``js_api`` is
    the JetStream API prefix as the server checks it: ``$JS.hub.API`` on a site's leaf node, whose
    account maps the agents' ``$JS.API`` calls to the hub's domain (deploy/nats/leaf-site.conf)."""
    stream = subjects.site_stream(site_id)
    return {
        "pub": {
            "allow": [
                f"{subjects.root}.agent.{site_id}.{agent_id}.>",
                subjects.api("pki", "agents", "join"),
                subjects.api("secrets", "secrets", "fetch"),
                f"{js_api}.CONSUMER.MSG.NEXT.{stream}.{agent_id}",
                f"{js_api}.CONSUMER.INFO.{stream}.{agent_id}",
                f"$JS.ACK.{stream}.{agent_id}.>",
            ]
        },
        "sub": {"allow": [f"_INBOX.{agent_id}.>"]},
    }


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _claims(token: str) -> dict[str, Any]:
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        raise BcError(ErrorCode.INVALID_INPUT, "not an authorization request", {"path": ""}) from None
    if not isinstance(claims, dict):
        raise BcError(ErrorCode.INVALID_INPUT, "not an authorization request", {"path": ""})
    return claims


def _sign(claims: dict[str, Any], key: Any) -> str:
    """A NATS JWT (``ed25519-nkey``) of ``claims``, signed by the nkey ``key``."""
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = {**claims, "iat": int(time.time()), "jti": ""}
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest())
    body["jti"] = body["jti"].decode().rstrip("=")
    payload = _b64(json.dumps(body).encode())
    return f"{header}.{payload}.{_b64(key.sign(f'{header}.{payload}'.encode()))}"


Revoked = Callable[[AgentCertificate], Awaitable[bool]]


class CalloutResponder:
    """Answers one NATS server's auth callout for the agents of ``site_id``.

    ``issuer_seed`` is the seed of the account nkey the server's ``auth_callout.issuer`` names;
    ``account`` the account the agents land in; ``revoked`` asks whether bc-pki revoked a
    certificate (a deployment asks bc-pki, with a short cache).
    """

    def __init__(
        self,
        *,
        ca_pem: bytes,
        issuer_seed: bytes,
        site_id: str,
        account: str,
        revoked: Revoked,
        subjects: Subjects | None = None,
        js_api: str = "$JS.API",
    ) -> None:
        self.ca_pem = ca_pem
        self.key = nkeys.from_seed(issuer_seed)
        self.issuer = self.key.public_key.decode()
        self.site_id = site_id
        self.account = account
        self.revoked = revoked
        self.subjects = subjects or Subjects()
        self.js_api = js_api

    async def start(self, nc: Nats) -> None:
        """Answer on ``nc``, a connection of the server's ``auth_users`` in its callout account."""
        await nc.subscribe(AUTH_SUBJECT, cb=self._on_request)
        await nc.flush()

    async def _on_request(self, msg: Msg) -> None:
        await msg.respond(await self.answer(msg.data.decode()))

    async def answer(self, request: str) -> bytes:
        """The signed authorization response to the server's request (a JWT)."""
        claims = _claims(request).get("nats", {})
        user_nkey = str(claims.get("user_nkey", ""))
        server = str((claims.get("server_id") or {}).get("id", ""))
        response: dict[str, Any] = {"type": "authorization_response", "version": 2}
        try:
            agent = await self._agent(claims)
        except BcError as err:
            response["error"] = err.message
        else:
            user = {
                "iss": self.issuer,
                "sub": user_nkey,
                "aud": self.account,
                "name": agent.agent_id,
                "exp": int(min(agent.not_after, time.time() + USER_TTL_S)),
                "nats": {
                    **agent_permissions(self.subjects, agent.site_id, agent.agent_id, js_api=self.js_api),
                    "type": "user",
                    "version": 2,
                },
            }
            response["jwt"] = _sign(user, self.key)
        return _sign(
            {"iss": self.issuer, "sub": user_nkey, "aud": server, "nats": response}, self.key
        ).encode()

    async def _agent(self, claims: dict[str, Any]) -> AgentCertificate:
        chains = (claims.get("client_tls") or {}).get("verified_chains") or []
        if not chains or not chains[0]:
            raise BcError(ErrorCode.UNAUTHENTICATED, "no client certificate")
        agent = agent_certificate(chains[0][0], self.ca_pem)
        if agent.site_id != self.site_id:
            raise BcError(ErrorCode.UNAUTHENTICATED, f"an agent of site {agent.site_id}, not {self.site_id}")
        if await self.revoked(agent):
            raise BcError(ErrorCode.UNAUTHENTICATED, "the certificate is revoked")
        return agent
