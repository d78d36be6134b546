"""Enrollment rules: which discovered nodes enroll themselves, with which labels and BMC.

A rule's ``selector`` is a label expression (``better_compute.provision.labels``: ``=``, ``!=``,
``in``, ``notin``, ``exists``, ``!``, ``and``, and ``>``, ``>=``, ``<``, ``<=`` on numbers) over
the node's **facts**: its labels, ``site``, and these keys read from its discovery inventory
(bcd's ``node.inventory``), which win over a label of the same name:

=========================  =====================================================================
``inventory.vendor``       ``firmware.vendor`` (DMI ``sys_vendor``: ``Dell Inc.``)
``inventory.product``      ``firmware.product`` (DMI ``product_name``: ``PowerEdge R650``)
``inventory.serial``       the serial number
``inventory.cpu_model``    ``cpus.model``
``inventory.cpu_cores``    ``cpus.cores`` (physical cores, all sockets)
``inventory.memory_gib``   ``memory.totalBytes`` in GiB, rounded to the nearest
``inventory.gpus``         how many GPUs, ``inventory.disks`` disks, ``inventory.nics`` NICs
``inventory.boot_mode``    ``uefi`` or ``bios``
``inventory.bmc_address``  ``bmc.address``, when the inventory reports the BMC's address
=========================  =====================================================================

The BMC template's ``address`` may hold ``{fact}`` placeholders (``https://{inventory.bmc_address}``).
A machine that is not enrolled yet says what it likes about itself, so an address made from its
facts must be an IP address inside one of the rule's ``addressCidrs`` (required with a
placeholder): otherwise a machine could send the site agent, and the rule's credential, anywhere.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision.labels import LabelExpression, parse_label_expression

__all__ = [
    "HOSTNAME_FACT",
    "INVENTORY_FACTS",
    "check_name_template",
    "check_rule_bmc",
    "host_name",
    "inventory_facts",
    "node_facts",
    "node_name_from",
    "parse_rule_selector",
    "render_node_name",
    "render_rule_bmc",
]

INVENTORY_FACTS: Final = (
    "inventory.vendor",
    "inventory.product",
    "inventory.serial",
    "inventory.cpu_model",
    "inventory.cpu_cores",
    "inventory.memory_gib",
    "inventory.gpus",
    "inventory.disks",
    "inventory.nics",
    "inventory.boot_mode",
    "inventory.bmc_address",
)
"""The inventory facts a selector (and a BMC address template) can use."""

SITE_FACT: Final = "site"
_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z0-9._-]+)\}")
# What a fact may put into an address: a host name or an IP (v6 in brackets), nothing that
# would change the URL's shape (no /, @, ?, # or spaces).
_SAFE_VALUE: Final = re.compile(r"^[A-Za-z0-9.:\[\]-]{1,255}$")
_GIB: Final = 1024**3


def _get(doc: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float | str):
        text = str(value).strip()
        return text or None
    return None


def inventory_facts(inventory: Any) -> dict[str, str]:
    """The ``inventory.*`` facts of a node's inventory (absent when the inventory lacks them)."""
    if not isinstance(inventory, Mapping):
        return {}
    memory = _get(inventory, "memory", "totalBytes")
    counts = {
        key: len(items)
        for key, items in (
            ("gpus", inventory.get("gpus")),
            ("disks", inventory.get("disks")),
            ("nics", inventory.get("nics")),
        )
        if isinstance(items, list)
    }
    raw: dict[str, Any] = {
        "inventory.vendor": _get(inventory, "firmware", "vendor"),
        "inventory.product": _get(inventory, "firmware", "product"),
        "inventory.serial": inventory.get("serial"),
        "inventory.cpu_model": _get(inventory, "cpus", "model"),
        "inventory.cpu_cores": _get(inventory, "cpus", "cores"),
        "inventory.memory_gib": round(memory / _GIB)
        if isinstance(memory, int | float) and not isinstance(memory, bool)
        else None,
        "inventory.gpus": counts.get("gpus"),
        "inventory.disks": counts.get("disks"),
        "inventory.nics": counts.get("nics"),
        "inventory.boot_mode": _get(inventory, "firmware", "bootMode"),
        "inventory.bmc_address": _get(inventory, "bmc", "address"),
    }
    return {k: t for k, v in raw.items() if (t := _text(v)) is not None}


def node_facts(labels: Mapping[str, str], site_id: str, inventory: Any) -> dict[str, str]:
    """What a rule's selector is matched against: labels, ``site``, inventory facts (the last
    win: a label cannot pretend to be the inventory)."""
    return {**labels, SITE_FACT: site_id, **inventory_facts(inventory)}


def parse_rule_selector(text: str, *, path: str = "selector") -> LabelExpression:
    """The selector, parsed (``INVALID_INPUT`` at ``path`` naming the character)."""
    return parse_label_expression(text, path=path)


def _placeholders(address: str) -> list[str]:
    return _PLACEHOLDER.findall(address)


def check_rule_bmc(bmc: Mapping[str, Any], *, path: str = "bmc") -> None:
    """A BMC template's address and ``addressCidrs``: every placeholder a known fact, each CIDR
    a network, CIDRs given when the address has a placeholder.

    Raises:
        BcError: ``INVALID_INPUT`` at ``bmc.address`` or ``bmc.addressCidrs[i]``.
    """
    address = str(bmc.get("address", ""))
    names = _placeholders(address)
    for name in names:
        if name not in INVENTORY_FACTS and name != SITE_FACT:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"unknown fact {{{name}}} in the BMC address; one of {', '.join(INVENTORY_FACTS)}, site",
                {"path": f"{path}.address"},
            )
    if "{" in _PLACEHOLDER.sub("", address) or "}" in _PLACEHOLDER.sub("", address):
        raise BcError(
            ErrorCode.INVALID_INPUT, "a placeholder is {fact}, like {inventory.bmc_address}",
            {"path": f"{path}.address"},
        )  # fmt: skip
    cidrs = list(bmc.get("addressCidrs") or [])
    for i, cidr in enumerate(cidrs):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"{cidr[:64]!r} is not a network like 10.1.0.0/16",
                {"path": f"{path}.addressCidrs[{i}]"},
            ) from None  # fmt: skip
    if names and not cidrs:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "a BMC address made from the machine's own facts needs addressCidrs: the networks its BMC"
            " may be on (a machine not enrolled yet could name any address)",
            {"path": f"{path}.addressCidrs"},
        )


def _host(driver: str, address: str) -> str | None:
    if "://" in address:
        return urlsplit(address).hostname
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.partition(":")[0] if address.count(":") == 1 else address


def render_rule_bmc(bmc: Mapping[str, Any], facts: Mapping[str, str], *, rule: str) -> dict[str, Any]:
    """The node's BMC from a rule's template and the node's facts.

    Raises:
        BcError: ``INVALID_STATE`` (reason ``bmc-address-unresolved``) when a placeholder's fact
            is missing or unsafe, or the address is not an IP inside ``addressCidrs``.
    """
    address = str(bmc["address"])
    names = _placeholders(address)

    def refuse(why: str) -> BcError:
        return BcError(
            ErrorCode.INVALID_STATE,
            f"enrollment rule {rule}: {why}",
            {"path": "bmc.address", "reason": "bmc-address-unresolved", "ruleId": rule},
        )

    def fill(m: re.Match[str]) -> str:
        value = facts.get(m.group(1))
        if value is None:
            raise refuse(f"the node has no {m.group(1)} for the BMC address")
        if not _SAFE_VALUE.match(value):
            raise refuse(f"{m.group(1)} is not a host name or IP address")
        return value

    filled = _PLACEHOLDER.sub(fill, address)
    if names:
        host = _host(str(bmc["driver"]), filled)
        try:
            ip = ipaddress.ip_address(host or "")
        except ValueError:
            raise refuse(f"the BMC address {filled[:200]} is not an IP address") from None
        nets = [ipaddress.ip_network(c, strict=False) for c in bmc.get("addressCidrs") or []]
        if not any(ip in net for net in nets):
            raise refuse(f"the BMC address {ip} is outside the rule's addressCidrs")
    out = {k: v for k, v in bmc.items() if k != "addressCidrs" and v is not None}
    out["address"] = filled
    return out


# -- node names ---------------------------------------------------------------------------

HOSTNAME_FACT: Final = "hostname"
"""The short host name the machine reported when it joined (a name template may use it)."""
_NOT_NAME: Final = re.compile(r"[^a-z0-9.-]+")
_MAX_NODE_NAME: Final = 63
_ANONYMOUS_HOSTS: Final = frozenset({"localhost", "localhost.localdomain", "ubuntu", "debian", "archiso"})


def node_name_from(text: str | None) -> str | None:
    """``text`` made a node name (``core.names.NODE_NAME_PATTERN``): lowercase, other characters
    as ``-``, at most 63 long, starting and ending with a letter or digit; None when nothing is
    left."""
    if not text:
        return None
    name = _NOT_NAME.sub("-", text.strip().lower())[:_MAX_NODE_NAME].strip(".-")
    return name or None


def host_name(reported: str | None) -> str | None:
    """The node name a discovered machine's reported host name gives: its first DNS label made
    a name (``r12-n3.lab1.example.com`` → ``r12-n3``); None for none or a stock one
    (``localhost``, a live image's default) that many machines report alike."""
    if not reported or reported.strip().lower() in _ANONYMOUS_HOSTS:
        return None
    short = reported.strip().partition(".")[0]
    if short.lower() in _ANONYMOUS_HOSTS:
        return None
    return node_name_from(short)


def check_name_template(template: str, *, path: str = "nameTemplate") -> None:
    """A rule's name template: ``{fact}`` placeholders of known facts (the inventory's, ``site``,
    ``hostname``) and name characters around them (``rack1-{inventory.serial}``).

    Raises:
        BcError: ``INVALID_INPUT`` at ``path``.
    """
    for name in _placeholders(template):
        if name not in INVENTORY_FACTS and name not in (SITE_FACT, HOSTNAME_FACT):
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"unknown fact {{{name}}} in the name template; one of {', '.join(INVENTORY_FACTS)},"
                f" {SITE_FACT}, {HOSTNAME_FACT}",
                {"path": path},
            )
    rest = _PLACEHOLDER.sub("", template)
    if "{" in rest or "}" in rest:
        raise BcError(ErrorCode.INVALID_INPUT, "a placeholder is {fact}, like {hostname}", {"path": path})
    if _NOT_NAME.search(rest.lower()) or not (rest.strip(".-") or _placeholders(template)):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "a name template holds letters, digits, '-', '.' and {fact} placeholders, e.g."
            " 'rack1-{inventory.serial}'",
            {"path": path},
        )


def render_node_name(template: str, facts: Mapping[str, str], *, rule: str) -> str:
    """The node's name from a rule's name template and the node's facts (made a name as
    ``node_name_from`` does).

    Raises:
        BcError: ``INVALID_STATE`` (reason ``name-unresolved``) when a placeholder's fact is
            missing or nothing of a name is left.
    """

    def refuse(why: str) -> BcError:
        return BcError(
            ErrorCode.INVALID_STATE,
            f"enrollment rule {rule}: {why}",
            {"path": "nameTemplate", "reason": "name-unresolved", "ruleId": rule},
        )

    def fill(m: re.Match[str]) -> str:
        value = facts.get(m.group(1))
        if value is None:
            raise refuse(f"the node has no {m.group(1)} for its name")
        return value

    name = node_name_from(_PLACEHOLDER.sub(fill, template))
    if name is None:
        raise refuse("the name template gives an empty name")
    return name
