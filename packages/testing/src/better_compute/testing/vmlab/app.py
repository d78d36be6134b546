"""The deployment the VM lab runs: the fleet app (``metal_sim.app``: metal, the reference page's
``ubuntu-24.04-autoinstall``) with a ramdisk the VMs really boot.

Services load it with ``BC_APP=better_compute.testing.vmlab.app:app``; the ramdisk comes from
``$BC_VMLAB_RAMDISK``, JSON ``{"kernel", "initrd", "kernelSha256", "initrdSha256", "cmdline"}``
(URLs the site agent fills its cache from; the VMs get them from the cache at 10.0.2.2). The
command line names the control plane as the guests reach it (``bcd.control_plane=nats://
10.0.2.2:<port>``: ``ramdisk_env`` writes it). The simulated machines of the same site boot
the same entries and ignore the kernel, as with the fleet app.

The user data that ``metal.deploy`` renders for the installed OS comes from ``$BC_VMLAB_USERDATA``,
JSON ``{"controlPlaneUrl", "bcdUrl", "bcdSha256"}`` (``userdata_env`` writes it: the control plane
as the guests reach it, ``nats://10.0.2.2:<port>``, and a bcd they can download); without it, the
fleet app's (URLs nothing answers).

``vmlab-host-section`` (plugin ``vmlab-host``) is a profile to start on a deployed VM with
``workflows.start``: it waits for the installed OS's bcd (any join) and has the fleet app's
``hostConfig`` (one ``sysctl`` unit), so its success gives the node a host section for that bcd
to converge (the shipped ``metal.deploy`` has no ``hostConfig``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ...app import better_compute
from ...core import define_plugin
from ...metal import Ramdisk, metal
from ...metal.module import configured_ramdisk
from ...provision import UserData, define_profile, provision_module
from ..metal_sim.app import HOST_CONFIG, RAMDISK, acme_autoinstall, provision
from .lab import guest_url

__all__ = [
    "HOST_SECTION_PROFILE",
    "app",
    "ramdisk_env",
    "ramdisk_from_env",
    "userdata_env",
    "userdata_from_env",
]

ENV = "BC_VMLAB_RAMDISK"
USERDATA_ENV = "BC_VMLAB_USERDATA"


def ramdisk_env(
    *,
    kernel: str,
    nats_url: str,
    initrd: str | None = None,
    kernel_sha256: str | None = None,
    initrd_sha256: str | None = None,
    cmdline: str = "console=ttyS0 quiet",
    subject_root: str | None = None,
) -> dict[str, str]:
    """The environment that makes this app boot ``kernel``/``initrd``, its bcd joining the NATS
    server at ``nats_url`` (this machine's loopback) as the guests reach it, under
    ``subject_root`` (a test's own; ``bc`` when not given). ``quiet`` keeps the kernel from
    printing its command line, which ends with the site agent's ``bcd.token=``, on the VM's
    console."""
    if subject_root:
        cmdline = f"{cmdline} bcd.subject_root={subject_root}"
    doc: dict[str, Any] = {
        "kernel": kernel, "initrd": initrd, "kernelSha256": kernel_sha256, "initrdSha256": initrd_sha256,
        "cmdline": f"{cmdline} bcd.control_plane={guest_url(nats_url)}".strip(),
    }  # fmt: skip
    return {ENV: json.dumps({k: v for k, v in doc.items() if v is not None})}


def _guest_control_plane() -> str | None:
    """This process's NATS server as a QEMU guest reaches it (``nats://10.0.2.2:<port>``): the
    dev stack's services get ``BC_NATS_URL`` on loopback, which only user-mode guests reach."""
    url = os.environ.get("BC_NATS_URL")
    return guest_url(url) if url else None


def ramdisk_from_env() -> Ramdisk:
    """``$BC_VMLAB_RAMDISK``'s ramdisk; else the one bc.toml's ``[ramdisk]`` names (what ``bcx dev
    up`` serves after ``bcx ramdisk build``), its command line naming the control plane as the
    guests reach it; else the fleet app's simulated one."""
    raw = os.environ.get(ENV)
    if not raw:
        configured = configured_ramdisk()
        guest = _guest_control_plane()
        if configured is None or guest is None:
            return RAMDISK
        cmdline = configured.cmdline or "console=ttyS0,115200n8"
        if "quiet" not in cmdline.split():
            cmdline += " quiet"  # the kernel prints no command line, bcd.token= and all, on the console
        if "bcd.control_plane=" not in cmdline:
            cmdline = f"{cmdline} bcd.control_plane={guest}"
        return dataclasses.replace(configured, cmdline=cmdline.strip())
    doc = json.loads(raw)
    return Ramdisk(
        kernel=doc["kernel"],
        initrd=doc.get("initrd"),
        kernel_sha256=doc.get("kernelSha256"),
        initrd_sha256=doc.get("initrdSha256"),
        cmdline=doc.get("cmdline", ""),
    )


def userdata_env(*, nats_url: str, bcd_url: str, bcd_sha256: str) -> dict[str, str]:
    """The environment that makes this app's ``userdata.render`` point the installed OS at the
    NATS server at ``nats_url`` (this machine's loopback) as the guests reach it, and at
    ``bcd_url`` (an http URL the guest can fetch: ``http://10.0.2.2:<port>/…``) for bcd."""
    doc = {"controlPlaneUrl": guest_url(nats_url), "bcdUrl": bcd_url, "bcdSha256": bcd_sha256}
    return {USERDATA_ENV: json.dumps(doc)}


def userdata_from_env() -> UserData | None:
    raw = os.environ.get(USERDATA_ENV)
    if not raw:
        return provision.user_data
    doc = json.loads(raw)
    return UserData(
        control_plane_url=doc.get("controlPlaneUrl") or _guest_control_plane() or "",
        bcd_url=doc["bcdUrl"],
        bcd_sha256=doc["bcdSha256"],
    )


HOST_SECTION_PROFILE = "vmlab-host-section"
vmlab_host = define_plugin(
    id="vmlab-host",
    profiles=[
        define_profile(
            id=HOST_SECTION_PROFILE,
            version=1,
            target="metal",
            role="host",
            description="The node's host section: one sysctl unit, for the installed OS's bcd to converge",
            steps=[{"use": "wait.agentJoined", "with": {"role": "node", "fresh": False}}],
            host_config=HOST_CONFIG,
        )
    ],
)

_ramdisk = ramdisk_from_env()
_provision = provision_module(
    modules=[metal(ramdisk=_ramdisk), acme_autoinstall, vmlab_host],
    user_data=userdata_from_env(),
    image_verifier=provision.image_verifier,
)
app = better_compute(modules=[metal(ramdisk=_ramdisk), _provision], plugins=[acme_autoinstall, vmlab_host])
