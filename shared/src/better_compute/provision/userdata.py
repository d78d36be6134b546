"""``userdata.render``: the shipped step that renders a profile's user data for its node.

It mints a fresh single-use ``provisioned`` join token (2 hours, or the profile's
``tokenTtlSeconds``), renders the pinned profile's ``userData`` template with it, stores the
document through ``ctx.secrets`` and returns only references:
``{userDataRef, kind, joinTokenId}``. The token and the document never reach the result.

Built-in templates exist for kinds ``cloud-init`` and ``ignition``; both are built as data
and serialised (JSON is valid cloud-config YAML), never spliced. Kind ``talos`` ships no
template: name one of yours with ``userData.template``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import manifest

from .steps import define_step
from .templates import Template, render_template, template_variables

__all__ = ["BUILTIN_TEMPLATES", "DEFAULT_TOKEN_TTL_SECONDS", "SHIPPED_STEPS", "userdata_render"]

DEFAULT_TOKEN_TTL_SECONDS: Final = 7200
_CLAIM_LABELS: Final = {
    "mac": "mac",
    "productUuid": "product_uuid",
    "serial": "serial",
    "gpuUuid": "gpu_uuid",
}


def _install_commands(v: Mapping[str, str]) -> list[str]:
    # The values are checked by render_template (no line breaks, no "{{"), and each one is a
    # single argument here, quoted for the shell.
    return [
        f"curl -fsSL -o /usr/local/bin/bcd {_q(v['bcdUrl'])}",
        f"echo {_q(v['bcdSha256'] + '  /usr/local/bin/bcd')} | sha256sum -c -",
        "chmod 0755 /usr/local/bin/bcd",
        f"/usr/local/bin/bcd join --control-plane {_q(v['controlPlaneUrl'])} --node {_q(v['nodeId'])}"
        " --token-file /etc/bcd/join-token",
    ]


def _q(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def cloud_init(v: Mapping[str, str]) -> str:
    """A ``#cloud-config`` document (JSON, which is YAML) that installs and joins bcd."""
    doc: dict[str, Any] = {
        "hostname": v["hostname"],
        "write_files": [{"path": "/etc/bcd/join-token", "permissions": "0600", "content": v["joinToken"]}],
        "runcmd": _install_commands(v),
    }
    return "#cloud-config\n" + json.dumps(doc, indent=2) + "\n"


def ignition(v: Mapping[str, str]) -> str:
    """An Ignition 3.4 config that writes the join token and a unit that installs bcd."""
    from urllib.parse import quote

    script = "\n".join(["#!/bin/sh", "set -eu", *_install_commands(v)]) + "\n"

    def file(path: str, mode: int, text: str) -> dict[str, Any]:
        return {"path": path, "mode": mode, "contents": {"source": "data:," + quote(text)}}

    doc = {
        "ignition": {"version": "3.4.0"},
        "storage": {
            "files": [
                file("/etc/hostname", 0o644, v["hostname"]),
                file("/etc/bcd/join-token", 0o600, v["joinToken"]),
                file("/usr/local/sbin/bcd-install", 0o755, script),
            ]
        },
        "systemd": {
            "units": [
                {
                    "name": "bcd-install.service",
                    "enabled": True,
                    # Runs only while a join token waits (bcd join removes it), so later boots skip it.
                    "contents": "[Unit]\nDescription=Install and join bcd\n"
                    "Wants=network-online.target\nAfter=network-online.target\n"
                    "ConditionPathExists=/etc/bcd/join-token\n"
                    "[Service]\nType=oneshot\nExecStart=/usr/local/sbin/bcd-install\n"
                    "[Install]\nWantedBy=multi-user.target\n",
                }
            ]
        },
    }  # fmt: skip
    return json.dumps(doc, indent=2) + "\n"


BUILTIN_TEMPLATES: Final[Mapping[str, Template]] = {"cloud-init": cloud_init, "ignition": ignition}


def _config(message: str, path: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


async def _render(_input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    if ctx.pki is None or ctx.secrets is None:
        raise _config("userdata.render needs the pki and secrets services", "pki")
    node = ctx.node
    if node is None:
        raise _config("userdata.render renders for a node: start the workflow with one", "nodeId")
    profile = getattr(ctx, "profile", None)
    if profile is None or profile.user_data is None:
        raise _config("the workflow's profile has no userData", "userData")
    ud = profile.user_data
    provision = getattr(ctx, "provision", None)
    settings = getattr(provision, "user_data", None)
    templates: Mapping[str, Template] = getattr(settings, "templates", None) or {}
    if ud.template is not None:
        template = templates.get(ud.template)
        if template is None:
            raise _config(f"no user-data template named {ud.template}", "userData.template")
    else:
        found = BUILTIN_TEMPLATES.get(ud.kind)
        if found is None:
            raise _config(
                f"kind {ud.kind} ships no template: name one with userData.template", "userData.template"
            )
        template = found
    labels = getattr(node, "labels", {}) or {}
    expect = {claim: labels[label] for label, claim in _CLAIM_LABELS.items() if label in labels}
    token = await ctx.pki.issue_join_token(
        tenant_id=node.tenant_id,
        role="provisioned",
        site_id=node.site_id,
        ttl_seconds=ud.token_ttl_seconds or DEFAULT_TOKEN_TTL_SECONDS,
        max_uses=1,
        expect=expect or None,
    )
    variables = template_variables(node_id=node.id, join_token=token.token, user_data=settings)
    document = render_template(template, variables)
    ref = await ctx.secrets.put(
        document.encode(), idempotency_key=ctx.idempotency_key, label=f"userdata {ud.kind}"
    )
    return {"userDataRef": ref, "kind": ud.kind, "joinTokenId": token.join_token_id}


userdata_render = define_step(
    id="userdata.render",
    runs_on="control-plane",
    timeout="2m",
    input=manifest({}),
    run=_render,
    description="Render the profile's user data with a fresh single-use join token; return only references",
)

SHIPPED_STEPS: Final = (userdata_render,)
