"""``http_via_site``: one HTTP request from the site agent to the machine's own address.

A relaying helper for control-plane steps (``wait.talosReady`` on the reference page): it sends
``site.httpProxy`` as a command of the calling step attempt (find-before-create by key) and
returns the response once the site agent relayed it. A step that calls it declares
``sends=['site.httpProxy']``: the kind is destructive (a machine's API can reset or wipe it), so
with the quorum on it must be in the workflow's batch.

SSRF checks happen twice. Here, before anything is sent: the URL is http(s) with a host and no
credentials, a literal address that is loopback, link-local (the cloud metadata address among
them), unspecified, multicast or reserved is refused, and the host must be one of the node's
recorded addresses. The command carries those addresses (``nodeAddresses``), and the site agent
checks again after resolving the name, against its own and the control plane's addresses too.

The node's recorded addresses are its ``address`` label and the ``addresses`` list of its
latest inventory.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from better_compute.core.errors import BcError, ErrorCode

from ..commands import SITE_HTTP_PROXY
from ._relay import relay, workflow_node

__all__ = ["NODE_ADDRESSES", "http_via_site", "node_addresses"]

NODE_ADDRESSES: Final = (
    "SELECT labels->>'address' AS label, inventory->'addresses' AS addresses FROM nodes WHERE id = $1"
)
_REQUEST_FIELDS: Final = ("method", "headers", "body", "poll", "insecure")


def _refused(message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": "url", "reason": "ssrf-refused"})


async def node_addresses(ctx: Any) -> list[str]:
    """The workflow's node's recorded addresses (``address`` label, inventory ``addresses``)."""
    node = workflow_node(ctx, "http_via_site")
    rows = await ctx.sql.query(NODE_ADDRESSES, node.id)
    found: list[str] = []
    if rows:
        label, listed = rows[0]["label"], rows[0]["addresses"]
        if isinstance(listed, str):
            listed = json.loads(listed)
        for value in [label, *(listed if isinstance(listed, list) else [])]:
            if isinstance(value, str) and value and value not in found:
                found.append(value)
    return found


def check_target(url: str, addresses: list[str]) -> str:
    """The URL's host once it passes the control plane's SSRF checks."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refused("expected an http(s) URL with a host")
    if parts.username or parts.password:
        raise _refused("no credentials in the URL")
    host = parts.hostname
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
            raise _refused(f"{host} is not an address of a machine")
        recorded = {str(ipaddress.ip_address(a)) for a in addresses if _is_ip(a)}
        if str(ip) not in recorded:
            raise _refused(f"{host} is not one of the node's recorded addresses")
    elif host.lower() not in {a.lower() for a in addresses}:
        raise _refused(f"{host} is not one of the node's recorded addresses")
    return host


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


async def http_via_site(ctx: Any, request: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
    """Relay one HTTP request to the workflow's node through its site agent.

    Args:
        ctx: the calling step's context (the step declares ``sends=['site.httpProxy']``).
        request: ``{url, method?, headers?, body?, poll?, insecure?}``; with ``poll`` the site
            agent tries again (connection failures, 5xx) until the command's deadline.
        key: tells several requests of one step apart.

    Returns:
        The response: ``{status, headers, body}`` (or ``bodyBase64``).

    Raises:
        BcError: ``INVALID_INPUT`` (reason ``ssrf-refused``) for a refused target; what
            ``await_command`` raises (``step_not_ready`` while it runs, ``DRIVER_ERROR``).
    """
    url = request.get("url")
    if not isinstance(url, str):
        raise BcError(ErrorCode.INVALID_INPUT, "give the url to request", {"path": "url"})
    addresses = await node_addresses(ctx)
    if not addresses:
        node = workflow_node(ctx, "http_via_site")
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node.id} has no recorded address to send a request to",
            {"path": "nodeAddresses", "reason": "no-address", "nodeId": node.id},
        )
    check_target(url, addresses)
    payload: dict[str, Any] = {"url": url, "nodeAddresses": addresses}
    payload.update({k: request[k] for k in _REQUEST_FIELDS if request.get(k) is not None})
    done = await relay(ctx, kind=SITE_HTTP_PROXY.name, payload=payload, key=key)
    response = done["result"]
    return response if isinstance(response, dict) else {"result": response}
