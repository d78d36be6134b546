"""``userdata.render``: the shipped step that renders a profile's user data for its node.

It mints a fresh single-use ``provisioned`` join token (2 hours, or the profile's
``tokenTtlSeconds``), renders the pinned profile's ``userData`` template with it, stores the
document through ``ctx.secrets`` and returns only references:
``{userDataRef, kind, joinTokenId}``. The token and the document never reach the result.

Built-in templates exist for kinds ``cloud-init``, ``ignition`` and ``talos``; all are built as
data and serialised (JSON is valid YAML), never spliced, and the tests run the formats' own
validators on them (``cloud-init schema``, ``ignition-validate``; for Talos, whose ``talosctl``
no package registry here carries, Talos' published machine configuration JSON schema).

``provisioned_target_resolver()`` maps a ``provisioned`` join token back to the node (and
workflow) whose ``userdata.render`` minted it, through the step result's ``joinTokenId``: the
installed OS joins as the same node it was rendered for.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.core.manifest import manifest
from better_compute.wire.pki import JoinExpect

from .context import Sql
from .steps import define_step
from .templates import Template, render_template, template_variables

__all__ = [
    "BUILTIN_TEMPLATES",
    "DEFAULT_TOKEN_TTL_SECONDS",
    "IGNITION_VERSION",
    "SHIPPED_STEPS",
    "ProvisionedTarget",
    "provisioned_target_resolver",
    "userdata_render",
]

DEFAULT_TOKEN_TTL_SECONDS: Final = 7200
# The newest stable Ignition spec that every Ignition from 2.14 (Debian 12, Flatcar, Fedora
# CoreOS since 2022) reads; the template uses nothing a later 3.x added.
IGNITION_VERSION: Final = "3.3.0"
# The node labels that bind a claim, by JoinExpect field; the label and the wire use one
# spelling (``productUuid``), so the expectation goes out as bc-pki reads it.
_CLAIM_LABELS: Final = {
    "mac": "mac",
    "product_uuid": "productUuid",
    "serial": "serial",
    "gpu_uuid": "gpuUuid",
}
# $1 node id: its latest inventory (inspect.collect keeps the node-signed node.inventory there)
NODE_INVENTORY: Final = "SELECT inventory FROM nodes WHERE id = $1"


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
    """An Ignition 3.x config (``IGNITION_VERSION``) that writes the join token and a unit that
    installs bcd."""
    from urllib.parse import quote

    script = "\n".join(["#!/bin/sh", "set -eu", *_install_commands(v)]) + "\n"

    def file(path: str, mode: int, text: str) -> dict[str, Any]:
        return {"path": path, "mode": mode, "contents": {"source": "data:," + quote(text)}}

    doc = {
        "ignition": {"version": IGNITION_VERSION},
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


def talos(v: Mapping[str, str]) -> str:
    """Talos machine configuration documents to apply with the cluster's own machine config (a
    config patch: Talos keeps no shell to install bcd with): the node's hostname, and the
    ``bcd`` extension service's configuration, whose config file is the join token. The Talos
    image must carry bcd as a system extension named ``bcd``. Each document is JSON, which is
    YAML; documents are separated by ``---``."""
    documents: list[dict[str, Any]] = [
        {"apiVersion": "v1alpha1", "kind": "HostnameConfig", "auto": "off", "hostname": v["hostname"]},
        {
            "apiVersion": "v1alpha1",
            "kind": "ExtensionServiceConfig",
            "name": "bcd",
            "configFiles": [{"content": v["joinToken"], "mountPath": "/etc/bcd/join-token"}],
            "environment": [f"BCD_CONTROL_PLANE={v['controlPlaneUrl']}", f"BCD_NODE={v['nodeId']}"],
        },
    ]
    return "---\n".join(json.dumps(doc, indent=2) + "\n" for doc in documents)


BUILTIN_TEMPLATES: Final[Mapping[str, Template]] = {
    "cloud-init": cloud_init,
    "ignition": ignition,
    "talos": talos,
}


def _config(message: str, path: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


async def _expect(ctx: Any, node: Any) -> JoinExpect | None:
    """The hardware the installed OS must show to join: a label of the claim's name wins, else
    the node's first enrolled MAC, and the product UUID and serial of its latest inventory."""
    labels = getattr(node, "labels", {}) or {}
    claims: dict[str, str] = {f: labels[label] for f, label in _CLAIM_LABELS.items() if label in labels}
    macs = getattr(node, "macs", ()) or ()
    if "mac" not in claims and macs:
        claims["mac"] = str(macs[0]).lower()
    rows = await ctx.sql.query(NODE_INVENTORY, node.id)
    inventory = rows[0]["inventory"] if rows else None
    if isinstance(inventory, str):
        inventory = json.loads(inventory)
    if isinstance(inventory, Mapping):
        for claim, key in (("product_uuid", "productUuid"), ("serial", "serial")):
            value = inventory.get(key)
            if claim not in claims and isinstance(value, str) and value:
                claims[claim] = value
    return JoinExpect(**claims) if claims else None


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
    token = await ctx.pki.issue_join_token(
        tenant_id=node.tenant_id,
        role="provisioned",
        site_id=node.site_id,
        ttl_seconds=ud.token_ttl_seconds or DEFAULT_TOKEN_TTL_SECONDS,
        max_uses=1,
        expect=await _expect(ctx, node),
    )
    variables = template_variables(node_id=node.id, join_token=token.token, user_data=settings)
    document = render_template(template, variables)
    # for the node: the deploy step's image write hands the reference to the node's bcd, which
    # fetches the document through the gate and writes it onto the config drive
    ref = await ctx.secrets.put(
        document.encode(), idempotency_key=ctx.idempotency_key, label=f"userdata {ud.kind}", for_node=True
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

# $1 join token id: the latest succeeded userdata.render that minted it, with its workflow's node.
RENDERED_FOR_TOKEN: Final = """
SELECT w.node_id, w.id AS workflow_id, w.tenant_id
FROM workflow_steps s JOIN workflows w ON w.id = s.workflow_id
WHERE s.action = 'userdata.render' AND s.state = 'succeeded' AND s.result->>'joinTokenId' = $1
ORDER BY s.finished_at DESC
LIMIT 1
"""


@dataclass(frozen=True, slots=True)
class ProvisionedTarget:
    """The node a ``provisioned`` join token was rendered for."""

    node_id: str
    workflow_id: str
    tenant_id: str


ProvisionedTargetResolver = Callable[[Sql, str], Awaitable[ProvisionedTarget | None]]


def provisioned_target_resolver() -> ProvisionedTargetResolver:
    """``resolve(sql, join_token_id)``: the node whose rendered user data holds that token.

    ``None`` when no succeeded ``userdata.render`` minted it (a token issued by hand, or one
    whose workflow has no node); the join should then not re-key any node.
    """

    async def resolve(sql: Sql, join_token_id: str) -> ProvisionedTarget | None:
        rows = await sql.query(RENDERED_FOR_TOKEN, join_token_id)
        if not rows or rows[0]["node_id"] is None:
            return None
        row = rows[0]
        return ProvisionedTarget(
            node_id=row["node_id"], workflow_id=row["workflow_id"], tenant_id=row["tenant_id"]
        )

    return resolve
