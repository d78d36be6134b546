"""Subject names of DESIGN.md section 5, under a configurable root (``bc`` by default).

Tests give each run its own root so that suites sharing one nats-server never see
each other's traffic.
"""

from __future__ import annotations

import re

import msgspec

__all__ = ["OPERATOR_INBOX_PREFIX", "SERVICE_NAMES", "Subjects", "valid_token"]

OPERATOR_INBOX_PREFIX = "_INBOX_OPS"
"""bcx's inbox prefix: its replies and its JetStream consumers' deliveries come on
``_INBOX_OPS.>``, the one inbox prefix the services' account exports to the operators' account
(deploy/nats/accounts.conf); its own ``_INBOX.>`` carries the services' replies, never exported."""

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
