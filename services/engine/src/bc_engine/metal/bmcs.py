"""One BMC, one node (issue 23, M3): an enrolment that would give a node the BMC (address and
Redfish system) another node has is refused, by hand or by rule.

Two nodes on one BMC means a verb on one power-cycles, wipes or installs the other machine. The
address is compared as the driver reads it: case-insensitive, without a trailing ``/`` and with
``https://`` implied (a Redfish address without a scheme is https). A retired node holds no BMC.
Two enrolments at once take turns on a lock of the address, so both cannot pass the check.
"""

from __future__ import annotations

from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["check_bmc_free"]

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
