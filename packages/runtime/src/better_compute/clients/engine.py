"""The client of bc-engine: nodes, steps, profiles, workflows, metal's verbs and images.

The routes and their Structs are ``better_compute.wire.engine`` (metal's in ``wire.metal``, the
image catalog's in ``wire.images``); every method takes keyword arguments only and returns the
reply as a Struct.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from ..core.errors import BcError, ErrorCode
from ..core.ids import new_id
from ..wire.engine import (
    SERVICE,
    CreateNode,
    CreateProfile,
    DeleteNode,
    DeleteProfile,
    GetNode,
    GetProfile,
    GetWorkflow,
    LabelNode,
    ListNodes,
    ListPlugins,
    ListProfiles,
    ListSteps,
    ListWorkflows,
    NodeDeleted,
    NodeList,
    NodeView,
    PluginList,
    ProfileDeleted,
    ProfileList,
    ProfileRef,
    ProfileRendering,
    ProfileValidation,
    ProfileView,
    SetMaintenance,
    StartWorkflow,
    StepList,
    UpdateNode,
    Why,
    WhyAnswer,
    WorkflowList,
    WorkflowStep,
    WorkflowVerb,
    WorkflowView,
)
from ..wire.images import (
    AddImageSigner,
    DeleteImage,
    GetImage,
    ImageDeleted,
    ImageFormat,
    ImageList,
    ImageSignerList,
    ImageSignerView,
    ImageView,
    ListImages,
    ListImageSigners,
    RegisterImage,
    RemoveImageSigner,
)
from ..wire.metal import (
    BulkPlan,
    BulkRun,
    BulkVerb,
    ClearRamdisk,
    ConfirmEnrollment,
    CreateEnrollmentRule,
    DeleteEnrollmentRule,
    EnrollmentRuleBmc,
    EnrollmentRuleList,
    EnrollmentRuleView,
    EnrollNode,
    GetRamdisk,
    ListEnrollmentRules,
    ListPendingEnrollments,
    MetalVerb,
    NodeActionRun,
    NodeBmc,
    PendingEnrollmentList,
    PowerNode,
    RamdiskView,
    SetBootDevice,
    SetRamdisk,
    VerbName,
    VerbRun,
)
from ..wire.paging import DEFAULT_LIMIT
from ._base import ServiceClient

__all__ = ["EngineClient"]

WorkflowState = Literal["running", "succeeded", "failed", "aborted"]

START_TRIES = 3
"""How often ``start_workflow`` asks when no answer comes (each waits the client's timeout)."""


class EngineClient(ServiceClient):
    """Calls to bc-engine over NATS; raises the service's ``BcError``s."""

    service = SERVICE

    # -- nodes ------------------------------------------------------------------

    async def create_node(
        self,
        *,
        site_id: str,
        id: str | None = None,
        tenant_id: str = "root",
        labels: Mapping[str, str] | None = None,
        macs: list[str] | None = None,
        bmc: NodeBmc | None = None,
        name: str | None = None,
    ) -> NodeView:
        req = CreateNode(
            site_id=site_id,
            id=id,
            tenant_id=tenant_id,
            labels=dict(labels or {}),
            macs=list(macs or []),
            bmc=bmc,
            name=name,
        )
        return await self._call("nodes.create", req, NodeView)

    async def get_node(self, *, id: str) -> NodeView:
        return await self._call("nodes.get", GetNode(id=id), NodeView)

    async def list_nodes(
        self,
        *,
        site_id: str | None = None,
        tenant_id: str | None = None,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
        name: str | None = None,
    ) -> NodeList:
        """One page of nodes by id (of a site, tenant, state, with labels, with a name); pass its
        ``next`` as ``cursor`` for the next."""
        req = ListNodes(
            site_id=site_id, tenant_id=tenant_id, state=state, labels=labels, limit=limit, cursor=cursor,
            name=name,
        )  # fmt: skip
        return await self._call("nodes.list", req, NodeList)

    async def update_node(
        self,
        *,
        id: str,
        site_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        macs: list[str] | None = None,
        bmc: NodeBmc | None = None,
        name: str | None = None,
        clear_name: bool = False,
    ) -> NodeView:
        """Replace the node's site, all its labels, its MACs, its BMC and/or its name (unset:
        unchanged; ``clear_name`` takes the name away)."""
        req = UpdateNode(
            id=id,
            site_id=site_id,
            labels=dict(labels) if labels is not None else None,
            macs=list(macs) if macs is not None else None,
            bmc=bmc,
            name=name,
            clear_name=clear_name,
        )
        return await self._call("nodes.update", req, NodeView)

    async def label_node(
        self, *, id: str, set: Mapping[str, str] | None = None, remove: list[str] | None = None
    ) -> NodeView:
        """Set some labels and remove others in one step."""
        req = LabelNode(id=id, set=dict(set or {}), remove=list(remove or []))
        return await self._call("nodes.label", req, NodeView)

    async def set_maintenance(self, *, id: str, on: bool, reason: str | None = None) -> NodeView:
        """Put a node in maintenance or take it out (``nodes.maintenance``)."""
        return await self._call("nodes.maintenance", SetMaintenance(id=id, on=on, reason=reason), NodeView)

    async def delete_node(self, *, id: str) -> NodeDeleted:
        return await self._call("nodes.delete", DeleteNode(id=id), NodeDeleted)

    # -- steps and profiles ---------------------------------------------------------

    async def list_steps(self) -> StepList:
        """Every registered step and driver operation, with its input's JSON Schema."""
        return await self._call("steps.list", ListSteps(), StepList)

    async def list_plugins(self) -> PluginList:
        """Every plugin the engine runs, with its steps, profiles, config units and image signers."""
        return await self._call("plugins.list", ListPlugins(), PluginList)

    async def create_profile(
        self,
        *,
        document: Mapping[str, Any],
        tenant_id: str = "root",
        public: bool = False,
        replace: bool = False,
    ) -> ProfileView:
        req = CreateProfile(tenant_id=tenant_id, document=dict(document), public=public, replace=replace)
        return await self._call("profiles.create", req, ProfileView)

    async def get_profile(
        self, *, id: str, version: int | None = None, tenant_id: str = "root"
    ) -> ProfileView:
        """The profile (its latest version without ``version``), the tenant's or a public one."""
        req = GetProfile(tenant_id=tenant_id, id=id, version=version)
        return await self._call("profiles.get", req, ProfileView)

    async def list_profiles(
        self, *, tenant_id: str = "root", limit: int = DEFAULT_LIMIT, cursor: str | None = None
    ) -> ProfileList:
        req = ListProfiles(tenant_id=tenant_id, limit=limit, cursor=cursor)
        return await self._call("profiles.list", req, ProfileList)

    async def delete_profile(self, *, id: str, version: int, tenant_id: str = "root") -> ProfileDeleted:
        req = DeleteProfile(tenant_id=tenant_id, id=id, version=version)
        return await self._call("profiles.delete", req, ProfileDeleted)

    async def validate_profile(
        self,
        *,
        id: str | None = None,
        version: int | None = None,
        document: Mapping[str, Any] | None = None,
        tenant_id: str = "root",
    ) -> ProfileValidation:
        """Every problem of a stored profile (``id``) or of a ``document``, each at its path."""
        req = _ref(id=id, version=version, document=document, tenant_id=tenant_id)
        return await self._call("profiles.validate", req, ProfileValidation)

    async def render_profile(
        self,
        *,
        id: str | None = None,
        version: int | None = None,
        document: Mapping[str, Any] | None = None,
        tenant_id: str = "root",
    ) -> ProfileRendering:
        """The steps a workflow of the profile would run, expanded."""
        req = _ref(id=id, version=version, document=document, tenant_id=tenant_id)
        return await self._call("profiles.render", req, ProfileRendering)

    # -- workflows ----------------------------------------------------------------

    async def start_workflow(
        self,
        *,
        profile_id: str,
        profile_version: int | None = None,
        node_id: str | None = None,
        owner: str | None = None,
        tenant_id: str = "root",
        id: str | None = None,
    ) -> WorkflowView:
        """Start a workflow with id ``id`` (a new one when not given). An answer that does not
        come (``TIMEOUT``: the engine may have died after its commit) is asked again with the
        same id, which the engine answers with the workflow the first start made: a start is
        never lost and never made twice."""
        req = StartWorkflow(
            id=id or new_id("wf"),
            tenant_id=tenant_id,
            profile_id=profile_id,
            profile_version=profile_version,
            node_id=node_id,
            owner=owner,
        )
        for _ in range(START_TRIES - 1):
            try:
                return await self._call("workflows.start", req, WorkflowView)
            except BcError as err:
                if err.code is not ErrorCode.TIMEOUT:
                    raise
        return await self._call("workflows.start", req, WorkflowView)

    async def get_workflow(self, *, id: str, steps_cursor: str | None = None) -> WorkflowView:
        """The workflow with the steps that fit in one reply (from ``steps_cursor`` on);
        ``steps_next`` is the cursor of the rest. ``workflow`` fetches them all."""
        return await self._call("workflows.get", GetWorkflow(id=id, steps_cursor=steps_cursor), WorkflowView)

    async def workflow(self, *, id: str) -> WorkflowView:
        """The workflow with every step, over as many replies as its steps' results take."""
        first = await self.get_workflow(id=id)
        steps = list(first.steps or [])
        cursor = first.steps_next or None
        while cursor is not None:
            more = await self.get_workflow(id=id, steps_cursor=cursor)
            steps += more.steps or []
            cursor = more.steps_next or None
        return _with_steps(first, steps)

    async def list_workflows(
        self,
        *,
        node_id: str | None = None,
        state: WorkflowState | None = None,
        profile_id: str | None = None,
        tenant_id: str | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
        before: str | None = None,
    ) -> WorkflowList:
        """One page of workflows, newest first; pass its ``next`` as ``cursor`` for the next."""
        req = ListWorkflows(
            node_id=node_id,
            state=state,
            profile_id=profile_id,
            tenant_id=tenant_id,
            limit=limit,
            cursor=cursor,
            before=before,
        )
        return await self._call("workflows.list", req, WorkflowList)

    async def why(self, *, id: str) -> WhyAnswer:
        """What the current step of a node's workflow (``node_…``: its running one, else its
        latest) or of a workflow (``wf_…``) waits for: one sentence and its parts."""
        return await self._call("workflows.why", Why(id=id), WhyAnswer)

    async def abort_workflow(self, *, id: str, reason: str | None = None) -> WorkflowView:
        return await self._call("workflows.abort", WorkflowVerb(id=id, reason=reason), WorkflowView)

    async def retry_workflow(self, *, id: str, reason: str | None = None) -> WorkflowView:
        """A failed workflow runs its failed step again, as a new attempt."""
        return await self._call("workflows.retry", WorkflowVerb(id=id, reason=reason), WorkflowView)

    async def resume_workflow(self, *, id: str, reason: str | None = None) -> WorkflowView:
        """An aborted workflow carries on from the step the abort cancelled."""
        return await self._call("workflows.resume", WorkflowVerb(id=id, reason=reason), WorkflowView)

    # -- metal ----------------------------------------------------------------------

    async def enroll_node(
        self,
        *,
        site_id: str,
        id: str | None = None,
        tenant_id: str = "root",
        labels: Mapping[str, str] | None = None,
        macs: list[str] | None = None,
        bmc: NodeBmc | None = None,
        name: str | None = None,
    ) -> NodeView:
        """A node in ``enrolled``: new, or the ``discovered`` node ``id`` given its BMC and MACs.
        The BMC names its credential by reference (``credentials_ref``) only; ``name`` is
        unique in the site."""
        req = EnrollNode(
            site_id=site_id,
            id=id,
            tenant_id=tenant_id,
            labels=dict(labels or {}),
            macs=list(macs or []),
            bmc=bmc,
            name=name,
        )
        return await self._call("metal.enroll", req, NodeView)

    async def run_verb(
        self,
        verb: VerbName,
        *,
        node_id: str,
        tenant_id: str | None = None,
        image: str | None = None,
        profile: str | None = None,
    ) -> VerbRun:
        """``metal.<verb>`` of one node: its workflow, and the batch its commands wait for."""
        req = MetalVerb(node_id=node_id, tenant_id=tenant_id, image=image, profile=profile)
        return await self._call(f"metal.{verb}", req, VerbRun)

    async def power(
        self, *, node_id: str, action: Literal["on", "off", "cycle"], tenant_id: str | None = None
    ) -> NodeActionRun:
        """``metal.power``: switch the node on or off, or power-cycle it (a workflow)."""
        req = PowerNode(node_id=node_id, action=action, tenant_id=tenant_id)
        return await self._call("metal.power", req, NodeActionRun)

    async def set_boot_device(
        self, *, node_id: str, device: Literal["pxe", "disk"], tenant_id: str | None = None
    ) -> NodeActionRun:
        """``metal.bootDevice``: the node boots from ``device`` next (pxe once, disk for good)."""
        req = SetBootDevice(node_id=node_id, device=device, tenant_id=tenant_id)
        return await self._call("metal.bootDevice", req, NodeActionRun)

    async def bulk(
        self,
        verb: VerbName,
        *,
        node_ids: list[str] | None = None,
        selector: Mapping[str, str] | None = None,
        tenant_id: str | None = None,
        image: str | None = None,
        profile: str | None = None,
    ) -> BulkRun:
        """One verb over many nodes (``node_ids`` or a ``selector``), under one batch."""
        req = _bulk_verb(verb, node_ids, selector, tenant_id, image, profile)
        return await self._call("metal.bulk", req, BulkRun)

    async def plan_bulk(
        self,
        verb: VerbName,
        *,
        node_ids: list[str] | None = None,
        selector: Mapping[str, str] | None = None,
        tenant_id: str | None = None,
        image: str | None = None,
        profile: str | None = None,
    ) -> BulkPlan:
        """What ``bulk`` would do now (profile, steps, commands, approvals, refusals), changing
        nothing."""
        req = _bulk_verb(verb, node_ids, selector, tenant_id, image, profile)
        return await self._call("metal.plan", req, BulkPlan)

    # -- enrollment rules -----------------------------------------------------------------

    async def create_enrollment_rule(
        self,
        *,
        name: str,
        selector: str,
        tenant_id: str = "root",
        site_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        bmc: EnrollmentRuleBmc | None = None,
        priority: int = 100,
        name_template: str | None = None,
    ) -> EnrollmentRuleView:
        """A rule that enrolls the discovered nodes it matches (docs/metal.md)."""
        req = CreateEnrollmentRule(
            name=name, selector=selector, tenant_id=tenant_id, site_id=site_id,
            labels=dict(labels or {}), bmc=bmc, priority=priority, name_template=name_template,
        )  # fmt: skip
        return await self._call("enrollmentRules.create", req, EnrollmentRuleView)

    async def list_enrollment_rules(self, *, tenant_id: str | None = None) -> EnrollmentRuleList:
        """The rules, in the order they are tried (priority, then name)."""
        return await self._call(
            "enrollmentRules.list", ListEnrollmentRules(tenant_id=tenant_id), EnrollmentRuleList
        )

    async def delete_enrollment_rule(self, *, id: str) -> EnrollmentRuleView:
        """Delete a rule (nodes it enrolled stay enrolled); answers the rule as it was."""
        return await self._call("enrollmentRules.delete", DeleteEnrollmentRule(id=id), EnrollmentRuleView)

    async def pending_enrollments(
        self, *, tenant_id: str | None = None, site_id: str | None = None
    ) -> PendingEnrollmentList:
        """Discovered nodes a rule would enroll with a BMC address from the machine's own report."""
        req = ListPendingEnrollments(tenant_id=tenant_id, site_id=site_id)
        return await self._call("enrollmentRules.pending", req, PendingEnrollmentList)

    async def confirm_enrollment(self, *, node_id: str) -> NodeView:
        """Enroll a node whose rule enrolment waits for an operator, as the rule would."""
        return await self._call("enrollmentRules.confirm", ConfirmEnrollment(node_id=node_id), NodeView)

    # -- images ---------------------------------------------------------------------

    async def register_image(
        self,
        *,
        name: str,
        version: str,
        url: str,
        sha256: str,
        signature: bytes,
        signer: str | None = None,
        format: ImageFormat = "raw",
        size: int | None = None,
        public: bool = False,
        tenant_id: str = "root",
    ) -> ImageView:
        """Add ``name@version`` to the catalog (the same image again is a no-op)."""
        req = RegisterImage(
            tenant_id=tenant_id, name=name, version=version, url=url, sha256=sha256, format=format,
            size=size, signer=signer, signature=signature, public=public,
        )  # fmt: skip
        return await self._call("images.register", req, ImageView)

    async def get_image(self, *, ref: str, tenant_id: str = "root") -> ImageView:
        """``name@version`` as the tenant resolves it, with its ``signer_status``."""
        return await self._call("images.get", GetImage(tenant_id=tenant_id, ref=ref), ImageView)

    async def list_images(
        self,
        *,
        name: str | None = None,
        tenant_id: str = "root",
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
    ) -> ImageList:
        """One page of the tenant's own and public images, by name and version."""
        req = ListImages(tenant_id=tenant_id, name=name, limit=limit, cursor=cursor)
        return await self._call("images.list", req, ImageList)

    async def delete_image(self, *, ref: str, tenant_id: str = "root") -> ImageDeleted:
        return await self._call("images.delete", DeleteImage(tenant_id=tenant_id, ref=ref), ImageDeleted)

    async def add_image_signer(self, *, id: str, public_key: str) -> ImageSignerView:
        """Allowlist a signer now, for every engine (no restart; docs/images.md)."""
        return await self._call(
            "images.signers.add", AddImageSigner(id=id, public_key=public_key), ImageSignerView
        )

    async def remove_image_signer(self, *, id: str) -> ImageSignerView:
        """Take an operator's signer off the allowlist now; answers it as it was."""
        return await self._call("images.signers.remove", RemoveImageSigner(id=id), ImageSignerView)

    async def set_ramdisk(self, ramdisk: SetRamdisk) -> RamdiskView:
        """The ramdisk the shipped lifecycle profiles boot from now on, every engine, no restart."""
        return await self._call("ramdisk.set", ramdisk, RamdiskView)

    async def get_ramdisk(self) -> RamdiskView:
        """The ramdisk set with ``set_ramdisk``, if any (``set`` False: none)."""
        return await self._call("ramdisk.get", GetRamdisk(), RamdiskView)

    async def clear_ramdisk(self) -> RamdiskView:
        """Back to the profiles' own ramdisk."""
        return await self._call("ramdisk.clear", ClearRamdisk(), RamdiskView)

    async def list_image_signers(self) -> ImageSignerList:
        """Every allowlisted signer, configured or an operator's."""
        return await self._call("images.signers.list", ListImageSigners(), ImageSignerList)


def _ref(
    *, id: str | None, version: int | None, document: Mapping[str, Any] | None, tenant_id: str
) -> ProfileRef:
    """A stored profile (``id``, ``version``) or a ``document``."""
    return ProfileRef(
        tenant_id=tenant_id, id=id, version=version, document=dict(document) if document is not None else None
    )


def _with_steps(view: WorkflowView, steps: list[WorkflowStep]) -> WorkflowView:
    return msgspec.structs.replace(view, steps=steps, steps_next=None)


def _bulk_verb(
    verb: VerbName,
    node_ids: list[str] | None,
    selector: Mapping[str, str] | None,
    tenant_id: str | None,
    image: str | None,
    profile: str | None,
) -> BulkVerb:
    """The one request ``bulk`` and ``plan_bulk`` send (``metal.bulk`` / ``metal.plan``)."""
    return BulkVerb(
        verb=verb,
        node_ids=list(node_ids) if node_ids is not None else None,
        selector=dict(selector) if selector is not None else None,
        tenant_id=tenant_id,
        image=image,
        profile=profile,
    )
