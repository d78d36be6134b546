"""Subject names of DESIGN.md section 5, under a configurable root (``bc`` by default).

Tests give each run its own root so that suites sharing one nats-server never see
each other's traffic.
"""

from __future__ import annotations

import re

import msgspec

__all__ = [
    "OPERATOR_INBOX_PREFIX",
    "SERVICE_NAMES",
    "Subjects",
    "agent_inbox_prefix",
    "join_connection_name",
    "join_inbox_prefix",
    "join_nonce",
    "operator_inbox_prefix",
    "service_inbox_prefix",
    "valid_token",
]

OPERATOR_INBOX_PREFIX = "_INBOX_OPS"
"""The operators' inboxes: bcx run as NATS user ``<user>`` hears its replies on
``_INBOX_OPS.<user>.>`` (``operator_inbox_prefix``), the only part of ``_INBOX_OPS.>`` that user may
read (deploy/nats/accounts.conf); the services' own ``_INBOX.>`` is never exported to operators."""

JOIN_NAME_PREFIX = "bc-join:"
"""A joining machine names its connection ``bc-join:<nonce>`` and hears its replies on
``_INBOX.join.<nonce>``: on a site's leaf node the auth callout lets it read that and nothing else
(``better_compute.service.bus_auth``), so one joining machine never reads another's answer."""

ANONYMOUS_OPERATOR = "anonymous"
"""The inbox token of a bcx that connects without a user (the dev stack's NATS has no users)."""

SERVICE_NAMES = {
    "engine": "bc-engine",
    "command-queue": "bc-command-queue",
    "pki": "bc-pki",
    "secrets": "bc-secrets",
}

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def valid_token(value: str) -> bool:
    """True when ``value`` can stand as one subject token (no dots, spaces or wildcards)."""
    return bool(_TOKEN_RE.match(value))


def service_inbox_prefix(api_name: str) -> str:
    """A service's inbox prefix, ``_INBOX.<api name>``: its replies and JetStream answers come
    under it, and its NATS user may read nothing else of ``_INBOX.>`` (deploy/nats/accounts.conf)."""
    if not valid_token(api_name):
        raise ValueError(f"not a subject token: {api_name!r}")
    return f"_INBOX.{api_name}"


def agent_inbox_prefix(agent_id: str) -> str:
    """An agent's inbox prefix, ``_INBOX.<agent id>``: the only part of ``_INBOX.>`` its own NATS
    user may read on a leaf node with the auth callout (deploy/nats/leaf-site.conf)."""
    if not valid_token(agent_id):
        raise ValueError(f"not a subject token: {agent_id!r}")
    return f"_INBOX.{agent_id}"


def join_connection_name(nonce: str) -> str:
    """The connection name of a joining machine whose inbox is ``join_inbox_prefix(nonce)``."""
    return JOIN_NAME_PREFIX + nonce


def join_nonce(name: str) -> str | None:
    """The nonce a joining connection's name carries (at least 16 token characters), or None."""
    nonce = name.removeprefix(JOIN_NAME_PREFIX) if name.startswith(JOIN_NAME_PREFIX) else ""
    return nonce if len(nonce) >= 16 and valid_token(nonce) else None


def join_inbox_prefix(nonce: str) -> str:
    """A joining machine's inbox prefix, ``_INBOX.join.<nonce>``."""
    if not valid_token(nonce):
        raise ValueError(f"not a subject token: {nonce!r}")
    return f"_INBOX.join.{nonce}"


def operator_inbox_prefix(user: str | None) -> str:
    """bcx's inbox prefix as NATS user ``user``: ``_INBOX_OPS.<user>`` (``anonymous`` without one)."""
    user = user or ANONYMOUS_OPERATOR
    if not valid_token(user):
        raise ValueError(f"not a subject token: {user!r}")
    return f"{OPERATOR_INBOX_PREFIX}.{user}"


class Subjects(msgspec.Struct, frozen=True):
    """Builds every subject the services use."""

    root: str = "bc"

    def api(self, service: str, resource: str, verb: str) -> str:
        """``bc.api.<service>.<resource>.<verb>``; service is ``engine``, ``pki``, …"""
        return f"{self.root}.api.{service}.{resource}.{verb}"

    def api_prefix(self, service: str) -> str:
        return f"{self.root}.api.{service}"

    def site_cmd(self, site: str, agent: str) -> str:
        return f"{self.root}.site.{site}.cmd.{agent}"

    def site_cmd_all(self, site: str) -> str:
        return f"{self.root}.site.{site}.cmd.>"

    def site_stream(self, site: str) -> str:
        """JetStream stream name for one site's commands."""
        return f"{self.root.upper().replace('.', '_')}_SITE_{site.upper()}"

    def site_results(self, site: str, agent: str) -> str:
        """Where an agent stores its results on its site's leaf (``cmdq.site_domain`` set)."""
        return f"{self.root}.site.{site}.results.{agent}"

    def site_results_all(self, site: str) -> str:
        return f"{self.root}.site.{site}.results.>"

    def site_results_stream(self, site: str) -> str:
        """JetStream stream name for one site's stored results (on its leaf)."""
        return f"{self.site_stream(site)}_RESULTS"

    def agent_event(self, site: str, agent: str, kind: str) -> str:
        """kind: hello, heartbeat, ack, progress or result."""
        return f"{self.root}.agent.{site}.{agent}.{kind}"

    def agent_events_all(self) -> str:
        return f"{self.root}.agent.*.*.*"

    def event(self, kind: str, ident: str) -> str:
        """kind: workflow, node, command, batch, join or cert (docs/events.md)."""
        return f"{self.root}.events.{kind}.{ident}"

    def events_all(self, kind: str) -> str:
        return f"{self.root}.events.{kind}.*"

    def events_feed(self) -> str:
        """Every event of every kind: what the ``BC_EVENTS`` stream holds."""
        return f"{self.root}.events.>"

    def events_stream(self) -> str:
        """JetStream stream name of the event feed (``BC_EVENTS`` under the root ``bc``)."""
        return f"{self.root.upper().replace('.', '_')}_EVENTS"
