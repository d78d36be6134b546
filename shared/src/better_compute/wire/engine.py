"""The engine's contract: requests, replies and events of ``bc.api.engine.*`` (camelCase on the
wire). The client is ``better_compute.clients.EngineClient``.

Moments in replies (``createdAt``, ``startedAt``, …) are ISO 8601 text as the engine writes it.
Documents a user wrote or a step returned (a profile's ``document``, a step's ``with``,
``result``, ``error``, ``waitingFor``) stay plain JSON values.

Over 400 lines on purpose: one service's whole bus contract (Structs and bounds only) is one
module, so a reader finds every message of the engine in one place.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from ..core.names import Name, NodeName
from .metal import MAX_MACS, Mac, NodeBmc
from .paging import DEFAULT_LIMIT, Cursor, Limit

__all__ = [
    "EVENTS",
    "MAX_DOCUMENT_BYTES",
    "MAX_LABELS",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_REASON",
    "MAX_STEP_INPUT_BYTES",
    "NODE_EVENTS",
    "SERVICE",
    "BatchCreated",
    "CreateNode",
    "CreateProfile",
    "CurrentStep",
    "CurrentWorkflow",
    "DeleteNode",
    "DeleteProfile",
    "DriverOperationInfo",
    "GetNode",
    "GetProfile",
    "GetWorkflow",
    "InventorySummary",
    "LabelNode",
    "ListNodes",
    "ListPlugins",
    "ListProfiles",
    "ListSteps",
    "ListWorkflows",
    "NodeChanged",
    "NodeDeleted",
    "NodeEvent",
    "NodeList",
    "NodeRemoved",
    "NodeView",
    "PluginInfo",
    "PluginList",
    "PluginProfile",
    "Problem",
    "ProfileDeleted",
    "ProfileKey",
    "ProfileList",
    "ProfileRef",
    "ProfileRendering",
    "ProfileSummary",
    "ProfileValidation",
    "ProfileView",
    "RenderedStep",
    "SetMaintenance",
    "StartWorkflow",
    "StepChange",
    "StepChanged",
    "StepInfo",
    "StepList",
    "UpdateNode",
    "VerbApplied",
    "Why",
    "WhyAnswer",
    "WhyReason",
    "WorkflowEvent",
    "WorkflowFinished",
    "WorkflowList",
    "WorkflowProfile",
    "WorkflowStep",
    "WorkflowVerb",
    "WorkflowView",
    "decode_node_event",
    "decode_workflow_event",
]


# Bounds of free fields, checked where they enter (docs/lists-and-limits.md lists them).
MAX_LABELS: Final = 64
MAX_LABEL_KEY: Final = 63
MAX_LABEL_VALUE: Final = 256
MAX_DOCUMENT_BYTES: Final = 256 * 1024
"""A profile document, as JSON."""
MAX_STEP_INPUT_BYTES: Final = 64 * 1024
"""One step's ``with``, as JSON."""
MAX_REASON: Final = 1024
SERVICE: Final = "engine"
"""The service token of every route: ``bc.api.engine.<resource>.<verb>``."""
EVENTS: Final = "workflow"
"""The kind of the engine's events: ``bc.events.workflow.<workflow id>`` (``WorkflowEvent``)."""
NODE_EVENTS: Final = "node"
"""The kind of a node's events: ``bc.events.node.<node id>`` (``NodeEvent``)."""

Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
"""A profile's version: stored as a PostgreSQL ``int``."""


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class CreateNode(_Req, frozen=True, kw_only=True):
    site_id: Name
    id: str | None = None
    tenant_id: Name = "root"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Checked by ``check_labels``: key syntax, value size and count."""
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] = msgspec.field(default_factory=list)
    bmc: NodeBmc | None = None
    name: NodeName | None = None
    """Unique in the site (``CONFLICT`` at ``name`` otherwise)."""


class GetNode(_Req, frozen=True, kw_only=True):
    id: str


class UpdateNode(_Req, frozen=True, kw_only=True):
    """Fields given replace the node's (``labels`` all of them); the bounds of ``CreateNode``."""

    id: str
    site_id: Name | None = None
    labels: dict[str, str] | None = None
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] | None = None
    bmc: NodeBmc | None = None
    name: NodeName | None = None
    """A new name, unique in the node's (new) site; ``clear_name`` takes the name away."""
    clear_name: bool = False


class LabelNode(_Req, frozen=True, kw_only=True):
    """Set some labels and remove others; the result has the bounds of ``CreateNode``."""

    id: str
    set: dict[str, str] = msgspec.field(default_factory=dict)
    remove: Annotated[list[str], msgspec.Meta(max_length=MAX_LABELS)] = msgspec.field(default_factory=list)


class SetMaintenance(_Req, frozen=True, kw_only=True):
    """``nodes.maintenance``: put a node in maintenance (``on``) or take it out. In maintenance
    it runs no lifecycle verb and no workflow (``INVALID_STATE``, ``node-in-maintenance``)."""

    id: str
    on: bool
    reason: Annotated[str, msgspec.Meta(max_length=200)] | None = None


class DeleteNode(_Req, frozen=True, kw_only=True):
    id: str


class ListSteps(_Req, frozen=True, kw_only=True):
    """Every registered step and driver operation (a deployment has few: no paging)."""


class ListPlugins(_Req, frozen=True, kw_only=True):
    """Every plugin the engine runs (a deployment has few: no paging)."""


class ListNodes(_Req, frozen=True, kw_only=True):
    """By id; ``cursor`` is the ``next`` of the page before. ``state`` and ``labels`` (every pair
    must match) filter on the server, so a page holds only matches."""

    site_id: str | None = None
    tenant_id: str | None = None
    state: Name | None = None
    labels: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_LABELS)] | None = None
    name: NodeName | None = None
    """Only the node with this name (one per site: with ``site_id``, at most one)."""
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class CreateProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    document: dict[str, Any]
    public: bool = False
    replace: bool = False


class GetProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: Version | None = None


class DeleteProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: Version


class ListProfiles(_Req, frozen=True, kw_only=True):
    """By id, version and tenant; ``cursor`` is the ``next`` of the page before."""

    tenant_id: str = "root"
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class ProfileRef(_Req, frozen=True, kw_only=True):
    """``profiles.validate`` / ``profiles.render``: a stored profile, or a document."""

    tenant_id: str = "root"
    id: str | None = None
    version: Version | None = None
    document: dict[str, Any] | None = None


class StartWorkflow(_Req, frozen=True, kw_only=True):
    """``id``: the workflow's id, chosen by the caller (``new_id("wf")``). A start sent again
    with the same id (a retry after an answer that never came: the engine may have died between
    its commit and its reply) returns the workflow the first one made, and starts nothing;
    with other fields than the first, it is ``CONFLICT``. Without an id the engine picks one,
    and a retry would start a second workflow."""

    id: str | None = None
    tenant_id: str = "root"
    profile_id: str
    profile_version: Version | None = None
    node_id: str | None = None
    owner: str | None = None


class GetWorkflow(_Req, frozen=True, kw_only=True):
    """The workflow and its steps from the first; when the steps' results outgrow one
    reply, ``stepsNext`` in the reply is the ``steps_cursor`` of the rest."""

    id: str
    steps_cursor: Cursor | None = None


class WorkflowVerb(_Req, frozen=True, kw_only=True):
    id: str
    reason: Reason | None = None


class ListWorkflows(_Req, frozen=True, kw_only=True):
    node_id: str | None = None
    state: Literal["running", "succeeded", "failed", "aborted"] | None = None
    profile_id: str | None = None
    tenant_id: str | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""
    before: str | None = None  # workflow id: page backwards from there (before ``cursor``)


# -- replies --------------------------------------------------------------------------


class _Reply(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class InventorySummary(_Reply, frozen=True, kw_only=True):
    """What a table shows of a node's inventory: CPUs, memory, and how many disks, NICs, GPUs.
    The first three are what the node's agent reported, unchecked (any JSON value)."""

    cpu_model: Any = None
    cores: Any = None
    memory_bytes: Any = None
    disks: int | None = None
    nics: int | None = None
    gpus: int | None = None


class CurrentStep(_Reply, frozen=True, kw_only=True):
    index: int
    action: str


class CurrentWorkflow(_Reply, frozen=True, kw_only=True):
    """``nodes.get``: the workflow moving the node now, its step and what that waits for."""

    id: str
    state: str
    profile_id: str
    batch_id: str | None
    step: CurrentStep | None
    waiting_for: Any


class NodeView(_Reply, frozen=True, kw_only=True):
    """``nodes.create``, ``nodes.get``, ``nodes.update``, ``nodes.label``, ``metal.enroll``.

    Metal's part: ``state`` is the lifecycle state (``docs/metal.md``), ``stateReason`` why it
    failed, ``workflowId`` the metal workflow moving it, ``bmc`` names its credential by
    reference only. ``nodes.get`` adds ``inventory``, ``hostSection`` and ``currentWorkflow``
    (absent elsewhere).
    """

    id: str
    tenant_id: str
    site_id: str
    labels: dict[str, str]
    macs: list[str] = msgspec.field(default_factory=list)
    bmc: dict[str, Any] | None = None
    state: str = "enrolled"
    state_reason: Any = None
    workflow_id: str | None = None
    power_state: str | None = None
    image: str | None = None
    last_error: Any = None
    generation: int
    observed_generation: int
    inventory_summary: InventorySummary | None = None
    hardware: dict[str, Any] | None = None
    """What a discovered machine's bcd showed when it joined: ``productUuid``, ``serial``,
    ``macs``, ``gpuUuids``, ``hostname``, ``certId`` (docs/metal.md, Discovery)."""
    enrolled_by_rule: str | None = None
    """The enrollment rule (``rule_…``) that enrolled this discovered node; None when an
    operator did, or nobody yet."""
    quarantine: dict[str, Any] | None = None
    """Set when the node's ramdisk join token was seen twice on the boot network (``reason``
    ``boot-entry-fetched-twice`` or ``second-join``, ``message``, ``joinTokenId``, ``mac``,
    ``at``): its workflow was aborted and only inspect or retire start on it (docs/metal.md)."""
    maintenance: dict[str, Any] | None = None
    """Set while the node is in maintenance (``reason``, ``by``: who set it, ``at``): it runs no
    lifecycle verb and no workflow until taken out (``nodes.maintenance``)."""
    discovery_conflict: dict[str, Any] | None = None
    """The latest discovery that showed this node's hardware with other claims (``claims``,
    ``certId``, ``agentId``, ``at``): recorded, never applied without an operator."""
    pending_enrollment: dict[str, Any] | None = None
    """A rule's enrolment waiting for an operator's confirmation (its BMC address came from the
    machine's report): ``ruleId``, ``ruleName``, ``bmc``, ``at`` (``bcx enrollment-rules confirm``)."""
    name: str | None = None
    """The operator's name for the node, unique in its site; bcx takes it wherever it takes
    the node's id."""
    bmc_inventory: dict[str, Any] | None = None
    """What the node's BMC says of the machine (``system``: maker, model, serial, UUID, power;
    ``processors``, ``memory``, ``nics``), as the ``metal.enroll`` profile read it; None before."""
    created_at: str | None
    updated_at: str | None = None
    inventory: Any | msgspec.UnsetType = msgspec.UNSET
    host_section: Any | msgspec.UnsetType = msgspec.UNSET
    current_workflow: CurrentWorkflow | msgspec.UnsetType | None = msgspec.UNSET


class NodeList(_Reply, frozen=True, kw_only=True):
    nodes: list[NodeView]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class NodeDeleted(_Reply, frozen=True, kw_only=True):
    deleted: str
    """The id of the node."""


class StepInfo(_Reply, frozen=True, kw_only=True):
    """A registered step, as ``steps.list`` shows it; ``input`` is its JSON Schema."""

    id: str
    runs_on: str
    relays: list[str]
    command: str | None
    sends: list[str]
    timeout_ms: int
    retry_safe: bool
    description: str
    input: dict[str, Any]
    retry: Any = None
    """The step's default retry policy (``{attempts, backoff, maxBackoff, on}``), or None."""
    plugin: str | None = None
    """The plugin or module that lends the step (``metal``, ``acme``); None for provision's own."""


class PluginProfile(_Reply, frozen=True, kw_only=True):
    id: str
    version: int


class PluginInfo(_Reply, frozen=True, kw_only=True):
    """A plugin as the engine that answers loaded it: what runs, not what is installed on disk."""

    id: str
    description: str
    source: Literal["entry-point", "app"]
    """``entry-point``: discovered under ``better_compute.plugins``; ``app``: listed in the app."""
    entry_point: str | None = None
    """The entry point's name and what it names (``acme = acme_plugin:plugin``)."""
    target: str | None = None
    distribution: str | None = None
    """The installed package that declares the entry point, and its version."""
    version: str | None = None
    lent: bool = False
    """Whether provision borrows it: only then do its steps and profiles resolve."""
    steps: list[str] = msgspec.field(default_factory=list)
    profiles: list[PluginProfile] = msgspec.field(default_factory=list)
    config_units: list[str] = msgspec.field(default_factory=list)
    image_signers: list[str] = msgspec.field(default_factory=list)
    command_kinds: list[str] = msgspec.field(default_factory=list)
    driver_operations: list[str] = msgspec.field(default_factory=list)


class PluginList(_Reply, frozen=True, kw_only=True):
    plugins: list[PluginInfo]


class DriverOperationInfo(_Reply, frozen=True, kw_only=True):
    name: str
    description: str
    input: dict[str, Any]


class StepList(_Reply, frozen=True, kw_only=True):
    steps: list[StepInfo]
    driver_operations: list[DriverOperationInfo]


class _ProfileHead(_Reply, frozen=True, kw_only=True):
    tenant_id: str
    id: str
    version: int
    public: bool
    shipped: bool
    immutable: bool
    first_used_at: str | None


class ProfileView(_ProfileHead, frozen=True, kw_only=True):
    """``profiles.create``, ``profiles.get``: a stored or shipped profile."""

    document: dict[str, Any]


class ProfileSummary(_ProfileHead, frozen=True, kw_only=True):
    """One profile of ``profiles.list``: its document left out, its step count and target."""

    steps: int
    target: str | None


class ProfileList(_Reply, frozen=True, kw_only=True):
    profiles: list[ProfileSummary]
    next: str | None = None


class ProfileDeleted(_Reply, frozen=True, kw_only=True):
    deleted: bool


class Problem(_Reply, frozen=True, kw_only=True):
    """Why a profile does not resolve, at ``path`` in its document."""

    path: str
    code: str
    message: str


class ProfileKey(_Reply, frozen=True, kw_only=True):
    id: str
    version: int


class ProfileValidation(_Reply, frozen=True, kw_only=True):
    """``profiles.validate``; ``profile`` and ``commandKinds`` are absent when the document
    did not even parse (its one problem says why)."""

    valid: bool
    profile: ProfileKey | msgspec.UnsetType = msgspec.UNSET
    problems: list[Problem]
    command_kinds: list[str] | msgspec.UnsetType = msgspec.UNSET


class RenderedStep(_Reply, frozen=True, kw_only=True):
    """One expanded step, as a workflow would persist it."""

    index: int
    action: str
    runs_on: str
    mode: str
    command: str | None
    input: dict[str, Any] = msgspec.field(name="with")
    timeout_ms: int
    via: str
    sends: list[str]
    retry: Any = None
    """The retry policy the step would run under (``{attempts, backoff, maxBackoff, on,
    backoffMs, maxBackoffMs}``), or None."""


class ProfileRendering(_Reply, frozen=True, kw_only=True):
    profile: ProfileKey
    steps: list[RenderedStep]
    command_kinds: list[str]


class WorkflowProfile(_Reply, frozen=True, kw_only=True):
    tenant_id: str
    id: str
    version: int


class WorkflowStep(_Reply, frozen=True, kw_only=True):
    index: int
    action: str
    runs_on: str
    mode: str
    command: str | None
    state: str
    attempt: int
    started_at: str | None
    deadline: str | None
    finished_at: str | None
    result: Any
    error: Any
    """``{code, message, details}`` of a failed step, else None."""
    command_id: str | None
    waiting_for: Any
    """What a pending or running step waits for; None otherwise."""
    retry: Any = None
    """The step's retry policy (``{attempts, backoff, maxBackoff, on, …}``), or None."""
    retry_at: str | None = None
    """When a step its policy retries starts its next attempt (while it is pending)."""
    attempts: list[Any] = msgspec.field(default_factory=list)
    """Its earlier failed attempts, oldest first: ``{attempt, startedAt, finishedAt, error,
    retryAt?}`` (``retryAt`` when the policy retried it)."""


class WorkflowView(_Reply, frozen=True, kw_only=True):
    """A workflow. ``steps`` is there in ``workflows.get``, ``workflows.start`` and the verbs,
    absent in ``workflows.list``; ``stepsNext`` (``workflows.get``, the verbs) is the
    ``stepsCursor`` of the steps that did not fit, or None. ``queued``: a running workflow that
    waits for its site's admission (``[engine] site_admission``), no step started yet."""

    id: str
    tenant_id: str
    node_id: str | None
    profile: WorkflowProfile
    state: str
    owner: str | None
    command_kinds: list[str]
    batch_id: str | None
    error: Any
    created_at: str | None
    finished_at: str | None
    steps: list[WorkflowStep] | msgspec.UnsetType = msgspec.UNSET
    steps_next: str | msgspec.UnsetType | None = msgspec.UNSET
    queued: bool = False


class WorkflowList(_Reply, frozen=True, kw_only=True):
    workflows: list[WorkflowView]
    next: str | None = None


class Why(_Req, frozen=True, kw_only=True):
    """``workflows.why``: what a node's or a workflow's current step waits for. ``id`` is a
    node id (its running workflow, else its latest) or a workflow id."""

    id: str


class WhyReason(_Reply, frozen=True, kw_only=True):
    """One thing the step waits for, read from the stores.

    ``kind``: ``no-agent`` (no connected agent at the command's site), ``command`` (a command
    pending, dispatched or running), ``agent-away`` (a command a node's own agent took, that
    agent no longer connected), ``batch-approval``, ``step-not-ready`` (the step's own
    reason), ``command-wait`` (a control-plane step waits for its command to end, when that
    command is not said as live above), ``service-unavailable``, ``previous-attempt-running``,
    ``retry-backoff``, ``running`` (a control-plane step running in the engine), ``deadline``,
    ``bmc-error`` (the node's last failed command, as its agent reported it), ``finished``,
    ``left`` (what a failed or aborted lifecycle verb left on its node and what to run next),
    ``idle``, ``quarantined`` (the node's ramdisk token was seen twice: first, before the rest),
    ``queued`` (the workflow waits for its site's admission: how many run, how many wait before it)."""

    kind: str
    text: str
    facts: dict[str, Any] = msgspec.field(default_factory=dict)


class WhyAnswer(_Reply, frozen=True, kw_only=True):
    """``workflows.why``: ``answer`` is the one sentence; ``reasons`` its parts."""

    node_id: str | None
    workflow_id: str | None
    workflow_state: str | None
    step: CurrentStep | None = None
    attempt: int | None = None
    waiting: bool
    answer: str
    reasons: list[WhyReason]
    node_name: str | None = None
    """The node's name, when it has one."""


# -- events on bc.events.workflow.<id> ----------------------------------------------------
#
# A wake-up, never the truth: a reader that missed one reads the workflow. Each carries its
# kind in ``event`` (the tag); readers decode ``WorkflowEvent`` once and ``match`` on it.


class _Event(msgspec.Struct, frozen=True, kw_only=True, rename="camel", tag_field="event"):
    pass


class StepChange(_Reply, frozen=True, kw_only=True):
    index: int
    action: str
    state: str
    attempt: int
    error: Any | msgspec.UnsetType = msgspec.UNSET
    """``{code, message}`` when the step failed."""
    waiting_for: Any | msgspec.UnsetType = msgspec.UNSET
    """What a pending or running step waits for, when it waits."""


class StepChanged(_Event, frozen=True, kw_only=True, tag="step"):
    """A step started, settled or waits for something new."""

    workflow_id: str
    node_id: str | None
    workflow_state: str
    at: float
    step: StepChange


class WorkflowFinished(_Event, frozen=True, kw_only=True, tag="finished"):
    """The workflow ended: ``workflow_state`` is succeeded, failed or aborted."""

    workflow_id: str
    node_id: str | None
    workflow_state: str
    at: float


class BatchCreated(_Event, frozen=True, kw_only=True, tag="batch"):
    """The workflow's destructive commands wait for the approval of ``batch_id``."""

    workflow_id: str
    batch_id: str
    at: float


class VerbApplied(_Event, frozen=True, kw_only=True, tag="verb"):
    """An operator aborted, retried or resumed the workflow."""

    workflow_id: str
    workflow_state: str
    verb: Literal["abort", "retry", "resume"]


WorkflowEvent = StepChanged | WorkflowFinished | BatchCreated | VerbApplied

_workflow_events = msgspec.json.Decoder(WorkflowEvent)


def decode_workflow_event(data: bytes) -> WorkflowEvent | None:
    """The event in ``data``, or None for anything that is not one (a reader just reads the
    workflow then)."""
    try:
        return _workflow_events.decode(data)
    except msgspec.MsgspecError:
        return None


# -- events on bc.events.node.<id> --------------------------------------------------------
#
# Every change of a node, as a wake-up: ``nodes.get`` is the truth.


class NodeChanged(_Event, frozen=True, kw_only=True, tag="changed"):
    """The node was created, updated, labelled, moved state, or has a new generation, observed
    generation or power; ``verb`` names the request that changed it, when one did."""

    node_id: str
    state: str
    workflow_id: str | None
    generation: int
    observed_generation: int
    power_state: str | None
    verb: str | msgspec.UnsetType = msgspec.UNSET


class NodeRemoved(_Event, frozen=True, kw_only=True, tag="deleted"):
    """``nodes.delete`` forgot the node."""

    node_id: str
    deleted: bool = True


NodeEvent = NodeChanged | NodeRemoved

_node_events = msgspec.json.Decoder(NodeEvent)


def decode_node_event(data: bytes) -> NodeEvent | None:
    """The event in ``data``, or None for anything that is not one."""
    try:
        return _node_events.decode(data)
    except msgspec.MsgspecError:
        return None
