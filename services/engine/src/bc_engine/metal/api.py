"""``bc.api.engine.metal.*``: enrolling nodes and the lifecycle verbs, one node or many.

A verb checks the node's state (``INVALID_STATE`` with the reason otherwise), then starts the
verb's profile as a workflow with ``owner='metal'`` and moves the node to the verb's ``…ing`` state
in the same transaction. Metal, not the reconciler, makes the workflow's destructive batch from the
profile's command kinds before it starts; ``metal.bulk`` makes one batch for all the workflows it
starts, so approvers sign once for N machines. ``metal_lifecycle`` moves the node on when the
workflow ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.ids import new_id, parse_id
from better_compute.metal.images import resolve_image_ref
from better_compute.metal.lifecycle import DEFAULT_PROFILES, SELECTOR_SITE, TRANSITIONS, check_verb
from better_compute.metal.steps import ACTION_PROFILE_IDS
from better_compute.provision import Profile
from better_compute.service import ApiRequest
from better_compute.wire.engine import NodeView
from better_compute.wire.metal import (
    MAX_NODES_PER_BULK,
    BulkPlan,
    BulkRefusal,
    BulkRun,
    BulkVerb,
    EnrollNode,
    MetalVerb,
    NodeActionRun,
    NodeBmc,
    PlanApprovals,
    PlannedNode,
    PlanStep,
    PowerNode,
    SetBootDevice,
    VerbProfile,
    VerbRun,
    VerbStarted,
    normal_mac,
)

from .. import store
from ..core import queue
from ..documents import check_labels, node_doc
from ..resolve import ResolvedStep, resolve_profile
from ..steps.context import EngineSql
from ..steps.quorum import BATCH_TTL_S, batch_kinds
from . import store as metal_store
from .bmcs import check_bmc_free, refuse_inline_secret
from .names import DISCOVERY_OWNER
from .node_events import node_event
from .quarantine import refuse_maintenance, refuse_quarantined

__all__ = [
    "MetalApi",
    "bmc_json",
    "check_macs",
    "check_name",
    "name_conflict",
    "names_unique",
    "refuse_inline_secret",
    "verb_profiles",
]


def verb_profiles(app: App) -> dict[str, str]:
    """Each verb's profile id: ``metal(profiles={…})`` over the shipped ``metal.<verb>``."""
    for module in app.modules:
        mapping = getattr(module, "verb_profiles", None)
        if mapping is not None:
            return {**DEFAULT_PROFILES, **mapping}
    return dict(DEFAULT_PROFILES)


async def check_macs(conn: Any, macs: Sequence[str], node_id: str | None) -> list[str]:
    """The MACs normalised (``aa:bb:…``); ``CONFLICT`` when another node has one of them."""
    normal = sorted({normal_mac(m) for m in macs})
    if normal:
        other = await conn.fetchrow(store.MAC_TAKEN, normal, node_id)
        if other is not None:
            taken = sorted(set(normal) & set(other["macs"]))
            raise BcError(
                ErrorCode.CONFLICT,
                f"MAC {taken[0] if taken else normal[0]} belongs to node {other['id']}",
                {"path": "macs", "nodeId": other["id"]},
            )
    return normal


async def check_name(conn: Any, site_id: str, name: str | None, node_id: str | None) -> None:
    """``CONFLICT`` at ``name`` when another node of the site has the name (``nodeId`` names it)."""
    if name is None:
        return
    other = await conn.fetchval(store.NAME_TAKEN, site_id, name, node_id)
    if other is not None:
        raise name_conflict(site_id, name, other)


def name_conflict(site_id: str, name: str, other: str) -> BcError:
    """The error of a name another node of the site holds."""
    return BcError(
        ErrorCode.CONFLICT,
        f"site {site_id} has node {other} named {name}: a name is unique in its site",
        {"path": "name", "reason": "name-taken", "nodeId": other},
    )


@asynccontextmanager
async def names_unique() -> AsyncIterator[None]:
    """Around a transaction that names a node: two requests that asked for one name at once
    both passed ``check_name``, and the second meets the unique index (``store.NODE_NAME_INDEX``):
    ``CONFLICT`` at ``name`` for it too."""
    try:
        yield
    except asyncpg.UniqueViolationError as exc:
        if exc.constraint_name != store.NODE_NAME_INDEX:
            raise
        raise BcError(
            ErrorCode.CONFLICT,
            "another node of the site took that name at the same moment: a name is unique in its site",
            {"path": "name", "reason": "name-taken"},
        ) from None


def deploy_image_refs(profile: Profile, image: str | None) -> list[tuple[str, str]]:
    """Every catalog image a deploy of ``profile`` can use, with the path to blame: the verb's
    ``image`` (else the profile's), which the node records, and each ``deploy.deploy`` step's
    own ``with.image``, which wins over it there."""
    refs: list[tuple[str, str]] = []
    if image is not None:
        refs.append((image, "image"))
    elif profile.image is not None:
        refs.append((profile.image, "profile.image"))
    for i, step in enumerate(profile.steps):
        ref = step.with_.get("image") if step.use == "deploy.deploy" else None
        if isinstance(ref, str) and ref not in [r for r, _ in refs]:
            refs.append((ref, f"profile.steps[{i}].with.image"))
    return refs


def bmc_json(bmc: NodeBmc | None) -> str | None:
    return json.dumps(bmc.to_document()) if bmc is not None else None


@dataclass
class _Run:
    """What a verb over some nodes did: started workflows, refused nodes, the batch."""

    started: list[VerbStarted] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    batch_id: str | None = None


@dataclass
class _Prepared:
    """What a verb over some nodes would do, checked but not done (``MetalApi._prepare``)."""

    ok: list[Any]
    refused: list[Refused]
    tenant: str | None = None
    profile: Profile | None = None
    steps: list[ResolvedStep] = field(default_factory=list)
    scope: list[str] = field(default_factory=list)
    """The kinds the destructive batch would cover (``quorum.batch_kinds``)."""


Refused = tuple[str, BcError, str | None]
"""A node a verb leaves alone: its id, why, and its name (None: it has none, or no such node)."""


def _refusal_view(node_id: str, err: BcError, name: str | None) -> BulkRefusal:
    return BulkRefusal(
        node_id=node_id, name=msgspec.UNSET if name is None else name, code=err.code.value,
        message=err.message, reason=err.details.get("reason"),
    )  # fmt: skip


class MetalApi:
    def __init__(self, engine_api: Any, quorum: Any) -> None:
        self.api = engine_api
        self.quorum = quorum  # QuorumBatches: whether approvers are configured, the cmdq client
        self.profiles_of = verb_profiles(engine_api.app)

    def routes(self) -> dict[str, Callable[[ApiRequest], Awaitable[Any]]]:
        routes: dict[str, Callable[[ApiRequest], Awaitable[Any]]] = {
            "metal.enroll": self.enroll,
            "metal.bulk": self.bulk,
            "metal.plan": self.plan,
        }
        for verb in TRANSITIONS:
            routes[f"metal.{verb}"] = self._one(verb)
        routes["metal.power"] = self.power
        routes["metal.bootDevice"] = self.boot_device
        return routes

    # -- node actions: power and boot device ------------------------------------------

    async def power(self, req: ApiRequest) -> NodeActionRun:
        """Switch the node on or off, or power-cycle it: the shipped ``metal.power-<action>``."""
        body = req.decode(PowerNode)
        return await self._action(body.node_id, f"power.{body.action}", body.tenant_id)

    async def boot_device(self, req: ApiRequest) -> NodeActionRun:
        """The device the node boots from next: the shipped ``metal.boot-<device>``."""
        body = req.decode(SetBootDevice)
        return await self._action(body.node_id, f"bootDevice.{body.device}", body.tenant_id)

    async def _action(self, node_id: str, action: str, tenant_id: str | None) -> NodeActionRun:
        """One node action as a workflow of its one-step profile, started like a verb's (the
        node's BMC, no workflow running on it, not in maintenance) but leaving its lifecycle
        state alone: ``workflows.why`` and ``nodes.get`` follow it as any workflow on the node."""
        parse_id(node_id, "node", path="nodeId")
        what = {"power.on": "power it on", "power.off": "power it off", "power.cycle": "power-cycle it"}.get(
            action, "set its boot device"
        )
        async with self.api.db.transaction() as conn:
            row = await conn.fetchrow(metal_store.LOCK_NODES, [node_id])
            if row is None or (tenant_id is not None and row["tenant_id"] != tenant_id):
                raise BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
            held = refuse_maintenance(row, what)
            if held is not None:
                raise held
            if row["bmc"] is None:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"node {node_id} has no BMC: give it one (bcx nodes update {node_id} --bmc …),"
                    f" then {what}",
                    {"path": "nodeId", "reason": "no-bmc"},
                )
            busy = await conn.fetchval(store.NODE_BUSY, node_id, None)
            if busy is not None:
                raise BcError(
                    ErrorCode.INVALID_STATE,
                    f"node {node_id} runs workflow {busy}: {what} once it has finished (or abort it)",
                    {"path": "nodeId", "reason": "node-busy", "workflowId": busy},
                )
            found = await self.api.profiles.find(
                conn, tenant_id=row["tenant_id"], profile_id=ACTION_PROFILE_IDS[action], version=None
            )
            wf = await self.api.start_in(
                conn, tenant_id=row["tenant_id"], profile_id=found.profile.id,
                profile_version=found.profile.version, node_id=node_id, owner=None, found=found,
                admission=False,  # one operator's power or boot-device action: never behind a rollout
            )  # fmt: skip
        await self.api.wake(wf["rkey"])
        return NodeActionRun(
            node_id=node_id, name=row["name"], action=action, node_state=row["state"], workflow_id=wf["id"],
            profile=VerbProfile(id=found.profile.id, version=found.profile.version),
        )  # fmt: skip

    # -- enroll -----------------------------------------------------------------------

    async def enroll(self, req: ApiRequest) -> NodeView:
        """A node in ``enrolled``: new, or a ``discovered`` one given its BMC and MACs."""
        body = req.decode(EnrollNode)
        refuse_inline_secret(req)
        check_labels(body.labels)
        node_id = parse_id(body.id, "node", path="id") if body.id else new_id("node")
        async with names_unique():
            row = await self._enroll(body, node_id)
        if row["hardware"] is not None:
            await self.api.wake(queue.owner_key(DISCOVERY_OWNER, node_id))
        await node_event(self.api.publish, row, verb="enroll")
        return node_doc(row)

    async def _enroll(self, body: EnrollNode, node_id: str) -> Any:
        async with self.api.db.transaction() as conn:
            macs = await check_macs(conn, body.macs, node_id)
            await check_bmc_free(conn, _json_or_none(bmc_json(body.bmc)), node_id)
            site = await conn.fetchval(store.NODE_SITE, node_id)  # a discovered node's own
            await check_name(conn, site or body.site_id, body.name, node_id)
            row = await conn.fetchrow(
                metal_store.ENROLL_DISCOVERED, node_id, bmc_json(body.bmc), macs, json.dumps(body.labels),
                body.name,
            )  # fmt: skip
            if row is not None:  # discovered: its discovery certificates go (metal-discovery)
                await queue.queue_now(conn, queue.owner_key(DISCOVERY_OWNER, node_id))
            else:
                row = await conn.fetchrow(
                    store.CREATE_NODE, node_id, body.tenant_id, body.site_id, json.dumps(body.labels),
                    macs, bmc_json(body.bmc), body.name,
                )  # fmt: skip
            if row is None:
                raise BcError(
                    ErrorCode.CONFLICT,
                    f"node {node_id} exists (only a discovered one is enrolled again)",
                    {"path": "id"},
                )
        return row

    # -- verbs ------------------------------------------------------------------------

    def _one(self, verb: str) -> Callable[[ApiRequest], Awaitable[Any]]:
        async def handle(req: ApiRequest) -> VerbRun:
            body = req.decode(MetalVerb)
            node_id = parse_id(body.node_id, "node", path="nodeId")
            run = await self.run(
                verb, [node_id], tenant_id=body.tenant_id, image=body.image, profile_id=body.profile,
                bulk=False,
            )  # fmt: skip
            if run.refused:
                raise run.refused[0][1]
            return VerbRun(**msgspec.structs.asdict(run.started[0]), batch_id=run.batch_id)

        return handle

    async def bulk(self, req: ApiRequest) -> BulkRun:
        """One verb over many nodes under one batch; nodes in the wrong state are reported."""
        body = req.decode(BulkVerb)
        ids = await self._bulk_ids(body)
        run = await self.run(
            body.verb, sorted(set(ids)), tenant_id=body.tenant_id, image=body.image, profile_id=body.profile,
            bulk=True,
        )  # fmt: skip
        return BulkRun(
            verb=body.verb,
            batch_id=run.batch_id,
            started=run.started,
            refused=[_refusal_view(*r) for r in run.refused],
        )

    async def _bulk_ids(self, body: BulkVerb) -> list[str]:
        """The nodes a bulk verb names: its ids, or those its selector matches."""
        if (body.node_ids is None) == (body.selector is None):
            raise BcError(ErrorCode.INVALID_INPUT, "give nodeIds or a selector", {"path": "selector"})
        if body.node_ids is not None:
            ids = [parse_id(n, "node", path=f"nodeIds[{i}]") for i, n in enumerate(body.node_ids)]
        else:
            ids = await self._select(body.selector or {}, body.tenant_id)
        if not ids:
            raise BcError(ErrorCode.NOT_FOUND, "no node matches", {"path": "selector"})
        return ids

    async def _select(self, selector: dict[str, str], tenant_id: str | None) -> list[str]:
        labels = {k: v for k, v in selector.items() if k != SELECTOR_SITE}
        check_labels(labels, "selector")
        rows = await self.api.db.fetch(
            metal_store.NODES_BY_SELECTOR,
            selector.get(SELECTOR_SITE), json.dumps(labels), tenant_id, MAX_NODES_PER_BULK + 1,
        )  # fmt: skip
        if len(rows) > MAX_NODES_PER_BULK:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"the selector matches more than {MAX_NODES_PER_BULK} nodes",
                {"path": "selector"},
            )
        return [r["id"] for r in rows]

    def _refusal(self, row: Any, verb: str, tenant_id: str | None, busy: dict[str, str]) -> BcError | None:
        node_id = row["id"]
        if tenant_id is not None and row["tenant_id"] != tenant_id:
            return BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
        try:
            check_verb(node_id, row["state"], verb)
        except BcError as err:
            return err
        quarantined = refuse_quarantined(row, verb)
        if quarantined is not None:
            return quarantined
        held = refuse_maintenance(row, verb)
        if held is not None:
            return held
        if node_id in busy:  # not metal's workflow (a metal one shows in the state)
            return BcError(
                ErrorCode.INVALID_STATE,
                f"node {node_id} runs workflow {busy[node_id]}: {verb} once it has finished (or abort it)",
                {"path": "nodeId", "reason": "node-busy", "workflowId": busy[node_id]},
            )
        return None

    async def _screen(
        self, conn: Any, verb: str, ids: list[str], tenant_id: str | None, *, lock: bool
    ) -> tuple[list[Any], list[Refused]]:
        """The nodes that may take ``verb`` now, and the refused ones with their reason."""
        rows = await conn.fetch(metal_store.LOCK_NODES if lock else metal_store.NODES_BY_IDS, ids)
        found = {r["id"]: r for r in rows}
        running = await conn.fetch(metal_store.RUNNING_ON_NODES, ids)
        busy = {r["node_id"]: r["id"] for r in running}
        ok, refused = [], []
        for node_id in ids:
            row = found.get(node_id)
            err = (
                BcError(ErrorCode.NOT_FOUND, f"no node {node_id}", {"path": "nodeId"})
                if row is None
                else self._refusal(row, verb, tenant_id, busy)
            )
            if err is None:
                ok.append(row)
            else:
                # another tenant's node is "no node": its name is not told either
                name = row["name"] if row is not None and err.code is not ErrorCode.NOT_FOUND else None
                refused.append((node_id, err, name))
        return ok, refused

    async def _prepare(
        self, verb: str, ids: list[str], *, tenant_id: str | None, image: str | None, profile_id: str | None
    ) -> _Prepared:
        """Everything ``run`` checks before it changes anything: the nodes that may take
        ``verb`` and the refused ones, their one tenant, the profile resolved, the images of a
        deploy, and the batch's scope. Reads only (``plan`` is this and no more)."""
        async with self.api.db.transaction() as conn:
            ok, refused = await self._screen(conn, verb, ids, tenant_id, lock=False)
            if not ok:
                return _Prepared(ok=[], refused=refused)
            tenant = ok[0]["tenant_id"]
            for row in ok[1:]:
                if row["tenant_id"] != tenant:
                    raise BcError(
                        ErrorCode.INVALID_INPUT,
                        f"a bulk verb covers one tenant: node {row['id']} is not {tenant}'s",
                        {"path": "nodeIds"},
                    )
            found = await self.api.profiles.find(
                conn, tenant_id=tenant, profile_id=profile_id or self.profiles_of[verb], version=None
            )
            if verb == "deploy":
                await self._check_images(conn, tenant, found.profile, image)
        res = resolve_profile(self.api.app, found.profile, has_node=True)
        if res.problems:
            raise res.problems[0].to_error(problems=[p.to_document() for p in res.problems])
        names_image = found.profile.image is not None or any("image" in s.with_ for s in found.profile.steps)
        if verb == "deploy" and image is None and not names_image:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"deploy needs an image (name@version): profile {found.profile.id} names none",
                {"path": "image"},
            )
        scope = batch_kinds(self.api.app, res.command_kinds, writes_disk=found.profile.writes_disk)
        return _Prepared(
            ok=ok, refused=refused, tenant=tenant, profile=found.profile, steps=res.steps, scope=scope
        )

    async def plan(self, req: ApiRequest) -> BulkPlan:
        """What ``metal.bulk`` would do now, changing nothing: the nodes it would start and the
        state they would move to, the profile and its steps with the commands each can send
        (and which the destructive batch covers), the approvals that batch would need, and
        the nodes it would refuse with the reason. Not audited: it changes nothing."""
        body = req.decode(BulkVerb)
        ids = await self._bulk_ids(body)
        prep = await self._prepare(
            body.verb, sorted(set(ids)), tenant_id=body.tenant_id, image=body.image, profile_id=body.profile
        )
        refused = [_refusal_view(*r) for r in prep.refused]
        if prep.profile is None:
            return BulkPlan(
                verb=body.verb, profile=None, image=body.image, steps=[], commands=[], destructive=[],
                approvals=None, nodes=[], refused=refused,
            )  # fmt: skip
        profile = VerbProfile(id=prep.profile.id, version=prep.profile.version)
        steps = []
        for s in prep.steps:
            sends = [k for k in (s.command, *s.sends) if k]
            steps.append(
                PlanStep(
                    index=s.idx, action=s.action, runs_on=s.runs_on, commands=sends,
                    destructive=[k for k in sends if k in prep.scope],
                )
            )  # fmt: skip
        approvals = None
        if prep.scope and self.quorum is not None:
            quorum = await self.quorum.cmdq.quorum()  # read now: the plan shows what is in force
            if quorum.enabled:
                approvals = PlanApprovals(
                    threshold=quorum.threshold, approvers=[a.id for a in quorum.approvers]
                )
        running = TRANSITIONS[body.verb].running
        nodes = [
            PlannedNode(
                node_id=r["id"],
                name=msgspec.UNSET if r["name"] is None else r["name"],
                state=r["state"],
                becomes=running,
                profile=profile,
            )
            for r in prep.ok
        ]
        return BulkPlan(
            verb=body.verb, profile=profile, image=body.image, steps=steps,
            commands=sorted({k for s in steps for k in s.commands}), destructive=prep.scope,
            approvals=approvals,
            nodes=nodes,
            refused=refused,
        )  # fmt: skip

    async def run(
        self,
        verb: str,
        ids: list[str],
        *,
        tenant_id: str | None,
        image: str | None,
        profile_id: str | None,
        bulk: bool,
    ) -> _Run:
        """Start ``verb`` on every node of ``ids`` that may take it, under one batch."""
        transition = TRANSITIONS[verb]
        prep = await self._prepare(verb, ids, tenant_id=tenant_id, image=image, profile_id=profile_id)
        if prep.profile is None or prep.tenant is None:
            return _Run(refused=prep.refused)
        profile, tenant = prep.profile, prep.tenant
        wf_ids = {row["id"]: new_id("wf") for row in prep.ok}
        run = _Run(refused=prep.refused)
        run.batch_id = await self._batch(prep.scope, tenant, wf_ids, verb, profile.id, bulk)
        async with self.api.db.transaction() as conn:
            # again under the node locks: a node may have moved since the first look
            ok, refused = await self._screen(conn, verb, [row["id"] for row in prep.ok], tenant, lock=True)
            moved = []
            admitted: set[str] = set()  # the others wait for their site's admission
            for row in ok:
                wf = await self.api.start_in(
                    conn, tenant_id=tenant, profile_id=profile.id,
                    profile_version=profile.version, node_id=row["id"], owner="metal",
                    workflow_id=wf_ids[row["id"]], batch_id=run.batch_id,
                )  # fmt: skip
                if wf["admitted"]:
                    admitted.add(row["id"])
                node = await conn.fetchrow(
                    metal_store.BEGIN_VERB, row["id"], transition.running, wf["id"], image
                )
                moved.append(node)
                run.started.append(
                    VerbStarted(
                        node_id=row["id"], state=transition.running, workflow_id=wf["id"],
                        profile=VerbProfile(id=profile.id, version=profile.version),
                        name=row["name"] if row["name"] is not None else msgspec.UNSET,
                    )
                )  # fmt: skip
        run.refused = sorted([*run.refused, *refused], key=lambda r: r[0])
        for node in moved:
            if node["id"] in admitted:
                await self.api.wake(node["id"])
            await node_event(self.api.publish, node, verb=verb)
        return run

    async def _check_images(self, conn: Any, tenant: str, profile: Profile, image: str | None) -> None:
        """A deploy's images resolve and verify in the catalog before anything is started, so a
        missing or no longer trusted image fails the verb, not the machine after its power cycle
        (and a profile that never runs ``deploy.deploy`` checks its image all the same)."""
        provision = self.api.app.provision
        verifier = provision.image_verifier if provision is not None else None
        for ref, path in deploy_image_refs(profile, image):
            try:
                await resolve_image_ref(EngineSql(None, conn), tenant, ref, verifier=verifier)
            except BcError as err:
                raise BcError(
                    err.code,
                    f"deploy refused, nothing was started: {err.message}",
                    {**err.details, "path": path},
                ) from None

    async def _batch(
        self, kinds: list[str], tenant: str, wf_ids: dict[str, str], verb: str, profile_id: str, bulk: bool
    ) -> str | None:
        """The destructive batch of the workflows about to start, when the quorum is on and
        the profile can send kinds a batch covers (``kinds``: ``quorum.batch_kinds``); created
        before the workflows, keyed by them."""
        destructive = kinds
        if not destructive or self.quorum is None or not await self.quorum.enabled():
            return None
        first = min(wf_ids.values())
        nodes = sorted(wf_ids)
        batch = await self.quorum.cmdq.create_batch(
            tenant_id=tenant,
            kinds=destructive,
            nodes=nodes,
            ttl_seconds=BATCH_TTL_S,
            workflow_id=None if bulk else first,
            workflow_ids=sorted(wf_ids.values()) if bulk else None,
            idempotency_key=f"metal:{first}",
            note=f"metal {verb} of {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({profile_id})",
        )
        return str(batch.id)


def _json_or_none(doc: str | None) -> dict[str, Any] | None:
    return json.loads(doc) if doc is not None else None
