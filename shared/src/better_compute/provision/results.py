"""Reading earlier steps' results: from the store, by workflow and action, never from memory.

``media.insert`` with ``fromStep`` reads the ``url`` the latest succeeded step of that action
returned; ``deploy.deploy`` finds ``userdata.render``'s reference with ``rendered_user_data``.
"""

from __future__ import annotations

import json
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode

from .context import Sql

__all__ = ["LATEST_RESULT", "latest_result", "rendered_user_data"]

LATEST_RESULT: Final = (
    "SELECT result::text AS result FROM workflow_steps WHERE workflow_id = $1 AND action = $2"
    " AND state = 'succeeded' ORDER BY idx DESC LIMIT 1"
)


async def _latest(sql: Sql, workflow_id: str, action: str) -> tuple[bool, Any]:
    rows = await sql.query(LATEST_RESULT, workflow_id, action)
    if not rows:
        return False, None
    # the result as JSON text, parsed once here: a step that returned a plain string ("ok")
    # gets that string back, whatever the connection's jsonb codec does
    value = rows[0]["result"]
    return True, json.loads(value) if isinstance(value, str) else value


async def latest_result(sql: Sql, workflow_id: str, action: str, *, path: str = "fromStep") -> Any:
    """The result of the latest succeeded step with ``action`` in the workflow.

    Raises:
        BcError: ``NOT_FOUND`` at ``path`` when no such step succeeded in this workflow.
    """
    found, value = await _latest(sql, workflow_id, action)
    if not found:
        raise BcError(
            ErrorCode.NOT_FOUND, f"no succeeded step {action} in workflow {workflow_id}", {"path": path}
        )
    return value


async def rendered_user_data(sql: Sql, workflow_id: str) -> str | None:
    """The ``userDataRef`` (a SecretRef) of the workflow's latest succeeded ``userdata.render``,
    or None when the workflow rendered no user data."""
    found, value = await _latest(sql, workflow_id, "userdata.render")
    if not found or not isinstance(value, dict):
        return None
    ref = value.get("userDataRef")
    return ref if isinstance(ref, str) else None
