"""Fencing a superseded workflow step attempt in a service's own store.

When the engine supersedes a step attempt (a retry, a resume, an abort), the services it minted or
stored things in (join tokens in pki, values in secrets) revoke all of it and refuse what the attempt
sends later, even from an engine that lost its shard and still runs it. Each such service has a
``key_fences`` table and a table of things keyed by ``idempotency_key`` with ``revoked_at`` and
``revoke_reason``; it names that table here and keeps nothing else of the mechanism.
"""

from __future__ import annotations

from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.keys import attempt_key

from .db import Database

__all__ = ["KEY_FENCED", "AttemptFences", "attempt_superseded"]

KEY_FENCE_INSERT: Final = (
    "INSERT INTO key_fences (prefix, reason) VALUES ($1, $2) ON CONFLICT (prefix) DO NOTHING"
)
# Whether $1 is under a fenced prefix: the key itself or one of its prefixes that end before
# a ':' or '#' is in key_fences (primary-key lookups).
KEY_FENCED: Final = (
    "SELECT EXISTS (SELECT 1 FROM key_fences WHERE prefix = ANY (ARRAY("
    " SELECT left($1::text, i - 1) FROM generate_series(1, length($1::text)) AS i"
    " WHERE substr($1::text, i, 1) IN (':', '#')) || $1::text))"
)
# A key is under a prefix when it is the prefix or goes on with ':' or '#' after it, so
# wf:X:3#1 covers wf:X:3#1:name but never wf:X:3#12. In byte order (COLLATE "C") the keys
# going on with ':' lie in [p || ':', p || ';'), those with '#' in [p || '#', p || '$'): one
# range each of an index on (idempotency_key COLLATE "C").
_K: Final = 'idempotency_key COLLATE "C"'
_UNDER_KEY: Final = (
    f"({_K} = $1::text"
    f" OR ({_K} >= ($1::text || ':') AND {_K} < ($1::text || ';'))"
    f" OR ({_K} >= ($1::text || '#') AND {_K} < ($1::text || '$')))"
)

_SUPERSEDED_REASON: Final = "superseded by a later attempt of its workflow step"


def attempt_superseded(verb: str, path: str = "idempotencyKey") -> BcError:
    """The refusal of what a superseded attempt sends late (``verb``: what it does, "mints";
    ``path``: the request field that carries its key)."""
    return BcError(
        ErrorCode.INVALID_STATE,
        f"this workflow step attempt was superseded: it {verb} nothing any more",
        {"path": path, "reason": "attempt-superseded"},
    )


class AttemptFences:
    """The fence-and-revoke statements of one service's table of minted things.

    Args:
        table: the table (``join_tokens``, ``secrets``).
        id_column: its primary key (``id``, ``ref``), returned for what was revoked.
    """

    def __init__(self, *, table: str, id_column: str) -> None:
        self.id_column = id_column
        # $1 prefix, $2 reason
        self.revoke_under_key = (
            f"UPDATE {table} SET revoked_at = now(), revoke_reason = $2"
            f" WHERE revoked_at IS NULL AND {_UNDER_KEY} RETURNING {id_column}"
        )
        # $1 id, $2 reason
        self.revoke_one = (
            f"UPDATE {table} SET revoked_at = now(), revoke_reason = $2"
            f" WHERE {id_column} = $1 AND revoked_at IS NULL"
        )

    async def fence(
        self, db: Database, *, workflow_id: str, step: int, attempt: int, reason: str | None
    ) -> tuple[str, list[str]]:
        """Fence one attempt's key and revoke everything under it.

        Returns:
            The attempt's key prefix and the ids revoked.
        """
        prefix = attempt_key(workflow_id, step, attempt)
        reason = reason or _SUPERSEDED_REASON
        # The fence commits before the revoke looks: a row inserted meanwhile is either seen
        # by the revoke or sees the fence itself (revoke_if_fenced runs after its insert).
        await db.execute(KEY_FENCE_INSERT, prefix, reason)
        rows: list[Any] = await db.fetch(self.revoke_under_key, prefix, reason)
        return prefix, [r[self.id_column] for r in rows]

    async def revoke_if_fenced(self, db: Database, key: str, row_id: str, reason: str) -> bool:
        """Revoke the row just inserted under ``key`` when the key is fenced; whether it was."""
        if not await db.fetchval(KEY_FENCED, key):
            return False
        await db.execute(self.revoke_one, row_id, reason)
        return True
