"""The reference page's examples as written (snake_case), in a plugin, with metal's steps.

``autoinstall.renderIso`` and the ``ubuntu-24.04-autoinstall`` profile (walkthrough 1) and
``wait.talosReady`` with a ``talos`` profile. Services load it with
``--app metal_steps_app:app`` (tests/support is on PYTHONPATH).
"""

from __future__ import annotations

import hashlib
from typing import Any

from better_compute.app import better_compute
from better_compute.core import define_plugin, field, manifest
from better_compute.metal import Ramdisk, http_via_site, metal
from better_compute.metal.steps import node_addresses
from better_compute.provision import (
    UserData,
    define_profile,
    define_step,
    provision_module,
    render_template,
    step_not_ready,
)
from better_compute.testing.metal_sim.app import AUTOINSTALL_STEPS

AUTOINSTALL_TEMPLATE = (
    "#cloud-config\nautoinstall:\n  version: 1\n  identity:\n    hostname: {{hostname}}\n"
    "  late-commands:\n    - echo {{joinToken}} > /target/etc/bcd/join-token\n"
)


async def _publish_iso(ctx: Any, digest: str, user_data: str) -> None:
    # "your ISO build and storage behind the site cache": here, the document kept as a secret
    # (it holds a join token), keyed by the step run so a re-run stores nothing twice
    await ctx.secrets.put(user_data.encode(), idempotency_key=ctx.idempotency_key)


async def _render_iso(_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    node = ctx.node
    token = await ctx.pki.issue_join_token(
        tenant_id="root", role="provisioned", site_id=node.site_id, ttl_seconds=7200, max_uses=1
    )
    user_data = render_template(
        AUTOINSTALL_TEMPLATE, {"hostname": node.id.replace("_", "-"), "joinToken": token.token}
    )
    digest = hashlib.sha256(user_data.encode()).hexdigest()
    await _publish_iso(ctx, digest, user_data)
    return {"url": f"https://cache.site-a/autoinstall/{digest}.iso"}


render_autoinstall_iso = define_step(
    id="autoinstall.renderIso",
    runs_on="control-plane",
    timeout="5m",
    retry_safe=False,
    input=manifest({}),
    run=_render_iso,
)


async def _talos_ready(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    [address, *_] = await node_addresses(ctx)
    response = await http_via_site(
        ctx, {"url": f"https://{address}:{input['port']}/machine/version", "poll": True}
    )
    if response.get("status") != 200:
        raise step_not_ready(2_000)
    return {"status": response["status"], "version": response.get("body")}


talos_ready = define_step(
    id="wait.talosReady",
    runs_on="control-plane",
    relays=["site"],
    sends=["site.httpProxy"],  # http_via_site enqueues site.httpProxy, a destructive kind
    timeout="20m",
    retry_safe=True,
    input=manifest({"port": field.int(min=1, max=65535).default(50000)}),
    run=_talos_ready,
)

ubuntu_autoinstall = define_profile(
    id="ubuntu-24.04-autoinstall",
    version=1,
    target="metal",
    role="host",
    steps=AUTOINSTALL_STEPS,
    writes_disk=True,  # the installer it boots writes the disk
)
talos = define_profile(
    id="talos", version=1, target="metal", role="host", steps=[{"use": "wait.talosReady", "on": "site"}]
)

acme_autoinstall = define_plugin(
    id="acme-autoinstall",
    extensions=[render_autoinstall_iso, talos_ready],
    profiles=[ubuntu_autoinstall, talos],
)

RAMDISK = Ramdisk(
    kernel="https://cache.site-a/bcd/vmlinuz",
    initrd="https://cache.site-a/bcd/initrd.img",
    cmdline="console=ttyS0",
)
provision = provision_module(
    modules=[metal(ramdisk=RAMDISK), acme_autoinstall],
    user_data=UserData(
        control_plane_url="https://bc.test.example",
        bcd_url="https://downloads.test.example/bcd/0.1.0/bcd-linux-amd64",
        bcd_sha256="ab" * 32,
    ),
)
app = better_compute(modules=[metal(ramdisk=RAMDISK), provision], plugins=[acme_autoinstall])
