"""Per-agent NATS identities from the project's PKI: nats-server's auth callout (issue 23 item 1).

A NATS server configured with ``authorization { auth_callout { issuer, auth_users, account } }``
and TLS ``verify`` sends every other connection to ``$SYS.REQ.USER.AUTH``, with the client's
verified certificate chain. ``CalloutResponder`` answers: the chain's leaf must be an agent
certificate of bc-pki's CA (``urn:bc:agent:`` and ``urn:bc:site:`` names) for this server's site,
in date, and not revoked; the connection then becomes a user of its own, with
``agent_permissions`` only: its own events, its own consumer, its own inbox. Anything else gets a
refusal, which nats-server turns into an authorization violation.

A machine that has no certificate yet joins as the site's ``joining`` identity: a client
certificate of the bus CA naming ``urn:bc:join:<site>`` (``bcx bus callout`` makes it), which may
publish ``agents.join`` and read only the inbox its connection names (``join_inbox_prefix``).

``bc-pki callout`` (``bc_pki.callout``) runs this against a site's leaf node with bc-pki's
revocation behind ``revoked``, and cuts a revoked agent's connections (docs/security.md, "The bus").
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
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from ..core.errors import BcError, ErrorCode
from ..wire.subjects import Subjects, join_inbox_prefix, join_nonce

__all__ = [
    "AUTH_SUBJECT",
    "JOINING",
    "Admitted",
    "AgentCertificate",
    "CalloutResponder",
    "agent_certificate",
    "agent_permissions",
    "cert_id_of_user",
    "joining_certificate",
    "joining_permissions",
    "user_name",
]

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
USER_TTL_S = 3600  # a connection re-authenticates at least this often (a revocation's upper bound)
JOINING = "joining"
"""The name of a connection made with a site's joining certificate (no agent yet)."""


@dataclass(frozen=True)
class AgentCertificate:
    """What an agent certificate of bc-pki says about its holder."""

    agent_id: str
    site_id: str
    serial: str  # hex, as bc-pki lists it
    not_after: float  # epoch seconds
    cert_id: str | None = None
    """bc-pki's id of the certificate (``urn:bc:cert:``); certificates issued before it was
    written there have none, and are looked up by agent and serial."""
    role: str = ""
    """The join token's role (the subject's OU): ``site`` for a site agent."""


def _client_certificate(
    pem: str, ca_pem: bytes, now: float | None, what: str
) -> tuple[x509.Certificate, list[str]]:
    """``pem`` once shown to be a client certificate issued by the CA of ``ca_pem`` and in date,
    with its URIs; ``UNAUTHENTICATED`` otherwise."""

    def no(why: str) -> BcError:
        return BcError(ErrorCode.UNAUTHENTICATED, f"not {what} of this CA: {why}")

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
        raise no("no names") from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise no("not for clients")
    return cert, list(names.get_values_for_type(x509.UniformResourceIdentifier))


def _urns(uris: list[str], kind: str) -> list[str]:
    return [u.removeprefix(f"urn:bc:{kind}:") for u in uris if u.startswith(f"urn:bc:{kind}:")]


def agent_certificate(pem: str, ca_pem: bytes, *, now: float | None = None) -> AgentCertificate:
    """The agent named by ``pem``, once it is shown to be an agent certificate issued by the CA of
    ``ca_pem`` and in date; ``UNAUTHENTICATED`` otherwise."""
    cert, uris = _client_certificate(pem, ca_pem, now, "an agent certificate")
    agents, sites, certs = _urns(uris, "agent"), _urns(uris, "site"), _urns(uris, "cert")
    if len(agents) != 1 or len(sites) != 1 or len(certs) > 1:
        raise BcError(ErrorCode.UNAUTHENTICATED, "not an agent certificate of this CA: no agent names")
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return AgentCertificate(
        agent_id=agents[0],
        site_id=sites[0],
        serial=format(cert.serial_number, "x"),
        not_after=cert.not_valid_after_utc.timestamp(),
        cert_id=certs[0] if certs else None,
        role=str(roles[0].value) if roles else "",
    )


def joining_certificate(pem: str, bus_ca_pem: bytes, *, now: float | None = None) -> str:
    """The site whose joining certificate ``pem`` is (``urn:bc:join:<site>``, issued by the bus CA
    of ``bus_ca_pem``, in date); ``UNAUTHENTICATED`` otherwise."""
    _cert, uris = _client_certificate(pem, bus_ca_pem, now, "a joining certificate")
    sites = _urns(uris, "join")
    if len(sites) != 1:
        raise BcError(ErrorCode.UNAUTHENTICATED, "not a joining certificate of this CA: no site")
    return sites[0]


def user_name(agent: AgentCertificate) -> str:
    """The name of an agent's NATS user: ``<agent id>/<cert id>`` (the agent id alone for a
    certificate without one). nats-server shows it as the connection's ``authorized_user`` in
    connz, which is how the responder's sweep finds the certificate to ask bc-pki about."""
    return f"{agent.agent_id}/{agent.cert_id}" if agent.cert_id else agent.agent_id


def cert_id_of_user(name: str) -> str | None:
    """The certificate id in a user name of ``user_name``; None for any other name."""
    _agent, sep, cert_id = name.partition("/")
    return cert_id if sep and cert_id else None


def agent_permissions(
    subjects: Subjects, site_id: str, agent_id: str, *, js_api: str = "$JS.API", role: str = ""
) -> dict[str, Any]:
    """An agent's NATS permissions (nats-server's user claims): its own events, join and fetch,
    pulling and acking on its own consumer of its site's stream, storing its results in its
    site's results stream, and its own inbox. ``js_api`` is the JetStream API prefix as the
    server checks it: ``$JS.API`` on a site's leaf node that holds the site's streams in its own
    JetStream (deploy/nats/leaf-site.conf, ``cmdq.site_domain``); ``$JS.hub.API`` on a leaf that
    maps the agents' calls to the hub's domain, where the streams are then.
    A site agent (``role`` ``site``) may also report a boot entry asked for twice (``tokens.burn``)
    or closed clean (``tokens.confirm``)."""
    stream = subjects.site_stream(site_id)
    allow = [
        f"{subjects.root}.agent.{site_id}.{agent_id}.>",
        subjects.api("pki", "agents", "join"),
        subjects.api("secrets", "secrets", "fetch"),
        f"{js_api}.CONSUMER.MSG.NEXT.{stream}.{agent_id}",
        f"{js_api}.CONSUMER.INFO.{stream}.{agent_id}",
        f"$JS.ACK.{stream}.{agent_id}.>",
        subjects.site_results(site_id, agent_id),
    ]
    if role == "site":
        allow += [subjects.api("pki", "tokens", "burn"), subjects.api("pki", "tokens", "confirm")]
    return {"pub": {"allow": allow}, "sub": {"allow": [f"_INBOX.{agent_id}.>"]}}


def joining_permissions(subjects: Subjects, nonce: str | None) -> dict[str, Any]:
    """A joining machine's: ``agents.join``, and replies only under the inbox its connection
    named (none when it named none: it can ask but hear nothing)."""
    return {
        "pub": {"allow": [subjects.api("pki", "agents", "join")]},
        "sub": {"allow": [f"{join_inbox_prefix(nonce)}.>"] if nonce else []},
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


@dataclass(frozen=True)
class Admitted:
    """A connection the responder let in as an agent: enough to cut it off later."""

    agent: AgentCertificate
    server_id: str
    client_id: int


class CalloutResponder:
    """Answers one NATS server's auth callout for the agents of ``site_id``.

    ``issuer_seed`` is the seed of the account nkey the server's ``auth_callout.issuer`` names;
    ``account`` the account the agents land in; ``revoked`` asks whether bc-pki revoked a
    certificate (a deployment asks bc-pki, with a short cache). With ``bus_ca_pem``, a joining
    certificate of this site from that CA connects as ``joining``. ``admitted`` hears of every
    agent connection let in (its server and client id), so that it can be cut off.
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
        bus_ca_pem: bytes | None = None,
        admitted: Callable[[Admitted], None] | None = None,
        log: Any = None,
    ) -> None:
        self.log = log
        self.ca_pem = ca_pem
        self.bus_ca_pem = bus_ca_pem
        self.admitted = admitted
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
        if not isinstance(claims, dict):
            claims = {}
        user_nkey = str(claims.get("user_nkey", ""))
        server = str((claims.get("server_id") or {}).get("id", ""))
        response: dict[str, Any] = {"type": "authorization_response", "version": 2}
        try:
            name, permissions, not_after, agent = await self._identity(claims)
        except BcError as err:
            response["error"] = err.message
            if self.log is not None:
                client = claims.get("client_info") or {}
                self.log.info("connection_refused", error=err.message, host=str(client.get("host", ""))[:64])
        else:
            user = {
                "iss": self.issuer,
                "sub": user_nkey,
                "aud": self.account,
                "name": name,
                "exp": int(min(not_after, time.time() + USER_TTL_S)),
                "nats": {**permissions, "type": "user", "version": 2},
            }
            response["jwt"] = _sign(user, self.key)
            client = claims.get("client_info") or {}
            if agent is not None and self.admitted is not None and isinstance(client.get("id"), int):
                self.admitted(Admitted(agent=agent, server_id=server, client_id=client["id"]))
        return _sign(
            {"iss": self.issuer, "sub": user_nkey, "aud": server, "nats": response}, self.key
        ).encode()

    async def _identity(
        self, claims: dict[str, Any]
    ) -> tuple[str, dict[str, Any], float, AgentCertificate | None]:
        """Who the connection is: its name, permissions, when its user expires at the latest,
        and the agent certificate (None for a joining machine)."""
        chains = (claims.get("client_tls") or {}).get("verified_chains") or []
        if not chains or not chains[0]:
            raise BcError(ErrorCode.UNAUTHENTICATED, "no client certificate")
        leaf = str(chains[0][0])
        if self.bus_ca_pem is not None and _issued_by(leaf, self.bus_ca_pem):
            site = joining_certificate(leaf, self.bus_ca_pem)
            if site != self.site_id:
                raise BcError(
                    ErrorCode.UNAUTHENTICATED, f"the joining certificate of site {site}, not {self.site_id}"
                )
            nonce = join_nonce(str((claims.get("connect_opts") or {}).get("name") or ""))
            return JOINING, joining_permissions(self.subjects, nonce), time.time() + USER_TTL_S, None
        agent = await self._agent(leaf)
        permissions = agent_permissions(
            self.subjects, agent.site_id, agent.agent_id, js_api=self.js_api, role=agent.role
        )
        return user_name(agent), permissions, agent.not_after, agent

    async def _agent(self, pem: str) -> AgentCertificate:
        agent = agent_certificate(pem, self.ca_pem)
        if agent.site_id != self.site_id:
            raise BcError(ErrorCode.UNAUTHENTICATED, f"an agent of site {agent.site_id}, not {self.site_id}")
        if await self.revoked(agent):
            raise BcError(ErrorCode.UNAUTHENTICATED, "the certificate is revoked")
        return agent


def _issued_by(pem: str, ca_pem: bytes) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
