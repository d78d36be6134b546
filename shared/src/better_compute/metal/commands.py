"""The command kinds metal's agents implement: BMC control, relayed HTTP, node operations.

``destructive`` marks commands that can destroy data or state that cannot be rebuilt (disk
contents, or anything an arbitrary driver operation or HTTP request to the machine might do).
With the destructive-batch quorum on, those run only inside a batch the approvers signed.
Power, boot-device, virtual-media, boot-entry and inventory commands interrupt a machine at worst
and are not destructive on their own; but the boot ones (``boot``) lead to a disk being written
when what they boot is an installer, or a ramdisk that is about to wipe or write: in the workflow
of a profile that says ``writesDisk: true`` they run inside its batch too (docs/command-queue.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, Literal

from better_compute.core.manifest import Field, field, manifest
from better_compute.core.plugins import DOTTED_NAME_PATTERN, CommandKind, DriverOperation

__all__ = [
    "BMC",
    "COMMAND_KINDS",
    "DRIVER_INVOKE",
    "DRIVER_OPERATIONS",
    "MANAGEMENT_INVENTORY",
    "MANAGEMENT_SET_BOOT_DEVICE",
    "MANAGEMENT_VALIDATE",
    "MEDIA_EJECT",
    "MEDIA_INSERT",
    "NETBOOT_CLEAR_ENTRY",
    "NETBOOT_SET_ENTRY",
    "NODE_CONVERGE",
    "NODE_IMAGE_WRITE",
    "NODE_INVENTORY",
    "NODE_WIPE",
    "POWER_SET_POWER",
    "SITE_HTTP_PROXY",
]

_URL = field.string(pattern=r"^https?://\S+$", max_length=4096)
_SHA256 = field.string(pattern=r"^[0-9a-f]{64}$")
_MEDIA_DEVICE = field.enum(["cd", "usb"]).default("cd")

# -- site agent: which BMC a BMC command talks to, BMC inventory, network-boot entries ---------
# (bc-site-agent, issue 12; docs/site-agent.md). Until the engine fills ``bmc`` from the node
# record, a step passes it explicitly. The credential is a SecretRef whose value is the JSON
# {"username": ..., "password": ...}; the agent fetches it through the secrets fetch gate.
BMC: Final = field.object(
    {
        "driver": field.enum(["redfish", "ipmi", "sim"]),
        "address": field.string(min_length=1, max_length=2048),
        "credentialsRef": field.secret_ref().optional(),
        "systemId": field.string(min_length=1, max_length=512).optional(),
        "insecure": field.bool().default(False),
        "caBundle": field.string(max_length=65536).optional(),
    }
)
_MAC = field.string(pattern=r"^[0-9a-fA-F]{2}([:-][0-9a-fA-F]{2}){5}$")
# Served into an iPXE script line (issue 23 L7): nothing iPXE would expand (``${``), chain (``||``,
# ``&&``, a ``;`` word), cut (a ``#`` word) or end (control characters); the site agent checks
# the same again when it installs the entry and when it serves it.
_IPXE_VALUE = r"(?!.*(\$\{|\|\||&&|(^|\s)[;#]))[^\x00-\x1f\x7f]*$"
_IPXE_URL = field.string(pattern=r"^(?=https?://\S+$)" + _IPXE_VALUE, max_length=4096)


def _bmc_command(
    name: str,
    description: str,
    fields: Mapping[str, Field] | None = None,
    *,
    bmc_required: bool = False,
    boot: Literal["medium", "control"] | None = None,
    idempotent: bool | Callable[[Any], bool] = False,
) -> CommandKind:
    """A command the site agent runs through a machine's BMC: ``fields`` and the ``bmc`` it
    talks to. None of them is destructive (they interrupt a machine at worst); ``boot`` says
    which decide what the machine boots."""
    bmc = BMC if bmc_required else BMC.optional()
    return CommandKind(
        name=name,
        destructive=False,
        description=description,
        payload=manifest({**(fields or {}), "bmc": bmc}),
        boot=boot,
        idempotent=idempotent,
    )


def _power_reruns(payload: Any) -> bool:
    """On and off end where they end however often they run; a cycle or reset run twice
    interrupts the machine twice (and may cut short the boot the first one started)."""
    return isinstance(payload, dict) and payload.get("action") in ("on", "off", "softOff")


MANAGEMENT_VALIDATE: Final = _bmc_command(
    "management.validate",
    "Checks the BMC without changing anything: it answers, takes the credentials, has the system,"
    " says its power state",
    bmc_required=True,
    idempotent=True,
)

MANAGEMENT_INVENTORY: Final = _bmc_command(
    "management.inventory",
    "Reads the machine's inventory through its BMC (system, processors, memory, NICs)",
    bmc_required=True,
    idempotent=True,
)

NETBOOT_SET_ENTRY: Final = CommandKind(
    name="netboot.setEntry",
    destructive=False,
    boot="medium",
    description="Installs the iPXE boot entry the site agent serves to one MAC (once, when oneTime)",
    payload=manifest(
        {
            "mac": _MAC,
            "kernel": _IPXE_URL.optional(),
            "initrd": _IPXE_URL.optional(),
            # With these, the machine gets them from the site cache (filled once from the URL).
            "kernelSha256": _SHA256.optional(),
            "initrdSha256": _SHA256.optional(),
            "cmdline": field.string(pattern="^" + _IPXE_VALUE, max_length=4096).default(""),
            "script": field.string(max_length=65536).optional(),
            "oneTime": field.bool().default(True),
            # The ramdisk's join token, by reference: the site agent fetches it through the
            # secrets gate while it installs the entry and adds ``bcd.token=`` to the command
            # line it serves; the token itself never travels in the command.
            "joinTokenRef": field.secret_ref().optional(),
        }
    ),
)

NETBOOT_CLEAR_ENTRY: Final = CommandKind(
    name="netboot.clearEntry",
    destructive=False,
    boot="control",
    description="Removes the iPXE boot entry of one MAC (it then boots as an unknown machine)",
    payload=manifest({"mac": _MAC}),
    idempotent=True,
)
# -- end of the site agent's block ---------------------------------------------------------

DRIVER_INVOKE: Final = CommandKind(
    name="driver.invoke",
    destructive=True,
    description="Runs one driver operation <concern>.<operation> on the site agent",
    payload=manifest(
        {
            "operation": field.string(pattern=DOTTED_NAME_PATTERN),
            "input": field.json().default({}),
        }
    ),
)

SITE_HTTP_PROXY: Final = CommandKind(
    name="site.httpProxy",
    # Destructive: a request to a machine's own API (Talos, a BMC) can reset or wipe it.
    destructive=True,
    description="One HTTP request from the site agent to the node's own address, SSRF-checked",
    payload=manifest(
        {
            "url": _URL,
            "method": field.enum(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]).default("GET"),
            "headers": field.map(field.string(max_length=8192)).default({}),
            "body": field.string().optional(),
            "poll": field.bool().default(False),
            # The node's recorded addresses (the site agent relays only to these); the control
            # plane fills them from the node record. And TLS verification off, for machines
            # whose API has a self-signed certificate.
            "nodeAddresses": field.list(field.string(min_length=1, max_length=255), max_items=64).optional(),
            "insecure": field.bool().default(False),
        }
    ),
)

POWER_SET_POWER: Final = _bmc_command(
    "power.setPower",
    "Changes the machine's power state through its BMC",
    {"action": field.enum(["on", "off", "softOff", "cycle", "reset"])},
    boot="control",
    idempotent=_power_reruns,
)

MANAGEMENT_SET_BOOT_DEVICE: Final = _bmc_command(
    "management.setBootDevice",
    "Sets the next boot device through the BMC (once, unless persistent)",
    {
        "device": field.enum(["pxe", "disk", "cd", "usb", "bios"]),
        "persistent": field.bool().default(False),
        "mode": field.enum(["uefi", "legacy"]).optional(),
    },
    boot="control",
    idempotent=True,
)

MEDIA_INSERT: Final = _bmc_command(
    "media.insert",
    "Inserts a virtual medium (an ISO or disk image URL) through the BMC",
    {
        "url": _URL,
        "device": _MEDIA_DEVICE,
        # With it, the site agent fills its cache from url and hands the BMC its own copy.
        "sha256": _SHA256.optional(),
    },
    boot="medium",
)

MEDIA_EJECT: Final = _bmc_command(
    "media.eject",
    "Ejects a virtual medium through the BMC",
    {"device": _MEDIA_DEVICE},
    boot="control",
    idempotent=True,
)

NODE_INVENTORY: Final = CommandKind(
    name="node.inventory",
    destructive=False,
    description="Reports the machine's hardware (CPUs, memory, disks, NICs, GPUs)",
    payload=manifest({}),
)

NODE_WIPE: Final = CommandKind(
    name="node.wipe",
    destructive=True,
    description="Erases disks; every disk when none are named",
    payload=manifest(
        {
            "mode": field.enum(["quick", "discard", "secure"]).default("quick"),
            "disks": field.list(field.string(pattern=r"^/dev/\S+$"), min_items=1).optional(),
        }
    ),
)

NODE_IMAGE_WRITE: Final = CommandKind(
    name="node.imageWrite",
    destructive=True,
    description="Writes a verified OS image to a disk, with the rendered user data",
    payload=manifest(
        {
            "url": _URL,
            "sha256": _SHA256,
            "format": field.enum(["raw", "raw.gz", "raw.xz", "raw.zst", "qcow2"]).default("raw"),
            "disk": field.string(pattern=r"^/dev/\S+$").optional(),
            "userDataRef": field.secret_ref().optional(),
        }
    ),
)

NODE_CONVERGE: Final = CommandKind(
    name="node.converge",
    destructive=False,
    description="Applies the node's host section (config units) and reports each unit and the generation",
    payload=manifest(
        {
            "generation": field.int(min=0),
            "units": field.list(
                field.object(
                    {
                        "name": field.string(pattern=r"^[a-z][a-z0-9-]{0,63}$"),
                        "settings": field.json().default({}),
                    }
                ),
                max_items=256,
            ).default([]),
        }
    ),
)

COMMAND_KINDS: Final[Mapping[str, CommandKind]] = MappingProxyType(
    {
        kind.name: kind
        for kind in (
            DRIVER_INVOKE,
            SITE_HTTP_PROXY,
            POWER_SET_POWER,
            MANAGEMENT_SET_BOOT_DEVICE,
            MEDIA_INSERT,
            MEDIA_EJECT,
            NODE_INVENTORY,
            NODE_WIPE,
            NODE_IMAGE_WRITE,
            NODE_CONVERGE,
            MANAGEMENT_INVENTORY,
            MANAGEMENT_VALIDATE,
            NETBOOT_SET_ENTRY,
            NETBOOT_CLEAR_ENTRY,
        )
    }
)

# What the site agent's ``driver.invoke`` runs (bc_site_agent.handlers): each operation's input is
# the payload of the command kind of the same name, so a profile step's ``with`` is checked against
# the very manifest the site agent checks it against.
DRIVER_OPERATIONS: Final[Mapping[str, DriverOperation]] = MappingProxyType(
    {
        kind.name: DriverOperation(name=kind.name, input=kind.payload, description=kind.description)
        for kind in (
            POWER_SET_POWER,
            MANAGEMENT_SET_BOOT_DEVICE,
            MEDIA_INSERT,
            MEDIA_EJECT,
            MANAGEMENT_INVENTORY,
            MANAGEMENT_VALIDATE,
            NETBOOT_SET_ENTRY,
            NETBOOT_CLEAR_ENTRY,
        )
    }
)
