"""The payloads and results of metal's command kinds: the site agent's and bcd's contract.

Each command kind's payload is one Struct here, from the step (or ``bcx``) that builds it to the
driver that runs it: the command queue checks a payload with the manifest derived from it
(``better_compute.metal.commands``, ``wire.schema.manifest_of``), the agent decodes it once
(``decode_payload``), a site agent's driver takes it as it is, and the result goes back as a
Struct that the engine decodes once (``decode_result``): the site agent's and bcd's alike.
camelCase on the wire.

A BMC command's ``bmc`` is the node's ``NodeBmc`` (the engine fills it from the node record when
the step gives none), so it is optional in the payload, and the agent refuses a command without
one. ``management.inventory`` and ``management.validate`` require it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from ..core.errors import BcError
from ..core.manifest import SECRET_REF_PATTERN
from ..core.plugins import DOTTED_NAME_PATTERN
from .codec import convert
from .metal import NodeBmc

__all__ = [
    "PAYLOADS",
    "RESULTS",
    "BmcCheck",
    "BmcInventory",
    "BmcInventoryResult",
    "BmcMemory",
    "BmcNic",
    "BmcProcessor",
    "BmcSystem",
    "BootDeviceResult",
    "ClearEntry",
    "ClearEntryResult",
    "ConfigDrivePlaced",
    "ConvergeResult",
    "ConvergeUnit",
    "DiskWiped",
    "DriverInvoke",
    "HttpProxy",
    "ImageWriteResult",
    "MediaEject",
    "MediaInsert",
    "MediaResult",
    "NodeConverge",
    "NodeCpus",
    "NodeDisk",
    "NodeFirmware",
    "NodeGpu",
    "NodeImageWrite",
    "NodeInventory",
    "NodeInventoryResult",
    "NodeMemory",
    "NodeNic",
    "NodeWipe",
    "PowerAction",
    "PowerResult",
    "SetBootDevice",
    "SetEntry",
    "SetEntryResult",
    "SetPower",
    "UnitReport",
    "ValidateBmc",
    "ValidateResult",
    "WipeResult",
    "decode_payload",
    "decode_result",
    "payload_document",
]

S = TypeVar("S", bound=msgspec.Struct)

Url = Annotated[str, msgspec.Meta(pattern=r"^https?://\S+$", max_length=4096)]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
SecretRef = Annotated[str, msgspec.Meta(pattern=SECRET_REF_PATTERN)]
Mac = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{2}([:-][0-9a-fA-F]{2}){5}$")]
DevicePath = Annotated[str, msgspec.Meta(pattern=r"^/dev/\S+$")]
Address = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
MediaDevice = Literal["cd", "usb"]
PowerAction = Literal["on", "off", "softOff", "cycle", "reset"]
BootDevice = Literal["pxe", "disk", "cd", "usb", "bios"]

# Served into an iPXE script line (issue 23 L7): nothing iPXE would expand (``${``), chain (``||``,
# ``&&``, a ``;`` word), cut (a ``#`` word) or end (control characters); the site agent checks
# the same again when it installs the entry and when it serves it.
_IPXE_VALUE: Final = r"(?!.*(\$\{|\|\||&&|(^|\s)[;#]))[^\x00-\x1f\x7f]*$"
IpxeUrl = Annotated[str, msgspec.Meta(pattern=r"^(?=https?://\S+$)" + _IPXE_VALUE, max_length=4096)]
IpxeCmdline = Annotated[str, msgspec.Meta(pattern="^" + _IPXE_VALUE, max_length=4096)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


# -- payloads: BMC commands (the site agent, through a driver) ----------------------------


class SetPower(_Msg, frozen=True, kw_only=True):
    """``power.setPower``: the machine's power state through its BMC."""

    action: PowerAction
    bmc: NodeBmc | None = None


class SetBootDevice(_Msg, frozen=True, kw_only=True):
    """``management.setBootDevice``: the next boot device (once, unless ``persistent``)."""

    device: BootDevice
    persistent: bool = False
    mode: Literal["uefi", "legacy"] | None = None
    bmc: NodeBmc | None = None


class MediaInsert(_Msg, frozen=True, kw_only=True):
    """``media.insert``: a virtual medium by URL; with ``sha256`` the site agent fills its cache
    from ``url`` and hands the BMC its own copy. With ``joinTokenRef`` instead of ``url``, the
    medium is the ramdisk's token image (label ``BCBOOT``) that the site agent builds and serves
    once, to the BMC alone, at a capability URL (docs/security.md, "Virtual media")."""

    url: Url | None = None
    device: MediaDevice = "cd"
    sha256: Sha256 | None = None
    bmc: NodeBmc | None = None
    join_token_ref: SecretRef | None = None


class MediaEject(_Msg, frozen=True, kw_only=True):
    """``media.eject``."""

    device: MediaDevice = "cd"
    bmc: NodeBmc | None = None


class BmcInventory(_Msg, frozen=True, kw_only=True):
    """``management.inventory``: the machine as its BMC describes it."""

    bmc: NodeBmc


class ValidateBmc(_Msg, frozen=True, kw_only=True):
    """``management.validate``: the BMC answers, takes the credentials, has the system."""

    bmc: NodeBmc


# -- payloads: the site agent's own ---------------------------------------------------------


class SetEntry(_Msg, frozen=True, kw_only=True):
    """``netboot.setEntry``: the iPXE boot entry of one MAC. With ``kernelSha256`` /
    ``initrdSha256`` the machine gets them from the site cache. The ramdisk's join token travels
    by reference (``joinTokenRef``), resolved by the site agent while it installs the entry."""

    mac: Mac
    kernel: IpxeUrl | None = None
    initrd: IpxeUrl | None = None
    kernel_sha256: Sha256 | None = None
    initrd_sha256: Sha256 | None = None
    cmdline: IpxeCmdline = ""
    script: Annotated[str, msgspec.Meta(max_length=65536)] | None = None
    one_time: bool = True
    join_token_ref: SecretRef | None = None


class ClearEntry(_Msg, frozen=True, kw_only=True):
    """``netboot.clearEntry``."""

    mac: Mac


class DriverInvoke(_Msg, frozen=True, kw_only=True):
    """``driver.invoke``: one driver operation ``<concern>.<operation>``; ``input`` is that
    operation's own payload (decoded as its Struct by the agent)."""

    operation: Annotated[str, msgspec.Meta(pattern=DOTTED_NAME_PATTERN)]
    input: Any = msgspec.field(default_factory=dict)


class HttpProxy(_Msg, frozen=True, kw_only=True):
    """``site.httpProxy``: one HTTP request to the node's own address. ``nodeAddresses`` are the
    node's recorded addresses (the control plane fills them; the site agent relays only to
    these); ``insecure`` turns TLS verification off for a self-signed machine API."""

    url: Url
    method: Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    headers: dict[str, Annotated[str, msgspec.Meta(max_length=8192)]] = msgspec.field(default_factory=dict)
    body: str | None = None
    poll: bool = False
    node_addresses: Annotated[list[Address], msgspec.Meta(max_length=64)] | None = None
    insecure: bool = False


# -- payloads: bcd (the node) -----------------------------------------------------------------


class NodeInventory(_Msg, frozen=True, kw_only=True):
    """``node.inventory``: no arguments."""


class NodeWipe(_Msg, frozen=True, kw_only=True):
    """``node.wipe``: every disk when none are named."""

    mode: Literal["quick", "discard", "secure"] = "quick"
    disks: Annotated[list[DevicePath], msgspec.Meta(min_length=1)] | None = None


class NodeImageWrite(_Msg, frozen=True, kw_only=True):
    """``node.imageWrite``: a verified OS image onto a disk, with the rendered user data."""

    url: Url
    sha256: Sha256
    format: Literal["raw", "raw.gz", "raw.xz", "raw.zst", "qcow2"] = "raw"
    disk: DevicePath | None = None
    user_data_ref: SecretRef | None = None


class ConvergeUnit(_Msg, frozen=True, kw_only=True):
    """One config unit of a host section and its settings."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9-]{0,63}$")]
    settings: Any = msgspec.field(default_factory=dict)


class NodeConverge(_Msg, frozen=True, kw_only=True):
    """``node.converge``: the host section of ``generation``."""

    generation: Annotated[int, msgspec.Meta(ge=0)]
    units: Annotated[list[ConvergeUnit], msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)


# -- results ------------------------------------------------------------------------------


class PowerResult(_Msg, frozen=True, kw_only=True):
    """``power.setPower``: the power state read back (as the BMC spells it) and whether the
    command changed it (an ``on`` of a machine that is on did not). Every field has a default:
    the engine reads what another agent's result says, and only that."""

    driver: str = ""
    power_state: str | None = None
    changed: bool = False


class BootDeviceResult(_Msg, frozen=True, kw_only=True, omit_defaults=True):
    """``management.setBootDevice``: the device read back; ``target``/``enabled`` in the BMC's
    words where it has them (Redfish's ``BootSourceOverrideTarget``/``…Enabled``)."""

    driver: str
    device: str
    persistent: bool
    target: str | None = None
    enabled: str | None = None


class MediaResult(_Msg, frozen=True, kw_only=True, omit_defaults=True):
    """``media.insert`` / ``media.eject``: the medium as read back."""

    driver: str
    device: str
    inserted: bool
    image: str | None = None


class BmcSystem(_Msg, frozen=True, kw_only=True):
    id: str | None = None
    uuid: str | None = None
    name: str | None = None
    manufacturer: str | None = None
    model: str | None = None
    serial: str | None = None
    bios_version: str | None = None
    power_state: str | None = None


class BmcProcessor(_Msg, frozen=True, kw_only=True):
    id: str | None = None
    model: str | None = None
    cores: int | None = None
    threads: int | None = None
    architecture: str | None = None


class BmcNic(_Msg, frozen=True, kw_only=True):
    id: str | None = None
    mac: str | None = None


class BmcMemory(_Msg, frozen=True, kw_only=True, omit_defaults=True):
    total_gib: float | None = msgspec.field(default=None, name="totalGiB")


class BmcInventoryResult(_Msg, frozen=True, kw_only=True):
    """``management.inventory``: what the BMC says of the machine (parts it does not offer are
    empty). Every field has a default, as ``PowerResult``'s."""

    driver: str = ""
    system: BmcSystem = msgspec.field(default_factory=BmcSystem)
    processors: list[BmcProcessor] = msgspec.field(default_factory=list)
    nics: list[BmcNic] = msgspec.field(default_factory=list)
    memory: BmcMemory | None = None


class BmcCheck(_Msg, frozen=True, kw_only=True):
    """One check of ``management.validate``; ``skipped`` when an earlier one it needs failed."""

    check: Literal["reach", "credentials", "system", "power"]
    status: Literal["ok", "failed", "skipped"]
    message: str


class ValidateResult(_Msg, frozen=True, kw_only=True):
    """``management.validate``: a check that fails is here (the command itself succeeds)."""

    driver: str
    ok: bool
    checks: list[BmcCheck]


class SetEntryResult(_Msg, frozen=True, kw_only=True):
    """``netboot.setEntry``: the entry as installed (kernel/initrd as served: maybe the cache's)."""

    mac: str
    one_time: bool
    kernel: str | None
    initrd: str | None


class ClearEntryResult(_Msg, frozen=True, kw_only=True):
    removed: bool


# -- results: bcd (the node) ------------------------------------------------------------------
# What bcd found is said as it found it: a value it could not read is None (null on the wire),
# never left out. Every field has a default, as ``PowerResult``'s: the engine reads what another
# bcd's result says, and only that.


class NodeCpus(_Msg, frozen=True, kw_only=True):
    model: str | None = None
    sockets: int | None = None
    cores: int | None = None
    threads: int | None = None
    virtualization: bool = False


class NodeMemory(_Msg, frozen=True, kw_only=True):
    total_bytes: int | None = None


class NodeDisk(_Msg, frozen=True, kw_only=True):
    name: str = ""
    path: str = ""
    size_bytes: int | None = None
    model: str | None = None
    serial: str | None = None
    rotational: bool = False
    removable: bool = False
    transport: str | None = None
    wwn: str | None = None
    boot: bool = False
    """bcd runs from it (``node.wipe`` leaves it alone unless named)."""


class NodeNic(_Msg, frozen=True, kw_only=True):
    name: str = ""
    mac: str | None = None
    link: bool = False
    speed_mbps: int | None = None
    mtu: int | None = None
    driver: str | None = None


class NodeGpu(_Msg, frozen=True, kw_only=True):
    """A GPU on the PCI bus; ``name`` … ``driver_version`` only where ``nvidia-smi`` answered
    (left out otherwise)."""

    pci_address: str = ""
    vendor: str = ""
    device_id: str | None = None
    name: str | UnsetType = UNSET
    uuid: str | UnsetType = UNSET
    memory_mib: int | UnsetType | None = msgspec.field(default=UNSET, name="memoryMiB")
    driver_version: str | UnsetType = UNSET


class NodeFirmware(_Msg, frozen=True, kw_only=True):
    vendor: str | None = None
    product: str | None = None
    board: str | None = None
    bios_vendor: str | None = None
    bios_version: str | None = None
    bios_date: str | None = None
    boot_mode: str | None = None
    """``uefi`` or ``bios``."""


class NodeInventoryResult(_Msg, frozen=True, kw_only=True):
    """``node.inventory``: the machine's hardware as bcd reads it (stored as the node's
    ``inventory``; enrollment rules match its facts)."""

    product_uuid: str | None = None
    serial: str | None = None
    hostname: str | None = None
    kernel: str | None = None
    cpus: NodeCpus = msgspec.field(default_factory=NodeCpus)
    memory: NodeMemory = msgspec.field(default_factory=NodeMemory)
    disks: list[NodeDisk] = msgspec.field(default_factory=list)
    nics: list[NodeNic] = msgspec.field(default_factory=list)
    gpus: list[NodeGpu] = msgspec.field(default_factory=list)
    firmware: NodeFirmware = msgspec.field(default_factory=NodeFirmware)


class DiskWiped(_Msg, frozen=True, kw_only=True):
    """One disk of ``node.wipe``: what was erased, or (``skipped``, nothing else) why not."""

    disk: str = ""
    skipped: str | UnsetType = UNSET
    size_bytes: int | UnsetType = UNSET
    mode: str | UnsetType = UNSET
    partition_table: str | UnsetType | None = UNSET
    partitions: int | UnsetType = UNSET
    signatures_erased: list[str] | UnsetType = UNSET
    erased_bytes: int | UnsetType = UNSET
    discarded: bool | UnsetType = UNSET
    ms: float | UnsetType = UNSET


class WipeResult(_Msg, frozen=True, kw_only=True):
    """``node.wipe``: every disk it erased, then the ones it left alone."""

    disks: list[DiskWiped] = msgspec.field(default_factory=list)


class ConfigDrivePlaced(_Msg, frozen=True, kw_only=True):
    """Where ``node.imageWrite`` put the NoCloud config drive (never what it holds)."""

    table: str = ""
    partition: int = 0
    offset: int = 0
    bytes: int = 0
    label: str = ""
    iso_bytes: int = 0
    bus_files: bool = False


class ImageWriteResult(_Msg, frozen=True, kw_only=True):
    """``node.imageWrite``: the image written, verified and read back; ``config_drive`` when it
    carried user data."""

    disk: str = ""
    format: str = ""
    sha256: str = ""
    bytes_downloaded: int = 0
    bytes_written: int = 0
    written_sha256: str = ""
    verified: bool = False
    bootable: bool = False
    config_drive: ConfigDrivePlaced | UnsetType = UNSET
    ms: float = 0.0


class UnitReport(_Msg, frozen=True, kw_only=True):
    """One unit of ``node.converge``; ``ran``: the commands it ran, as shown (each part left out
    when there is nothing to say)."""

    name: str = ""
    status: str = "unchanged"
    """``changed``, ``unchanged``, ``skipped``, ``failed`` or ``unsupported`` (a str: a newer
    bcd's word must not make the engine miss the generation it observed)."""
    detail: str | UnsetType = UNSET
    path: str | UnsetType | None = UNSET
    """Where the unit's settings did not fit (a failed unit)."""
    ran: list[str] | UnsetType = UNSET


class ConvergeResult(_Msg, frozen=True, kw_only=True):
    """``node.converge``: the generation asked, the last one that applied whole (bcd's
    ``observedGeneration``, what the engine records) and each unit."""

    generation: int = 0
    observed_generation: int = 0
    units: list[UnitReport] = msgspec.field(default_factory=list)


PAYLOADS: Final[Mapping[str, type[msgspec.Struct]]] = MappingProxyType(
    {
        "power.setPower": SetPower,
        "management.setBootDevice": SetBootDevice,
        "media.insert": MediaInsert,
        "media.eject": MediaEject,
        "management.inventory": BmcInventory,
        "management.validate": ValidateBmc,
        "netboot.setEntry": SetEntry,
        "netboot.clearEntry": ClearEntry,
        "driver.invoke": DriverInvoke,
        "site.httpProxy": HttpProxy,
        "node.inventory": NodeInventory,
        "node.wipe": NodeWipe,
        "node.imageWrite": NodeImageWrite,
        "node.converge": NodeConverge,
    }
)
"""The payload Struct of every command kind metal ships."""

RESULTS: Final[Mapping[str, type[msgspec.Struct]]] = MappingProxyType(
    {
        "power.setPower": PowerResult,
        "management.setBootDevice": BootDeviceResult,
        "media.insert": MediaResult,
        "media.eject": MediaResult,
        "management.inventory": BmcInventoryResult,
        "management.validate": ValidateResult,
        "netboot.setEntry": SetEntryResult,
        "netboot.clearEntry": ClearEntryResult,
        "node.inventory": NodeInventoryResult,
        "node.wipe": WipeResult,
        "node.imageWrite": ImageWriteResult,
        "node.converge": ConvergeResult,
    }
)
"""The result Struct of every command kind metal ships (``driver.invoke`` and ``site.httpProxy``
answer what the driver or the target said)."""


def decode_payload(payload: object, into: type[S], *, path: str = "") -> S:
    """A command's payload (JSON data, as the command queue stored it) as its Struct.

    Raises:
        BcError: ``INVALID_INPUT`` with ``details.path`` (under ``path``) when it does not fit.
    """
    try:
        return convert(payload, into)
    except BcError as err:
        raise err.with_path_prefix(path) if path else err from None


def payload_document(payload: msgspec.Struct) -> dict[str, Any]:
    """A payload Struct as the JSON a command carries: camelCase, absent (None) fields left out,
    as the command queue stores it (``decode_payload`` reads it back to an equal Struct)."""
    return {
        encode_name: _document(value)
        for name, encode_name in _field_names(type(payload))
        if (value := getattr(payload, name)) is not None
    }


@functools.cache
def _field_names(cls: type[msgspec.Struct]) -> tuple[tuple[str, str], ...]:
    """A Struct type's fields, (name, JSON name): ``msgspec.structs.fields`` resolves the type's
    annotations again at each call (6% of the engine's busy time in a deploy, py-spy --gil)."""
    return tuple((f.name, f.encode_name) for f in msgspec.structs.fields(cls))


def _document(value: object) -> Any:
    if isinstance(value, msgspec.Struct):
        return payload_document(value)
    if isinstance(value, list):
        return [_document(item) for item in value]
    return msgspec.to_builtins(value)


def decode_result(kind: str, result: object) -> msgspec.Struct | None:
    """A settled command's result as its kind's Struct; None for a kind without one or a result
    that does not fit (an older agent's): the caller then has nothing to learn from it."""
    into = RESULTS.get(kind)
    if into is None or result is None:
        return None
    try:
        return msgspec.convert(result, into)
    except msgspec.ValidationError:
        return None
