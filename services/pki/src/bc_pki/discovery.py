"""Discovery joins: an unknown machine's bcd joins with a site's ``discovery`` token.

A ``discovery`` token is per site, has many uses and a short TTL; the discovery ramdisk carries
it on its kernel command line (``bcd.token=``), next to the site the site agent serves
(``bcd.site=``). What bc-pki decides for such a join:

* the machine must show something that names its hardware (a product UUID, a serial or a MAC),
  else the join is ``INVALID_INPUT`` (``claims``) and spends nothing;
* a join that says which site it boots in, with a token of another site, is
  ``PERMISSION_DENIED`` (reason ``site-mismatch``) and spends nothing (any role);
* the agent id is a ``node_…`` id (node commands are addressed to the node id): the one a
  still-valid discovery certificate of the same hardware in the same tenant and site has
  (product UUID, else serial, else a MAC) *and of the same key* (the join's CSR proves
  possession of it: the bcd that joined before, joining again), so a bcd that joins again is
  the same node; a new one otherwise. Claims alone never reuse a node id: the discovery token
  is the site's, any machine on the boot network has it, and a join that only *says* it is a
  discovered machine's hardware would otherwise take that node's id (issue 23, H2). A fresh
  discovery ramdisk of a known machine gets a new id, whose node the engine does not record
  (the hardware is another node's; a difference is shown on that node as a conflict).
  Certificates revoked at enrolment are not reused either.

The engine learns of the join from the ``join`` event and reads the certificate (role, site,
claims) back from bc-pki before it records a ``discovered`` node.
"""

from __future__ import annotations

from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id
from better_compute.wire.pki import JoinClaims

__all__ = ["SAME_HARDWARE", "agent_id_for", "refusal"]

# The newest valid discovery certificate of the same hardware in a tenant and site.
SAME_HARDWARE: Final = """
SELECT agent_id FROM certificates
WHERE role = 'discovery' AND tenant_id = $1 AND site_id = $2 AND revoked_at IS NULL
  AND agent_id LIKE 'node\\_%' AND public_key = $6
  AND CASE WHEN $3::text IS NOT NULL THEN claims ->> 'productUuid' = $3
           WHEN $4::text IS NOT NULL THEN claims ->> 'serial' = $4
           ELSE claims -> 'macs' ?| $5::text[] END
ORDER BY created_at DESC LIMIT 1
"""


def refusal(token: Any, claims: JoinClaims, site_id: str | None) -> BcError | None:
    """Why a join with this (known, live) token row is refused beyond the token's own checks."""
    if token is None:
        return None
    if site_id is not None and site_id != token["site_id"]:
        return BcError(
            ErrorCode.PERMISSION_DENIED,
            f"the join token is for site {token['site_id']}, not {site_id}; the token was not spent",
            {"reason": "site-mismatch", "path": "siteId"},
        )
    if token["role"] == "discovery" and not (claims.product_uuid or claims.serial or claims.macs):
        return BcError(
            ErrorCode.INVALID_INPUT,
            "a discovery join shows the machine's product UUID, serial or MACs",
            {"path": "claims", "reason": "no-hardware-claims"},
        )
    return None


async def agent_id_for(conn: Any, token: Any, claims: JoinClaims, public_key: bytes) -> str:
    """The agent id a join with ``token`` gets: the token's node, the node an earlier discovery
    of the same hardware *with the same key* was given, or a new id (``node_…`` for discovery,
    else ``agent_…``)."""
    if token["node_id"]:
        return str(token["node_id"])
    if token["role"] != "discovery":
        return new_id("agent")
    found = await conn.fetchval(
        SAME_HARDWARE,
        token["tenant_id"],
        token["site_id"],
        claims.product_uuid,
        claims.serial,
        list(claims.macs),
        public_key,
    )
    return str(found) if found else new_id("node")
