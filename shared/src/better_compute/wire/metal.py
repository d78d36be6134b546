"""Metal's part of the engine's contract: the node's BMC and MACs, the lifecycle verbs
(``metal.<verb>``), ``metal.bulk`` and its dry run ``metal.plan`` (camelCase on the wire).

A BMC names its credential by reference only (``credentialsRef``, a ``sec_…`` SecretRef stored
through bc-secrets). Unknown fields are ignored, as everywhere on the bus (docs/compatibility.md),
so the engine looks for a credential given inline (``bmc.password``) with ``find_inline_secret``
before it decodes a request: ``INVALID_INPUT`` at its path, never stored or logged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from better_compute.core.manifest import SECRET_REF_PATTERN
from better_compute.core.names import Name, NodeName

__all__ = [
    "BOOT_MEDIUM_LABEL",
    "MAC_PATTERN",
    "MAX_MACS",
    "MAX_NODES_PER_BULK",
    "BulkPlan",
    "BulkRefusal",
    "BulkRun",
    "BulkVerb",
    "ClearRamdisk",
    "ConfirmEnrollment",
    "CreateEnrollmentRule",
    "DeleteEnrollmentRule",
    "EnrollNode",
    "EnrollmentRuleBmc",
    "EnrollmentRuleList",
    "EnrollmentRuleView",
    "GetRamdisk",
    "ListEnrollmentRules",
    "ListPendingEnrollments",
    "Mac",
    "MetalVerb",
    "NodeAction",
    "NodeActionRun",
    "NodeBmc",
    "PendingEnrollment",
    "PendingEnrollmentList",
    "PlanApprovals",
    "PlanStep",
    "PlannedNode",
    "PowerNode",
    "RamdiskView",
    "SecretRef",
    "SetBootDevice",
    "SetRamdisk",
    "VerbName",
    "VerbProfile",
    "VerbRun",
    "VerbStarted",
    "find_inline_secret",
    "normal_mac",
]

MAC_PATTERN: Final = r"^[0-9a-fA-F]{2}([:-][0-9a-fA-F]{2}){5}$"
BOOT_MEDIUM_LABEL: Final = "BCBOOT"
"""The volume label of the boot medium the site agent builds and bcd reads (``bcd.token_from=media``)."""
MAX_MACS: Final = 16
MAX_NODES_PER_BULK: Final = 10_000
"""A batch covers at most this many nodes (the command queue's bound)."""

Mac = Annotated[str, msgspec.Meta(pattern=MAC_PATTERN)]
SecretRef = Annotated[str, msgspec.Meta(pattern=SECRET_REF_PATTERN)]
VerbName = Literal["inspect", "commission", "deploy", "release", "retire", "adopt"]
IMAGE_REF_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
ImageRef = Annotated[str, msgspec.Meta(pattern=IMAGE_REF_PATTERN)]
ProfileId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


TokenDelivery = Literal["network", "media"]
"""How ``metal.ensureRamdisk`` hands the ramdisk its join token (``NodeBmc.token_delivery``)."""


class NodeBmc(_Msg, frozen=True, kw_only=True):
    """The node's BMC: how the site agent reaches it. The password is behind ``credentials_ref``.

    The one declaration of a BMC: the engine stores it in ``nodes.bmc``, every BMC command
    carries it (``bmc``, its manifest derived from it) and the site agent's drivers take it."""

    driver: Literal["redfish", "ipmi", "sim"]
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    credentials_ref: SecretRef | None = None
    system_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    insecure: bool = False
    ca_bundle: Annotated[str, msgspec.Meta(max_length=65536)] | None = None
    """PEM certificates the BMC's TLS certificate must chain to (a public document, no secret)."""
    token_delivery: TokenDelivery | None = None
    """How the ramdisk gets its join token (``metal.ensureRamdisk``): ``network`` (absent) on
    its kernel line, ``held`` until the boot entry closes clean; ``media`` on a virtual CD the
    BMC fetches from the site agent (Redfish only), never on the boot network."""

    def __post_init__(self) -> None:
        if self.token_delivery == "media" and self.driver == "ipmi":
            raise ValueError("IPMI has no virtual media: tokenDelivery media needs a Redfish BMC")

    def to_document(self) -> dict[str, Any]:
        """As stored in ``nodes.bmc`` and relayed in BMC commands (absent fields left out)."""
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}


class EnrollNode(_Msg, frozen=True, kw_only=True):
    """``metal.enroll``: a new node in ``enrolled`` (or, with the id of a ``discovered`` node,
    that node enrolled: its BMC, MACs and labels given)."""

    site_id: Name
    id: NodeId | None = None
    tenant_id: Name = "root"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] = msgspec.field(default_factory=list)
    bmc: NodeBmc | None = None
    name: NodeName | None = None
    """Unique in the site (``CONFLICT`` at ``name`` otherwise); a discovered node keeps its own
    when none is given."""


class MetalVerb(_Msg, frozen=True, kw_only=True):
    """``metal.<verb>`` of one node; ``image`` for deploy, ``profile`` instead of the verb's."""

    node_id: NodeId
    tenant_id: Name | None = None
    image: ImageRef | None = None
    profile: ProfileId | None = None


NodeAction = Literal["power.on", "power.off", "power.cycle", "bootDevice.pxe", "bootDevice.disk"]
"""What ``metal.power`` and ``metal.bootDevice`` do: each runs its shipped one-step profile."""


class PowerNode(_Msg, frozen=True, kw_only=True):
    """``metal.power``: switch the node on or off, or power-cycle it, through its BMC (a
    workflow of the shipped ``metal.power-<action>``); its lifecycle state does not change."""

    node_id: NodeId
    action: Literal["on", "off", "cycle"]
    tenant_id: Name | None = None


class SetBootDevice(_Msg, frozen=True, kw_only=True):
    """``metal.bootDevice``: the device the node boots from next, through its BMC (a workflow of
    the shipped ``metal.boot-<device>``): ``pxe`` once, ``disk`` for good."""

    node_id: NodeId
    device: Literal["pxe", "disk"]
    tenant_id: Name | None = None


class BulkVerb(_Msg, frozen=True, kw_only=True):
    """``metal.bulk``: one verb over many nodes (ids, or a selector: ``site`` and labels), under
    one destructive batch. Nodes in the wrong state are reported, the rest go ahead."""

    verb: VerbName
    node_ids: Annotated[list[NodeId], msgspec.Meta(max_length=MAX_NODES_PER_BULK)] | None = None
    selector: Annotated[dict[str, str], msgspec.Meta(max_length=64)] | None = None
    tenant_id: Name | None = None
    image: ImageRef | None = None
    profile: ProfileId | None = None


class EnrollmentRuleBmc(NodeBmc, frozen=True, kw_only=True):
    """The BMC a rule gives the nodes it enrolls: a ``NodeBmc`` (the one BMC shape) whose
    ``address`` may hold ``{fact}`` placeholders (``{inventory.bmc_address}``); then
    ``address_cidrs`` must say where such a BMC may be, and the address filled in must be an IP
    inside one of them. ``credentials_ref`` is a template secret (``bcx enrollment-rules create
    --bmc-credentials-file``); each node gets its own copy."""

    address_cidrs: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=64)]], msgspec.Meta(max_length=64)
    ] = msgspec.field(default_factory=list)


class CreateEnrollmentRule(_Msg, frozen=True, kw_only=True):
    """``enrollmentRules.create``: a discovered node of ``tenant_id`` (at ``site_id`` when given)
    whose labels and inventory facts match ``selector`` is enrolled with ``labels`` and ``bmc``."""

    name: Name
    selector: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    tenant_id: Name = "root"
    site_id: Name | None = None
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    bmc: EnrollmentRuleBmc | None = None
    priority: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 100
    name_template: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    """The enrolled node's name from its facts (``rack1-{inventory.serial}``, ``{hostname}``),
    unique in its site; without one the node keeps the name its reported host name gave it."""


class ListEnrollmentRules(_Msg, frozen=True, kw_only=True):
    tenant_id: Name | None = None


class DeleteEnrollmentRule(_Msg, frozen=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ListPendingEnrollments(_Msg, frozen=True, kw_only=True):
    """``enrollmentRules.pending``: discovered nodes a rule would enroll with a BMC address taken
    from what the machine reported, waiting for an operator's ``enrollmentRules.confirm``."""

    tenant_id: Name | None = None
    site_id: Name | None = None


class ConfirmEnrollment(_Msg, frozen=True, kw_only=True):
    """``enrollmentRules.confirm``: an operator confirms a pending enrolment (answers the node)."""

    node_id: NodeId


_RamdiskUrl = Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s{}]+$", max_length=2048)]
_Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class SetRamdisk(_Msg, frozen=True, kw_only=True):
    """``ramdisk.set``: the bcd ramdisk the shipped lifecycle profiles boot from now on, over
    ``[ramdisk]`` of bc.toml, for every engine at once (no restart): ``kernel`` (and ``initrd``)
    with their sha256 to serve them from the site cache, or an iPXE ``script``."""

    kernel: _RamdiskUrl | None = None
    initrd: _RamdiskUrl | None = None
    kernel_sha256: _Sha256 | None = None
    initrd_sha256: _Sha256 | None = None
    cmdline: Annotated[str, msgspec.Meta(max_length=2048)] | None = None
    script: _RamdiskUrl | None = None


class GetRamdisk(_Msg, frozen=True, kw_only=True):
    """``ramdisk.get``: the ramdisk set with ``ramdisk.set``, if any."""


class ClearRamdisk(_Msg, frozen=True, kw_only=True):
    """``ramdisk.clear``: the shipped profiles boot their configured ramdisk again."""


# -- replies --------------------------------------------------------------------------


class _Reply(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class VerbProfile(_Reply, frozen=True, kw_only=True):
    id: str
    version: int


class VerbStarted(_Reply, frozen=True, kw_only=True):
    """A node the verb started on: its new (``…ing``) state and the workflow moving it."""

    node_id: str
    state: str
    workflow_id: str
    profile: VerbProfile
    name: str | msgspec.UnsetType = msgspec.UNSET
    """The node's name; absent when it has none."""


class VerbRun(VerbStarted, frozen=True, kw_only=True):
    """``metal.<verb>`` (``metal.enroll`` answers the node, a ``NodeView``)."""

    batch_id: str | None
    """The destructive batch its commands wait for (quorum on), else None."""


class NodeActionRun(_Reply, frozen=True, kw_only=True):
    """``metal.power`` / ``metal.bootDevice``: the workflow that does it (the node keeps its
    lifecycle state)."""

    node_id: str
    name: str | None = None
    action: str
    node_state: str
    workflow_id: str
    profile: VerbProfile


class BulkRefusal(_Reply, frozen=True, kw_only=True):
    """A node ``metal.bulk`` left alone, and why (the ``BcError`` it would have raised)."""

    node_id: str
    name: str | msgspec.UnsetType = msgspec.UNSET
    """The node's name; absent when it has none."""
    code: str
    message: str
    reason: str | None


class BulkRun(_Reply, frozen=True, kw_only=True):
    """``metal.bulk``: the nodes started, the nodes refused, and their one batch."""

    verb: str
    batch_id: str | None
    started: list[VerbStarted]
    refused: list[BulkRefusal]


class PlanStep(_Reply, frozen=True, kw_only=True):
    """A step of the planned profile as the workflow would persist it: where it runs, the
    command kinds it can send, and those the destructive batch covers (they wait for approvals
    when the quorum is on)."""

    index: int
    action: str
    runs_on: str
    commands: list[str]
    destructive: list[str]


class PlanApprovals(_Reply, frozen=True, kw_only=True):
    """The quorum the batch would need: ``threshold`` signatures of these approvers."""

    threshold: int
    approvers: list[str]


class PlannedNode(_Reply, frozen=True, kw_only=True):
    """A node the verb would start on: its state now, the state it would move to, the profile."""

    node_id: str
    name: str | msgspec.UnsetType = msgspec.UNSET
    """The node's name; absent when it has none."""
    state: str
    becomes: str
    profile: VerbProfile


class BulkPlan(_Reply, frozen=True, kw_only=True):
    """``metal.plan`` (a ``BulkVerb``): what ``metal.bulk`` would do now, changing nothing: no
    workflow, no batch, no command, no audit entry. ``profile`` and ``steps`` are None and empty
    when every node would be refused. ``destructive`` is the batch's scope; ``approvals`` is None
    when nothing destructive would be sent or the quorum is off (then nothing waits)."""

    verb: str
    profile: VerbProfile | None
    image: str | None
    steps: list[PlanStep]
    commands: list[str]
    destructive: list[str]
    approvals: PlanApprovals | None
    nodes: list[PlannedNode]
    refused: list[BulkRefusal]


_INLINE_SECRET: Final = re.compile(
    r"^(pass(word|wd)?|secret|credentials?|private_?key|token)$", re.IGNORECASE
)


def find_inline_secret(value: Any, path: str = "") -> str | None:
    """The path of the first key that would carry a credential inline (``password``,
    ``secret``, ``credentials``, …), or None. ``credentialsRef`` is the allowed form."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _INLINE_SECRET.match(key):
                return here
            found = find_inline_secret(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_inline_secret(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def normal_mac(mac: str) -> str:
    """``AA-BB-…`` as ``aa:bb:…``: how MACs are stored and compared."""
    return mac.lower().replace("-", ":")


class EnrollmentRuleView(_Reply, frozen=True, kw_only=True):
    """An enrollment rule (``enrollmentRules.create`` and ``delete`` answer it)."""

    id: str
    name: str
    tenant_id: str
    site_id: str | None
    selector: str
    labels: dict[str, str]
    bmc: dict[str, Any] | None
    priority: int
    created_at: str | None
    name_template: str | None = None


class EnrollmentRuleList(_Reply, frozen=True, kw_only=True):
    rules: list[EnrollmentRuleView]


class PendingEnrollment(_Reply, frozen=True, kw_only=True):
    """A discovered node a rule matched whose BMC address came from the machine's own report:
    the address is the machine's word, so an operator confirms it (issue 23, M3)."""

    node_id: str
    tenant_id: str
    site_id: str
    rule_id: str
    rule_name: str
    bmc: dict[str, Any]
    """``driver``, ``address``, ``systemId``: the BMC the node would get (no credential)."""
    macs: list[str]
    product_uuid: str | None = None
    serial: str | None = None
    since: str | None = None


class PendingEnrollmentList(_Reply, frozen=True, kw_only=True):
    nodes: list[PendingEnrollment]


class RamdiskView(_Reply, frozen=True, kw_only=True):
    """The ramdisk set with ``ramdisk.set`` (``set`` False: none; the profiles' own is used)."""

    set: bool
    kernel: str | None = None
    initrd: str | None = None
    kernel_sha256: str | None = None
    initrd_sha256: str | None = None
    cmdline: str | None = None
    script: str | None = None
    set_by: str | None = None
    since: str | None = None
