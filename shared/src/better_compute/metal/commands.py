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

import msgspec

from better_compute.core.manifest import field
from better_compute.core.plugins import CommandKind, DriverOperation
from better_compute.wire import commands as payloads
from better_compute.wire.metal import NodeBmc
from better_compute.wire.schema import manifest_of

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

# Every payload is a Struct of better_compute.wire.commands; its manifest (what the command
# queue and a profile step check) is derived from it, never written a second time.

# Which BMC a BMC command talks to (the node's NodeBmc; docs/site-agent.md). The engine fills it
# from the node record when a step gives none. The credential is a SecretRef whose value is the
# JSON {"username": ..., "password": ...}; the agent fetches it through the secrets fetch gate.
BMC: Final = field.object(manifest_of(NodeBmc))


def _kind(
    name: str,
    payload: type[msgspec.Struct],
    description: str,
    *,
    destructive: bool,
    boot: Literal["medium", "control"] | None = None,
    idempotent: bool | Callable[[Any], bool] = False,
) -> CommandKind:
    return CommandKind(
        name=name,
        destructive=destructive,
        description=description,
        payload=manifest_of(payload),
        boot=boot,
        idempotent=idempotent,
    )


def _power_reruns(payload: Any) -> bool:
    """On and off end where they end however often they run; a cycle or reset run twice
    interrupts the machine twice (and may cut short the boot the first one started)."""
    return isinstance(payload, dict) and payload.get("action") in ("on", "off", "softOff")


# BMC commands: the site agent runs them through a machine's BMC. None is destructive (they
# interrupt a machine at worst); ``boot`` says which decide what the machine boots.
MANAGEMENT_VALIDATE: Final = _kind(
    "management.validate",
    payloads.ValidateBmc,
    "Checks the BMC without changing anything: it answers, takes the credentials, has the system,"
    " says its power state",
    destructive=False,
    idempotent=True,
)

MANAGEMENT_INVENTORY: Final = _kind(
    "management.inventory",
    payloads.BmcInventory,
    "Reads the machine's inventory through its BMC (system, processors, memory, NICs)",
    destructive=False,
    idempotent=True,
)

NETBOOT_SET_ENTRY: Final = _kind(
    "netboot.setEntry",
    payloads.SetEntry,
    "Installs the iPXE boot entry the site agent serves to one MAC (once, when oneTime)",
    destructive=False,
    boot="medium",
)

NETBOOT_CLEAR_ENTRY: Final = _kind(
    "netboot.clearEntry",
    payloads.ClearEntry,
    "Removes the iPXE boot entry of one MAC (it then boots as an unknown machine)",
    destructive=False,
    boot="control",
    idempotent=True,
)

DRIVER_INVOKE: Final = _kind(
    "driver.invoke",
    payloads.DriverInvoke,
    "Runs one driver operation <concern>.<operation> on the site agent",
    destructive=True,
)

SITE_HTTP_PROXY: Final = _kind(
    "site.httpProxy",
    payloads.HttpProxy,
    "One HTTP request from the site agent to the node's own address, SSRF-checked",
    # Destructive: a request to a machine's own API (Talos, a BMC) can reset or wipe it.
    destructive=True,
)

POWER_SET_POWER: Final = _kind(
    "power.setPower",
    payloads.SetPower,
    "Changes the machine's power state through its BMC",
    destructive=False,
    boot="control",
    idempotent=_power_reruns,
)

MANAGEMENT_SET_BOOT_DEVICE: Final = _kind(
    "management.setBootDevice",
    payloads.SetBootDevice,
    "Sets the next boot device through the BMC (once, unless persistent)",
    destructive=False,
    boot="control",
    idempotent=True,
)

MEDIA_INSERT: Final = _kind(
    "media.insert",
    payloads.MediaInsert,
    "Inserts a virtual medium (an ISO or disk image URL) through the BMC",
    destructive=False,
    boot="medium",
)

MEDIA_EJECT: Final = _kind(
    "media.eject",
    payloads.MediaEject,
    "Ejects a virtual medium through the BMC",
    destructive=False,
    boot="control",
    idempotent=True,
)

NODE_INVENTORY: Final = _kind(
    "node.inventory",
    payloads.NodeInventory,
    "Reports the machine's hardware (CPUs, memory, disks, NICs, GPUs)",
    destructive=False,
)

NODE_WIPE: Final = _kind(
    "node.wipe", payloads.NodeWipe, "Erases disks; every disk when none are named", destructive=True
)

NODE_IMAGE_WRITE: Final = _kind(
    "node.imageWrite",
    payloads.NodeImageWrite,
    "Writes a verified OS image to a disk, with the rendered user data",
    destructive=True,
)

NODE_CONVERGE: Final = _kind(
    "node.converge",
    payloads.NodeConverge,
    "Applies the node's host section (config units) and reports each unit and the generation",
    destructive=False,
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
