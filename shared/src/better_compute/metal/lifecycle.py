"""The machine lifecycle as data: states, verbs and the transitions between them (DESIGN section 10).

::

    discovered ──enroll──▶ enrolled ──inspect──▶ inspecting ──▶ inspected ──commission──▶
    commissioning ──▶ ready ──deploy──▶ deploying ──▶ deployed ──release──▶ releasing ──▶ ready
    enrolled | inspected | ready ──adopt──▶ adopting ──▶ deployed
    (any resting state but deployed) ──retire──▶ retiring ──▶ retired
    a workflow of any …ing state that fails or is aborted ──▶ failed (naming workflow and step)

The engine applies these (``bc_engine.metal.api``); this module only says what is allowed, so the
CLI and tests read the same table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final
from urllib.parse import urlsplit

from better_compute.core.errors import BcError, ErrorCode

__all__ = [
    "BMC_SCHEMES",
    "DEFAULT_PROFILES",
    "NODE_STATES",
    "TRANSITIONS",
    "VERBS",
    "Transition",
    "check_verb",
    "parse_bmc_url",
    "parse_selector",
]

NODE_STATES: Final = (
    "discovered",
    "enrolled",
    "inspecting",
    "inspected",
    "commissioning",
    "ready",
    "deploying",
    "deployed",
    "releasing",
    "retiring",
    "retired",
    "adopting",
    "failed",
)


@dataclass(frozen=True)
class Transition:
    """A verb: the states it may start from, the state while its workflow runs, and after."""

    verb: str
    start: tuple[str, ...]
    running: str
    done: str


# ``failed`` may be inspected, commissioned (back to ready), released (wiped back to ready) or
# retired: the ways out of a machine in an unknown state. Deploy needs ready: a failed machine
# is commissioned or released first.
TRANSITIONS: Final[Mapping[str, Transition]] = MappingProxyType(
    {
        t.verb: t
        for t in (
            Transition("inspect", ("enrolled", "inspected", "ready", "failed"), "inspecting", "inspected"),
            Transition("commission", ("inspected", "ready", "failed"), "commissioning", "ready"),
            Transition("deploy", ("ready",), "deploying", "deployed"),
            Transition("release", ("deployed", "failed"), "releasing", "ready"),
            Transition("retire", ("enrolled", "inspected", "ready", "failed"), "retiring", "retired"),
            Transition("adopt", ("enrolled", "inspected", "ready"), "adopting", "deployed"),
        )
    }
)
VERBS: Final = tuple(TRANSITIONS)
"""The verbs that run a workflow (``enroll`` only records the node)."""

DEFAULT_PROFILES: Final[Mapping[str, str]] = MappingProxyType({v: f"metal.{v}" for v in VERBS})
"""The shipped profile each verb starts; ``metal(profiles={…})`` overrides some."""


def check_verb(node_id: str, state: str, verb: str) -> Transition:
    """The transition of ``verb`` for a node in ``state``.

    Raises:
        BcError: ``INVALID_INPUT`` for an unknown verb; ``INVALID_STATE`` when the node is in
            the wrong state, with the reason (``node n_… is deploying; release needs deployed``).
    """
    t = TRANSITIONS.get(verb)
    if t is None:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"unknown verb {verb}; one of {', '.join(VERBS)}", {"path": "verb"}
        )
    if state not in t.start:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"node {node_id} is {state}; {verb} needs {' or '.join(t.start)}",
            {"path": "nodeId", "reason": "wrong-state", "state": state, "allowed": list(t.start)},
        )
    return t


_SELECTOR_ITEM = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?)=([^,=]{0,256})$")
SELECTOR_SITE: Final = "site"


def parse_selector(text: str, *, path: str = "selector") -> dict[str, str]:
    """``site=lab1,rack=r12`` as ``{"site": "lab1", "rack": "r12"}`` (every pair must match).

    ``site`` matches the node's site; every other key a label.

    Raises:
        BcError: ``INVALID_INPUT`` at ``path`` for an empty selector or a malformed pair.
    """
    out: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        m = _SELECTOR_ITEM.match(item)
        if m is None:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"selector item {item[:80]!r} is not key=value", {"path": path}
            )
        out[m.group(1)] = m.group(3)
    if not out:
        raise BcError(ErrorCode.INVALID_INPUT, "the selector is empty", {"path": path})
    return out


BMC_SCHEMES: Final = {"redfish": "https", "redfish+http": "http", "ipmi": None, "sim": None}


def parse_bmc_url(url: str, *, path: str = "bmc") -> dict[str, object]:
    """A BMC given as a URL, as the node's ``bmc`` (without its credential).

    ``redfish://host[:port]/redfish/v1/Systems/1`` → ``{driver: redfish, address:
    https://host[:port], systemId: /redfish/v1/Systems/1}``; ``redfish+http://`` for plain HTTP;
    ``ipmi://host[:port]`` and ``sim://name``. A user or password in the URL is refused: the
    credential is stored through the secrets service, never in the address.

    Raises:
        BcError: ``INVALID_INPUT`` at ``path``.
    """
    parts = urlsplit(url)
    if parts.scheme not in BMC_SCHEMES:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"a BMC URL starts with {', '.join(s + '://' for s in BMC_SCHEMES)}",
            {"path": path},
        )
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "a BMC URL carries no user or password: give the credential separately",
            {"path": path},
        )
    if not parts.hostname:
        raise BcError(ErrorCode.INVALID_INPUT, "the BMC URL names no host", {"path": path})
    try:
        port = parts.port
    except ValueError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, f"bad BMC port: {exc}", {"path": path}) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    hostport = f"{host}:{port}" if port else host
    if parts.scheme.startswith("redfish"):
        out: dict[str, object] = {"driver": "redfish", "address": f"{BMC_SCHEMES[parts.scheme]}://{hostport}"}
        if parts.path not in ("", "/"):
            out["systemId"] = parts.path
        return out
    return {"driver": parts.scheme, "address": hostport}
