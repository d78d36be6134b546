"""One BMC, one node (issue 23, M3): an enrolment that would give a node the BMC (address and
Redfish system) another node has is refused, by hand or by rule.

Two nodes on one BMC means a verb on one power-cycles, wipes or installs the other machine. The
address is compared as the driver reads it: case-insensitive, without a trailing ``/`` and with
``https://`` implied (a Redfish address without a scheme is https). A retired node holds no BMC.
Two enrolments at once take turns on a lock of the address, so both cannot pass the check.

A BMC's credential is never given inline (``refuse_inline_secret``): it is named by reference.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import ApiRequest
from better_compute.wire.metal import find_inline_secret

__all__ = ["check_bmc_free", "refuse_inline_secret"]

_KEY: Final = "regexp_replace(rtrim(lower({}), '/'), '^https://', '')"
_LOCK: Final = f"SELECT pg_advisory_xact_lock(hashtext('bc-engine:bmc:' || {_KEY.format('$1::text')}))"
_TAKEN: Final = f"""
SELECT id FROM nodes WHERE id <> $1 AND bmc IS NOT NULL AND state <> 'retired'
  AND {_KEY.format("bmc ->> 'address'")} = {_KEY.format("$2::text")}
  AND coalesce(bmc ->> 'systemId', '') = coalesce($3::text, '')
ORDER BY id LIMIT 1
"""


async def check_bmc_free(
    conn: Any, bmc: dict[str, Any] | None, node_id: str, *, path: str = "bmc.address"
) -> None:
    """Refuse (``CONFLICT`` at ``path``, ``details.nodeId`` the holder) a BMC another node has.

    Call it inside the transaction that writes the node's BMC."""
    if not bmc or not bmc.get("address"):
        return
    address, system = str(bmc["address"]), bmc.get("systemId")
    await conn.execute(_LOCK, address)
    holder = await conn.fetchval(_TAKEN, node_id, address, system)
    if holder is not None:
        where = f" system {system}" if system else ""
        raise BcError(
            ErrorCode.CONFLICT,
            f"node {holder} has the BMC {address}{where} already: one BMC, one node",
            {"path": path, "reason": "bmc-taken", "nodeId": holder},
        )


def refuse_inline_secret(req: ApiRequest) -> None:
    """A request carrying a credential inline (``bmc.password`` …) is ``INVALID_INPUT`` at its
    path, before anything is stored or logged. Labels are free text and not looked into.

    Call it after ``req.decode``, which has checked the request as plain JSON (nesting depth
    bounded), so this second look at the raw JSON is bounded too.
    """
    try:
        raw = msgspec.json.decode(req.data)
    except msgspec.DecodeError:
        return  # decode reported it, with its path
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k != "labels"}
    found = find_inline_secret(raw)
    if found is not None:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "a credential is never given inline: store it with bc-secrets and give bmc.credentialsRef",
            {"path": found, "reason": "inline-credential"},
        )
