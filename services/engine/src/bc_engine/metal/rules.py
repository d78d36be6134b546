"""Enrollment rules: ``bc.api.engine.enrollmentRules.*`` and their use on discovered nodes.

A rule (``better_compute.metal.enrollment``) enrolls a discovered node when the node's discovery
inventory arrives (``discovery.inventory_discovered``, woken by that command's settle event: no
poll). The rules of the node's tenant (and of its site, or of any site) are tried by priority,
then name, and the first whose selector matches the node's facts decides. It enrolls the node as
``metal.enroll`` would (its MACs kept, the rule's labels over its own, the rule's BMC), with the
inventory written in the same statement, and records the rule in ``enrolledByRule``; the
discovery certificates are then revoked as after an operator's enrolment. A matching rule whose
BMC address cannot be made (a fact missing, an address outside ``addressCidrs``), or whose BMC
another node has (one BMC, one node: ``bmcs``), leaves the node discovered, with the reason as
``lastError``.

A rule whose BMC address is a ``{fact}`` placeholder takes it from what the machine reported:
anyone on the boot network reports anything, and a made-up machine given another machine's BMC
(and the rule's credential) would power-cycle that machine at its first verb (issue 23, M3). So
such an enrolment waits for an operator: the node stays discovered with ``pendingEnrollment``
(``enrollmentRules.pending``, ``bcx enrollment-rules pending``) until ``enrollmentRules.confirm``
(``bcx enrollment-rules confirm NODE``) enrolls it as the rule would have.

The rule's credential is a template secret; the node gets its own copy as its standing secret
(``secrets.put`` with ``nodeId``, keyed by rule and node, so a re-run copies nothing twice), so
the fetch gate binds it to that node like any other node's BMC credential. The value passes
through the engine's memory only.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Final

import asyncpg
import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.metal.enrollment import (
    HOSTNAME_FACT,
    check_name_template,
    check_rule_bmc,
    host_name,
    node_facts,
    parse_rule_selector,
    render_node_name,
    render_rule_bmc,
)
from better_compute.provision import step_not_ready
from better_compute.service import ApiRequest
from better_compute.wire.engine import NodeView
from better_compute.wire.metal import (
    ConfirmEnrollment,
    CreateEnrollmentRule,
    DeleteEnrollmentRule,
    EnrollmentRuleList,
    EnrollmentRuleView,
    ListEnrollmentRules,
    ListPendingEnrollments,
    PendingEnrollment,
    PendingEnrollmentList,
)

from ..core import queue
from ..documents import check_labels, node_doc
from .api import check_name, names_unique
from .bmcs import check_bmc_free, refuse_inline_secret
from .host import MetalHost
from .names import DISCOVERY_OWNER
from .node_events import node_event

__all__ = ["EnrollmentRulesApi", "enroll_by_rules"]

RULE_COLUMNS: Final = (
    "id, tenant_id, name, priority, site_id, selector, labels, bmc, created_at, name_template"
)
INSERT_RULE: Final = (
    "INSERT INTO enrollment_rules"
    " (id, tenant_id, name, priority, site_id, selector, labels, bmc, name_template)"
    f" VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8::jsonb, $9) RETURNING {RULE_COLUMNS}"
)
LIST_RULES: Final = (
    f"SELECT {RULE_COLUMNS} FROM enrollment_rules WHERE ($1::text IS NULL OR tenant_id = $1)"
    " ORDER BY tenant_id, priority, name"
)
DELETE_RULE: Final = f"DELETE FROM enrollment_rules WHERE id = $1 RETURNING {RULE_COLUMNS}"
# The rules that may enroll a node of this tenant discovered at this site, in the order tried.
RULES_FOR_NODE: Final = (
    f"SELECT {RULE_COLUMNS} FROM enrollment_rules WHERE tenant_id = $1 AND (site_id IS NULL OR site_id = $2)"
    " ORDER BY priority, name"
)
ENROLL_BY_RULE: Final = (
    "UPDATE nodes SET state = 'enrolled', bmc = $2::jsonb, labels = labels || $3::jsonb,"
    " enrolled_by_rule = $4, inventory = $5::jsonb, last_error = NULL, pending_enrollment = NULL,"
    " name = COALESCE($6, name), updated_at = now()"
    " WHERE id = $1 AND state = 'discovered' RETURNING *"
)
SET_PENDING: Final = (
    "UPDATE nodes SET pending_enrollment = $2::jsonb, inventory = $3::jsonb, last_error = NULL,"
    " updated_at = now() WHERE id = $1 AND state = 'discovered' RETURNING *"
)
PENDING: Final = (
    "SELECT * FROM nodes WHERE state = 'discovered' AND pending_enrollment IS NOT NULL"
    " AND ($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR site_id = $2) ORDER BY id LIMIT 1000"
)
NODE: Final = "SELECT * FROM nodes WHERE id = $1"
RULE: Final = f"SELECT {RULE_COLUMNS} FROM enrollment_rules WHERE id = $1"
SET_LAST_ERROR: Final = (
    "UPDATE nodes SET last_error = $2::jsonb, updated_at = now() WHERE id = $1 RETURNING *"
)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def rule_view(row: Any) -> EnrollmentRuleView:
    return EnrollmentRuleView(
        id=row["id"],
        name=row["name"],
        tenant_id=row["tenant_id"],
        site_id=row["site_id"],
        selector=row["selector"],
        labels=_json(row["labels"]) or {},
        bmc=_json(row["bmc"]),
        priority=row["priority"],
        created_at=row["created_at"].isoformat() if row["created_at"] is not None else None,
        name_template=row["name_template"],
    )


class EnrollmentRulesApi:
    def __init__(self, db: Any, engine: MetalHost | None = None) -> None:
        self.db = db
        self.engine = engine  # enrolls a confirmed node (its credential copy, events, wake-ups)

    def routes(self) -> dict[str, Any]:
        return {
            "enrollmentRules.create": self.create,
            "enrollmentRules.list": self.list,
            "enrollmentRules.delete": self.delete,
            "enrollmentRules.pending": self.pending,
            "enrollmentRules.confirm": self.confirm,
        }

    async def pending(self, req: ApiRequest) -> PendingEnrollmentList:
        body = req.decode(ListPendingEnrollments)
        rows = await self.db.fetch(PENDING, body.tenant_id, body.site_id)
        return PendingEnrollmentList(nodes=[_pending_view(r) for r in rows])

    async def confirm(self, req: ApiRequest) -> NodeView:
        """An operator confirms the enrolment a rule left pending: the node is enrolled as the
        rule would have (``CONFLICT`` when its BMC is another node's by now)."""
        body = req.decode(ConfirmEnrollment)
        node_id = parse_id(body.node_id, "node", path="nodeId")
        if self.engine is None:
            raise BcError(ErrorCode.UNAVAILABLE, "the engine is starting", {"path": "nodeId"})
        node = await self.db.fetchrow(NODE, node_id)
        if node is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
        pending = _json(node["pending_enrollment"])
        if node["state"] != "discovered" or not pending:
            raise BcError(
                ErrorCode.INVALID_STATE, f"node {node_id} has no enrolment waiting for a confirmation",
                {"path": "nodeId", "reason": "nothing-pending", "state": node["state"]},
            )  # fmt: skip
        rule = await self.db.fetchrow(RULE, pending["ruleId"])
        if rule is None:
            raise BcError(
                ErrorCode.NOT_FOUND, f"the enrollment rule {pending['ruleId']} is gone",
                {"path": "nodeId", "reason": "rule-deleted"},
            )  # fmt: skip
        inventory = _json(node["inventory"]) or {}
        facts = node_facts(_json(node["labels"]) or {}, node["site_id"], inventory)
        row = await _enroll(self.engine, node, rule, facts, DISCOVERY_OWNER, inventory, confirmed=True)
        if row is None:
            raise BcError(ErrorCode.CONFLICT, f"node {node_id} was enrolled meanwhile", {"path": "nodeId"})
        self.engine.log.info("enrollment_confirmed", node_id=node_id, rule_id=rule["id"])
        return node_doc(row)

    async def create(self, req: ApiRequest) -> EnrollmentRuleView:
        body = req.decode(CreateEnrollmentRule)
        refuse_inline_secret(req)
        parse_rule_selector(body.selector)
        check_labels(body.labels)
        if body.name_template is not None:
            check_name_template(body.name_template)
        bmc = None
        if body.bmc is not None:
            bmc = {k: v for k, v in _camel(body.bmc).items() if v is not None and v != []}
            bmc["addressCidrs"] = list(body.bmc.address_cidrs)
            check_rule_bmc(bmc)
            if not bmc["addressCidrs"]:
                del bmc["addressCidrs"]
        try:
            row = await self.db.fetchrow(
                INSERT_RULE, new_id("rule"), body.tenant_id, body.name, body.priority, body.site_id,
                body.selector, json.dumps(body.labels), json.dumps(bmc) if bmc is not None else None,
                body.name_template,
            )  # fmt: skip
        except asyncpg.UniqueViolationError:
            raise BcError(
                ErrorCode.CONFLICT,
                f"tenant {body.tenant_id} has an enrollment rule named {body.name}",
                {"path": "name"},
            ) from None
        return rule_view(row)

    async def list(self, req: ApiRequest) -> EnrollmentRuleList:
        body = req.decode(ListEnrollmentRules)
        return EnrollmentRuleList(
            rules=[rule_view(r) for r in await self.db.fetch(LIST_RULES, body.tenant_id)]
        )

    async def delete(self, req: ApiRequest) -> EnrollmentRuleView:
        body = req.decode(DeleteEnrollmentRule)
        rule_id = parse_id(body.id, "rule", path="id")
        row = await self.db.fetchrow(DELETE_RULE, rule_id)
        if row is None:
            raise BcError(ErrorCode.NOT_FOUND, f"no enrollment rule {rule_id}", {"path": "id"})
        return rule_view(row)


def _pending_view(row: Any) -> PendingEnrollment:
    pending = _json(row["pending_enrollment"]) or {}
    hardware = _json(row["hardware"]) or {}
    return PendingEnrollment(
        node_id=row["id"], tenant_id=row["tenant_id"], site_id=row["site_id"],
        rule_id=str(pending.get("ruleId")), rule_name=str(pending.get("ruleName")),
        bmc=pending.get("bmc") or {}, macs=list(row["macs"]), product_uuid=hardware.get("productUuid"),
        serial=hardware.get("serial"), since=pending.get("at"),
    )  # fmt: skip


def _camel(bmc: Any) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(bmc)
    return out


async def enroll_by_rules(
    engine: MetalHost, node: Any, discovery_owner: str, inventory: dict[str, Any]
) -> Any:
    """Enroll the discovered ``node``, whose discovery ``inventory`` just arrived, by the first
    rule that matches it (see the module), writing the inventory with the enrolment; returns the
    enrolled node's row, or None (no rule matched, or the matching rule could not give it a BMC:
    then ``lastError`` says why): the caller stores the inventory then."""
    if node["state"] != "discovered":
        return None
    rules = await engine.db.fetch(RULES_FOR_NODE, node["tenant_id"], node["site_id"])
    if not rules:
        return None
    facts = node_facts(_json(node["labels"]) or {}, node["site_id"], inventory)
    for rule in rules:
        if not parse_rule_selector(rule["selector"]).matches(facts):
            continue
        return await _enroll(engine, node, rule, facts, discovery_owner, inventory)
    return None


async def _enroll(
    engine: MetalHost,
    node: Any,
    rule: Any,
    facts: dict[str, str],
    discovery_owner: str,
    inventory: dict[str, Any],
    *,
    confirmed: bool = False,
) -> Any:
    """Enroll ``node`` by ``rule``; ``confirmed``: an operator confirmed it (then a refusal is
    raised to them instead of becoming the node's ``lastError``)."""
    node_id = node["id"]
    template = _json(rule["bmc"])
    bmc = None
    name = None
    try:
        if rule["name_template"]:
            name = render_node_name(rule["name_template"], {**facts, **_hostname(node)}, rule=rule["id"])
            async with engine.db.transaction() as conn:
                await check_name(conn, node["site_id"], name, node_id)
        if template is not None:
            bmc = render_rule_bmc(template, facts, rule=rule["id"])
            async with engine.db.transaction() as conn:
                await check_bmc_free(conn, bmc, node_id)
            if not confirmed and _placeholders(str(template["address"])):
                return await _pend(engine, node, rule, bmc, inventory)
            if confirmed and not _same_bmc(_json(node["pending_enrollment"]), bmc):
                raise BcError(
                    ErrorCode.CONFLICT,
                    "the BMC the rule gives the node is not the one pending any more; look again",
                    {"path": "nodeId", "reason": "pending-changed"},
                )
            if bmc.get("credentialsRef"):
                bmc["credentialsRef"] = await _node_credential(engine, node, rule, bmc["credentialsRef"])
    except BcError as err:
        if confirmed:
            raise
        error = {"code": err.code.value, "message": err.message, **err.details}
        row = await engine.db.fetchrow(SET_LAST_ERROR, node_id, json.dumps(error))
        engine.log.warning(
            "enrollment_rule_not_applied", node_id=node_id, rule_id=rule["id"], reason=err.reason
        )
        if row is not None:
            await node_event(engine.publish, row)
        return None
    async with names_unique(), engine.db.transaction() as conn:
        await check_bmc_free(conn, bmc, node_id)
        row = await conn.fetchrow(
            ENROLL_BY_RULE, node_id, json.dumps(bmc) if bmc is not None else None,
            json.dumps(_json(rule["labels"]) or {}), rule["id"], json.dumps(inventory), name,
        )  # fmt: skip
        if row is None:
            return None  # enrolled meanwhile (an operator, another engine)
        await queue.queue_now(conn, queue.owner_key(discovery_owner, node_id))
    engine.log.info("node_enrolled_by_rule", node_id=node_id, rule_id=rule["id"], rule=rule["name"])
    await node_event(engine.publish, row, verb="enroll")
    if engine.wake is not None:
        await engine.wake(queue.owner_key(discovery_owner, node_id))
    return row


def _hostname(node: Any) -> dict[str, str]:
    """The ``hostname`` fact of a name template: the short host name the machine reported."""
    name = host_name((_json(node["hardware"]) or {}).get("hostname"))
    return {HOSTNAME_FACT: name} if name is not None else {}


def _placeholders(address: str) -> bool:
    return "{" in address


def _same_bmc(pending: Any, bmc: dict[str, Any]) -> bool:
    shown = (pending or {}).get("bmc") or {}
    return all(shown.get(k) == bmc.get(k) for k in ("driver", "address", "systemId"))


async def _pend(
    engine: MetalHost, node: Any, rule: Any, bmc: dict[str, Any], inventory: dict[str, Any]
) -> Any:
    """Leave the node discovered with the enrolment the rule would make, for an operator."""
    doc = {
        "ruleId": rule["id"],
        "ruleName": rule["name"],
        "bmc": {k: bmc.get(k) for k in ("driver", "address", "systemId")},
        "at": dt.datetime.now(dt.UTC).isoformat(),
    }
    row = await engine.db.fetchrow(SET_PENDING, node["id"], json.dumps(doc), json.dumps(inventory))
    engine.log.info(
        "enrollment_pending", node_id=node["id"], rule_id=rule["id"], bmc_address=bmc.get("address")
    )
    if row is not None:
        await node_event(engine.publish, row)
    return None


async def _node_credential(engine: MetalHost, node: Any, rule: Any, template_ref: str) -> str:
    """The node's own copy of the rule's credential (its standing secret), made once."""
    try:
        value = await engine.secrets.get(ref=template_ref)
        info = await engine.secrets.put_for_node(
            value,
            tenant_id=node["tenant_id"],
            node_id=node["id"],
            label=f"BMC credential (enrollment rule {rule['name']})",
            idempotency_key=f"enroll-rule:{rule['id']}:{node['id']}",
        )
    except BcError as err:
        if err.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
            engine.log.warning("enrollment_credential_unavailable", node_id=node["id"], code=err.code.value)
            raise step_not_ready(10_000) from None  # bc-secrets away: the key runs again
        raise
    return info.ref
