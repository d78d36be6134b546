"""Metal's shipped lifecycle profiles: one per transition, run as workflows with owner metal.

===================  ====================================================================
``metal.inspect``    ramdisk, the agent joins, inventory (node-signed), power off
``metal.commission`` ramdisk, the agent joins, inventory, quick wipe, power off
``metal.deploy``     ramdisk, the agent joins, user data, image write, boot from disk, power
                     cycle, the installed OS's agent joins
``metal.release``    ramdisk, the agent joins, quick wipe, power off
``metal.retire``     ramdisk, the agent joins, secure wipe, power off
``metal.adopt``      the BMC answers (power state read), the installed OS's agent joined (any
                     valid join), inventory (node-signed): nothing booted, wiped or written
===================  ====================================================================

Beside them, profiles that change no lifecycle state: ``metal.enroll`` (the BMC validated,
then its power and the machine's inventory read through it: what ``bcx nodes enroll`` runs
once the node is recorded), ``metal.validate`` (the BMC checked), ``metal.power-on|off|cycle``
and ``metal.boot-pxe|disk`` (``bcx nodes power`` and ``bcx nodes boot-device set``).

The ramdisk (kernel and initrd, or an iPXE script) is a deployment's own, so it goes into the
profiles' ``metal.ensureRamdisk`` step from ``metal(ramdisk=Ramdisk(...))``. The same ramdisk
gives the very same profile objects, so ``metal()`` may be called once for
``better_compute(modules=…)`` and again for ``provision_module(modules=…)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

from better_compute.provision.profiles import Profile, define_profile
from better_compute.wire.commands import SetBootDevice, SetPower, payload_document

__all__ = [
    "ACTION_PROFILE_IDS",
    "ENROLL_PROFILE_ID",
    "LIFECYCLE_PROFILE_IDS",
    "VALIDATE_PROFILE_ID",
    "Ramdisk",
    "lifecycle_profiles",
]

VALIDATE_PROFILE_ID: Final = "metal.validate"
"""The shipped profile that checks a node's BMC (``bcx nodes validate``)."""

ENROLL_PROFILE_ID: Final = "metal.enroll"
"""The shipped profile ``bcx nodes enroll`` runs on a node with a BMC once it is recorded: the
BMC validated (a failed check fails it), then its power and the machine's inventory read
through it (``bmcInventory``); the node stays ``enrolled`` either way."""

LIFECYCLE_PROFILE_IDS: Final = {
    "inspect": "metal.inspect",
    "commission": "metal.commission",
    "deploy": "metal.deploy",
    "release": "metal.release",
    "retire": "metal.retire",
    "adopt": "metal.adopt",
}
"""The shipped profile of each lifecycle verb."""

ACTION_PROFILE_IDS: Final = {
    "power.on": "metal.power-on",
    "power.off": "metal.power-off",
    "power.cycle": "metal.power-cycle",
    "bootDevice.pxe": "metal.boot-pxe",
    "bootDevice.disk": "metal.boot-disk",
}
"""The shipped one-step profile of each node action (``bcx nodes power|boot-device``): a
workflow like a verb's, audited, that leaves the node's lifecycle state as it was."""

_ACTION_STEPS: Final = {
    "power.on": ("Switch the node on through its BMC", "power.setPower", {"action": "on"}),
    "power.off": ("Switch the node off through its BMC", "power.setPower", {"action": "off"}),
    "power.cycle": ("Power-cycle the node through its BMC", "power.setPower", {"action": "cycle"}),
    "bootDevice.pxe": (
        "Boot the node from the network once, through its BMC",
        "management.setBootDevice",
        {"device": "pxe", "persistent": False},
    ),
    "bootDevice.disk": (
        "Boot the node from its disk from now on, through its BMC",
        "management.setBootDevice",
        {"device": "disk", "persistent": True},
    ),
}


@dataclass(frozen=True, kw_only=True)
class Ramdisk:
    """The bcd ramdisk the site agent network-boots a node into (``metal.ensureRamdisk``).

    Give ``kernel`` (and ``initrd``), with their sha256 to serve them from the site cache, or
    a whole iPXE ``script``.
    """

    kernel: str | None = None
    initrd: str | None = None
    kernel_sha256: str | None = None
    initrd_sha256: str | None = None
    cmdline: str = ""
    script: str | None = None

    def to_with(self) -> dict[str, Any]:
        """The ``with`` of a ``metal.ensureRamdisk`` profile step."""
        doc = {
            "kernel": self.kernel,
            "initrd": self.initrd,
            "kernelSha256": self.kernel_sha256,
            "initrdSha256": self.initrd_sha256,
            "cmdline": self.cmdline or None,
            "script": self.script,
        }
        return {k: v for k, v in doc.items() if v is not None}


def _profile(verb: str, description: str, steps: list[dict[str, Any]], **extra: Any) -> Profile:
    return define_profile(
        id=LIFECYCLE_PROFILE_IDS[verb],
        version=1,
        target="metal",
        role="host",
        description=description,
        steps=steps,
        **extra,
    )


@functools.cache
def lifecycle_profiles(ramdisk: Ramdisk | None = None) -> tuple[Profile, ...]:
    """The six lifecycle profiles, with ``ramdisk`` in their ``metal.ensureRamdisk`` steps."""
    boot = {"use": "metal.ensureRamdisk", "on": "site", "with": ramdisk.to_with() if ramdisk else {}}
    joined = {"use": "wait.agentJoined", "with": {"role": "node"}}
    collect = {"use": "inspect.collect"}
    off = {"use": "power.setPower", "on": "site", "with": payload_document(SetPower(action="off"))}

    def wipe(mode: str) -> dict[str, Any]:
        return {"use": "disk.wipe", "with": {"mode": mode}}

    return (
        # Only inspect and adopt write no disk: the others boot the ramdisk to wipe or write,
        # so under the quorum each of their boot commands waits for the batch with the wipe.
        _profile(
            "inspect",
            "Boot the ramdisk and record the node's inventory",
            [boot, joined, collect, off],
            writes_disk=False,
        ),
        _profile(
            "commission",
            "Inspect the node and wipe its disks: it is ready to deploy",
            [boot, joined, collect, wipe("quick"), off],
            writes_disk=True,
        ),
        _profile(
            "deploy",
            "Write the image with cloud-init user data and boot the installed OS until its agent joins",
            [
                boot,
                joined,
                {"use": "userdata.render"},
                {"use": "deploy.deploy"},
                {
                    "use": "management.setBootDevice",
                    "on": "site",
                    "with": payload_document(SetBootDevice(device="disk", persistent=True)),
                },
                {"use": "power.setPower", "on": "site", "with": payload_document(SetPower(action="cycle"))},
                {"use": "wait.agentJoined", "with": {"role": "node"}},
            ],
            user_data={"kind": "cloud-init"},
            writes_disk=True,
        ),
        _profile(
            "release",
            "Wipe the node's disks: it is ready again",
            [boot, joined, wipe("quick"), off],
            writes_disk=True,
        ),
        _profile(
            "retire",
            "Erase the node's disks securely and power it off",
            [boot, joined, wipe("secure"), off],
            writes_disk=True,
        ),
        # Not an ``adopt: true`` profile (those have no steps): no image, no user data, and no
        # step that boots, wipes or writes; the machine keeps running what it runs.
        _profile(
            "adopt",
            "Take over a machine that already runs an OS: nothing is booted, installed or wiped",
            [
                {"use": "power.getPower", "on": "site"},
                {"use": "wait.agentJoined", "with": {"role": "node", "fresh": False}},
                collect,
            ],
        ),
        *(
            define_profile(
                id=ACTION_PROFILE_IDS[action],
                version=1,
                target="metal",
                role="host",
                description=text,
                steps=[{"use": use, "on": "site", "with": with_}],
            )
            for action, (text, use, with_) in _ACTION_STEPS.items()
        ),
        define_profile(
            id=ENROLL_PROFILE_ID,
            version=1,
            target="metal",
            role="host",
            description="Enroll: validate the BMC, then read the machine's power and inventory through it",
            steps=[{"use": "enroll.validateBmc", "on": "site"}, {"use": "enroll.readBmc", "on": "site"}],
        ),
        define_profile(
            id=VALIDATE_PROFILE_ID,
            version=1,
            target="metal",
            role="host",
            description="Check the node's BMC: it answers, takes the credentials, has the system, power",
            steps=[{"use": "management.validate", "on": "site"}],
        ),
    )
