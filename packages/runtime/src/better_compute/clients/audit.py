"""The audit trail of every service that keeps one (``audit.list``, docs/audit.md)."""

from __future__ import annotations

import asyncio
from typing import Final

from ..core.errors import BcError
from ..service.client import ApiClient
from ..wire.audit import AuditEntry, AuditList, ListAudit

__all__ = ["AUDITED_SERVICES", "AuditClient"]

AUDITED_SERVICES: Final = ("engine", "command-queue", "pki", "secrets")
"""The service tokens whose ``audit.list`` holds operator actions."""


class AuditClient:
    """Reads the audit of one service, or of all of them merged newest first."""

    def __init__(self, api: ApiClient, *, timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout

    async def list_audit(
        self,
        *,
        service: str,
        since: float | None = None,
        who: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> AuditList:
        req = ListAudit(since=since, who=who, limit=limit, cursor=cursor)
        return await self.api.call_as(service, "audit.list", req, AuditList, timeout=self.timeout)

    async def merged(
        self, *, since: float | None = None, who: str | None = None, limit: int = 100
    ) -> tuple[list[AuditEntry], dict[str, BcError]]:
        """The newest ``limit`` entries of every audited service, newest first, and the error of
        each service that did not answer (its entries are then missing)."""

        async def one(service: str) -> AuditList | BcError:
            try:
                return await self.list_audit(service=service, since=since, who=who, limit=limit)
            except BcError as err:
                return err

        got = await asyncio.gather(*(one(s) for s in AUDITED_SERVICES))
        entries: list[AuditEntry] = []
        failed: dict[str, BcError] = {}
        for service, answer in zip(AUDITED_SERVICES, got, strict=True):
            if isinstance(answer, BcError):
                failed[service] = answer
            else:
                entries += answer.entries
        entries.sort(key=lambda e: (e.at, e.service, e.id), reverse=True)
        return entries[:limit], failed
