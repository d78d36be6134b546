"""The deployment the fleet harness runs: metal with a (simulated) bcd ramdisk, and the reference
page's ``ubuntu-24.04-autoinstall`` plugin as written (snake_case), whose ISO goes where the
simulated BMC can fetch it.

Services load it with ``BC_APP=better_compute.testing.metal_sim.app:app``. ``autoinstall.renderIso``
stands for "your ISO build and storage behind the site cache": it writes the rendered autoinstall
document as the ISO into ``$BC_SIM_MEDIA_DIR`` (named by its sha256) and returns its URL under
``$BC_SIM_MEDIA_URL``, which ``FleetStack`` serves over HTTP. The document holds the join token, as
a real autoinstall ISO does; the step's result holds only the URL. The simulator boots such a
medium as the installer would: it writes the OS to the disk, runs the document's
``late-commands`` (which put the token in ``/etc/bcd/join-token``) and starts the installed OS's
bcd, which joins with it and re-keys the node.

Catalog images are trusted when ``testing.images.SIM_IMAGE_SIGNER`` signed them (the app's
``image_verifier``); ``fleet_stack`` registers ``ubuntu@24.04`` so signed.

The profile is the page's, plus ``writes_disk=True`` (the installer it boots writes the disk: under
the destructive-batch quorum its medium, boot device and power cycle wait for the approvers, a
declaration the engine requires of a profile that inserts a medium; the page's example predates
it) and a ``hostConfig`` (one ``sysctl`` unit) so that a deploy also gives the node a host section
for the installed bcd to converge.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Final

from ...app import better_compute
from ...core import define_plugin, manifest
from ...core.errors import BcError, ErrorCode
from ...files import atomic_write
from ...metal import Ramdisk, metal
from ...provision import UserData, define_profile, define_step, provision_module, render_template
from ..images import sim_image_verifier

__all__ = ["AUTOINSTALL_PASSWORD_HASH", "AUTOINSTALL_TEMPLATE", "HOST_CONFIG", "RAMDISK", "app"]

# Subiquity requires identity.username and identity.password (a crypt(3) hash): this is the
# SHA-512 hash of a random password nobody kept, so the account has no usable password (give it
# an SSH key to log in). The late-commands run in the installer with the new system at /target,
# where nothing of ours exists yet: the folder first, then the token, readable by root only.
_SALT, _HASH = (
    ".F1bWZWCDE2bgYG9",
    "4KCTt12Cyf/iNPrRG5O6o93taRZ3TyJTT1YJPjN4jHcQJ4HrsMly1QLEdS7uSXai7SSkIqUrjGZLXuUCe43sg.",
)
AUTOINSTALL_PASSWORD_HASH: Final = f"$6${_SALT}${_HASH}"
AUTOINSTALL_TEMPLATE: Final = (
    "#cloud-config\nautoinstall:\n  version: 1\n  identity:\n    hostname: {{hostname}}\n"
    f"    username: ubuntu\n    password: '{AUTOINSTALL_PASSWORD_HASH}'\n"
    "  late-commands:\n"
    "    - mkdir -p /target/etc/bcd\n"
    "    - echo {{joinToken}} > /target/etc/bcd/join-token\n"
    "    - chmod 600 /target/etc/bcd/join-token\n"
)
HOST_CONFIG: Final = {"units": [{"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}}]}
# The simulator reads no kernel: the URL only has to be one (the site agent serves it as written).
RAMDISK: Final = Ramdisk(kernel="http://127.0.0.1:9/bcd-ramdisk/vmlinuz", cmdline="console=ttyS0")


async def _publish_iso(digest: str, user_data: str) -> str:
    folder = os.environ.get("BC_SIM_MEDIA_DIR")
    base = os.environ.get("BC_SIM_MEDIA_URL")
    if not folder or not base:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "autoinstall.renderIso needs BC_SIM_MEDIA_DIR and BC_SIM_MEDIA_URL (the fleet harness sets them)",
            {"path": "BC_SIM_MEDIA_DIR"},
        )
    target = Path(folder) / "autoinstall" / f"{digest}.iso"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():  # named by its content: a re-run writes the same bytes
        atomic_write(target, user_data)
    return f"{base.rstrip('/')}/autoinstall/{digest}.iso"


async def _render_iso(_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = ctx.node
    token = await ctx.pki.issue_join_token(
        tenant_id="root", role="provisioned", site_id=node.site_id, ttl_seconds=7200, max_uses=1
    )
    user_data = render_template(
        AUTOINSTALL_TEMPLATE, {"hostname": node.id.replace("_", "-"), "joinToken": token.token}
    )
    digest = hashlib.sha256(user_data.encode()).hexdigest()
    return {"url": await _publish_iso(digest, user_data)}


render_autoinstall_iso = define_step(
    id="autoinstall.renderIso",
    runs_on="control-plane",
    timeout="5m",
    retry_safe=False,
    input=manifest({}),
    run=_render_iso,
)

# The reference page's ``ubuntu-24.04-autoinstall`` steps, as written there (snake_case aside).
AUTOINSTALL_STEPS: Final[list[dict[str, Any]]] = [
    {"use": "autoinstall.renderIso"},
    {"use": "media.insert", "on": "site", "with": {"fromStep": "autoinstall.renderIso"}},
    {"use": "management.setBootDevice", "on": "site", "with": {"device": "cd"}},
    {"use": "power.setPower", "on": "site", "with": {"action": "cycle"}},
    {"use": "wait.agentJoined", "with": {"role": "node"}},
    {"use": "media.eject", "on": "site"},
]

ubuntu_autoinstall = define_profile(
    id="ubuntu-24.04-autoinstall",
    version=1,
    target="metal",
    role="host",
    steps=AUTOINSTALL_STEPS,
    host_config=HOST_CONFIG,
    writes_disk=True,
)

acme_autoinstall = define_plugin(
    id="acme-autoinstall", extensions=[render_autoinstall_iso], profiles=[ubuntu_autoinstall]
)

provision = provision_module(
    modules=[metal(ramdisk=RAMDISK), acme_autoinstall],
    user_data=UserData(
        control_plane_url="https://bc.sim.invalid",
        bcd_url="https://downloads.sim.invalid/bcd/bcd-linux-amd64",
        bcd_sha256="ab" * 32,
    ),
    image_verifier=sim_image_verifier,  # images signed by the simulator's test key (testing.images)
)
app = better_compute(modules=[metal(ramdisk=RAMDISK), provision], plugins=[acme_autoinstall])
