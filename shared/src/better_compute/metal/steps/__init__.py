"""Metal's shipped steps, contributed through ``metal()``.

* ``power.getPower``* (a BMC read: the power state), ``power.setPower``*,
  ``management.setBootDevice``*, ``media.insert``* (a ``url``, or the ``url`` of ``fromStep``'s
  result), ``media.eject``*: BMC commands with the node's BMC added;
* ``metal.ensureRamdisk``*: one-time PXE, a boot entry per MAC, a power cycle, each keyed;
* ``wait.agentJoined``: until the node's agent joined, after the previous step finished;
* ``inspect.collect``*: the inventory, node-signed, stored on the node;
* ``disk.wipe``*: erase disks (destructive; counts only when attested);
* ``deploy.deploy``*: the catalog image and the rendered user data to disk (attested).

``*``: a relaying step (runs in the engine, sends to that agent, addressable with ``on:``).
``http_via_site`` is the helper for steps that talk to the machine's own API (``site.httpProxy``).
"""

from typing import Final

from better_compute.provision.steps import Step

from .bmc import (
    BMC_STEPS,
    management_set_boot_device,
    media_eject,
    media_insert,
    power_get_power,
    power_set_power,
)
from .deploy import deploy_deploy
from .enroll import ENROLL_STEPS, enroll_read_bmc, enroll_validate_bmc
from .http import http_via_site, node_addresses
from .inventory import inspect_collect
from .joined import wait_agent_joined
from .profiles import (
    ACTION_PROFILE_IDS,
    ENROLL_PROFILE_ID,
    LIFECYCLE_PROFILE_IDS,
    VALIDATE_PROFILE_ID,
    Ramdisk,
    lifecycle_profiles,
)
from .ramdisk import ensure_ramdisk
from .wipe import disk_wipe

__all__ = [
    "ACTION_PROFILE_IDS",
    "ENROLL_PROFILE_ID",
    "LIFECYCLE_PROFILE_IDS",
    "METAL_STEPS",
    "VALIDATE_PROFILE_ID",
    "Ramdisk",
    "deploy_deploy",
    "disk_wipe",
    "enroll_read_bmc",
    "enroll_validate_bmc",
    "ensure_ramdisk",
    "http_via_site",
    "inspect_collect",
    "lifecycle_profiles",
    "management_set_boot_device",
    "media_eject",
    "media_insert",
    "node_addresses",
    "power_get_power",
    "power_set_power",
    "wait_agent_joined",
]

METAL_STEPS: Final[tuple[Step, ...]] = (
    *BMC_STEPS,
    *ENROLL_STEPS,
    ensure_ramdisk,
    wait_agent_joined,
    inspect_collect,
    disk_wipe,
    deploy_deploy,
)
