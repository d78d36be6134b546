"""The profile store: tenants' own, public stored ones, and the shipped ones (tenant ``builtin``).

A lookup prefers the tenant's own profile, then a public stored one, then a shipped one.
A stored version is immutable from the first time a workflow uses it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import Profile, profile_from_document
from better_compute.wire import engine as m

from . import store

__all__ = ["BUILTIN_TENANT", "FoundProfile", "ProfileStore"]

BUILTIN_TENANT = "builtin"
PARSED_CACHE: Final = 256  # pinned (immutable) stored versions kept parsed, the latest used


@dataclass(frozen=True)
class FoundProfile:
    profile: Profile
    tenant_id: str  # where it was found: the tenant, another tenant (public), or builtin
    public: bool
    first_used_at: str | None

    @property
    def shipped(self) -> bool:
        return self.tenant_id == BUILTIN_TENANT

    @property
    def immutable(self) -> bool:
        """Shipped, or a stored version a workflow used: ``pin`` has nothing to do."""
        return self.shipped or self.first_used_at is not None

    def _head(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "id": self.profile.id,
            "version": self.profile.version,
            "public": self.public or self.shipped,
            "shipped": self.shipped,
            "immutable": self.immutable,
            "first_used_at": self.first_used_at,
        }

    def view(self) -> m.ProfileView:
        return m.ProfileView(**self._head(), document=self.profile.to_document())

    def summary(self) -> m.ProfileSummary:
        """As ``profiles.list`` shows it: without the document, with its step count and target."""
        return m.ProfileSummary(**self._head(), steps=len(self.profile.steps), target=self.profile.target)


def parse_document(document: dict[str, Any]) -> Profile:
    """A stored document is re-checked by the same rules as ``define_profile``."""
    return profile_from_document(document)


class ProfileStore:
    def __init__(self, app: App) -> None:
        self.shipped: dict[tuple[str, int], Profile] = {p.key: p for p in app.profiles}
        # A pinned version never changes, so it is parsed once (every workflows.start reads it).
        # Its first use is in the key: a version deleted and stored again is parsed anew.
        self._parsed: OrderedDict[tuple[str, str, int, Any], Profile] = OrderedDict()

    def _row(self, row: Any) -> FoundProfile:
        used = row["first_used_at"]
        key = (row["tenant_id"], row["id"], row["version"], used)
        profile = self._parsed.get(key) if used is not None else None
        if profile is None:
            doc = row["document"]
            profile = parse_document(json.loads(doc) if isinstance(doc, str) else doc)
            if used is not None:
                self._parsed[key] = profile
                if len(self._parsed) > PARSED_CACHE:
                    self._parsed.popitem(last=False)
        else:
            self._parsed.move_to_end(key)
        return FoundProfile(profile, row["tenant_id"], row["public"], used.isoformat() if used else None)

    async def create(
        self, conn: Any, *, tenant_id: str, document: dict[str, Any], public: bool, replace: bool
    ) -> FoundProfile:
        if tenant_id == BUILTIN_TENANT:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                "tenant builtin holds the shipped profiles and is read-only",
                {"path": "tenantId"},
            )
        profile = parse_document(document)
        doc = json.dumps(profile.to_document())
        existing = await conn.fetchrow(store.LOCK_PROFILE, tenant_id, profile.id, profile.version)
        if existing is not None:
            if existing["first_used_at"] is not None:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"profile {profile.id} version {profile.version} is immutable: a workflow"
                    " used it; store a new version",
                    {"reason": "profile-in-use", "path": "document.version"},
                )
            if not replace:
                raise BcError(
                    ErrorCode.CONFLICT,
                    f"profile {profile.id} version {profile.version} exists (replace it with"
                    " replace=true while no workflow has used it)",
                    {"path": "document.version"},
                )
            await conn.execute(store.REPLACE_PROFILE, tenant_id, profile.id, profile.version, doc, public)
        else:
            await conn.execute(store.INSERT_PROFILE, tenant_id, profile.id, profile.version, doc, public)
        return FoundProfile(profile, tenant_id, public, None)

    async def find(self, conn: Any, *, tenant_id: str, profile_id: str, version: int | None) -> FoundProfile:
        """The tenant's own, then a public stored one, then a shipped one."""
        for latest, of_version in (
            (store.OWN_PROFILE_LATEST, store.OWN_PROFILE_VERSION),
            (store.PUBLIC_PROFILE_LATEST, store.PUBLIC_PROFILE_VERSION),
        ):
            if version is None:
                row = await conn.fetchrow(latest, tenant_id, profile_id)
            else:
                row = await conn.fetchrow(of_version, tenant_id, profile_id, version)
            if row is not None:
                return self._row(row)
        shipped = [p for (pid, _v), p in self.shipped.items() if pid == profile_id]
        if version is not None:
            shipped = [p for p in shipped if p.version == version]
        if shipped:
            best = max(shipped, key=lambda p: p.version)
            return FoundProfile(best, BUILTIN_TENANT, True, None)
        what = profile_id if version is None else f"{profile_id} version {version}"
        raise BcError(ErrorCode.NOT_FOUND, f"no profile {what}", {"path": "profileId"})

    async def pin(self, conn: Any, found: FoundProfile) -> FoundProfile:
        """Make the version immutable (first use) and return the document that is pinned.

        Only the first use takes the row lock; later starts read an immutable row and lock
        nothing, so many workflows of one profile start in parallel. A replace that raced
        the read is caught here: the first use pins whatever the row holds under the lock.
        """
        if found.shipped or found.first_used_at is not None:
            return found
        key = (found.tenant_id, found.profile.id, found.profile.version)
        row = await conn.fetchrow(store.PIN_PROFILE, *key)
        if row is None:  # someone else used it first: it is immutable now, read it again
            row = await conn.fetchrow(store.PROFILE, *key)
            if row is None:
                raise BcError(
                    ErrorCode.NOT_FOUND, f"profile {found.profile.id} was deleted", {"path": "profileId"}
                )
        return self._row(row)

    async def list(
        self, conn: Any, *, tenant_id: str, after: tuple[Any, ...] | None = None, limit: int | None = None
    ) -> list[FoundProfile]:
        """By (id, version, tenant): the first ``limit`` after the key ``after``.

        Text compares bytewise (``COLLATE "C"``), as Python does: the shipped profiles are
        merged in here, so both sides must agree on the order.
        """
        rows = await conn.fetch(store.LIST_PROFILES, tenant_id, *(after or (None, None, None)), limit)
        found = [self._row(r) for r in rows]
        found += [
            FoundProfile(p, BUILTIN_TENANT, True, None)
            for p in self.shipped.values()
            if after is None or (p.id, p.version, BUILTIN_TENANT) > after
        ]
        found.sort(key=lambda f: (f.profile.id, f.profile.version, f.tenant_id))
        return found[:limit]

    async def delete(self, conn: Any, *, tenant_id: str, profile_id: str, version: int) -> None:
        if tenant_id == BUILTIN_TENANT:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                "shipped profiles cannot be deleted",
                {"path": "tenantId"},
            )
        row = await conn.fetchrow(store.LOCK_PROFILE, tenant_id, profile_id, version)
        if row is None:
            raise BcError(
                ErrorCode.NOT_FOUND,
                f"tenant {tenant_id} has no profile {profile_id} version {version}",
                {"path": "id"},
            )
        if row["first_used_at"] is not None:
            raise BcError(
                ErrorCode.INVALID_STATE,
                f"profile {profile_id} version {version} was used by a workflow and is kept",
                {"reason": "profile-in-use", "path": "version"},
            )
        await conn.execute(store.DELETE_PROFILE, tenant_id, profile_id, version)
