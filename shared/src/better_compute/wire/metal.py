"""Metal's part of the engine's contract: the node's BMC and MACs, the lifecycle verbs
(``metal.<verb>``) and ``metal.bulk`` (camelCase on the wire).

A BMC names its credential by reference only (``credentialsRef``, a ``sec_…`` SecretRef stored
through bc-secrets). Unknown fields are ignored, as everywhere on the bus (docs/compatibility.md),
so the engine looks for a credential given inline (``bmc.password``) with ``find_inline_secret``
before it decodes a request: ``INVALID_INPUT`` at its path, never stored or logged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from better_compute.core.manifest import SECRET_REF_PATTERN
from better_compute.core.names import Name

__all__ = [
    "MAC_PATTERN",
    "MAX_MACS",
    "MAX_NODES_PER_BULK",
    "BulkVerb",
    "EnrollNode",
    "Mac",
    "MetalVerb",
    "NodeBmc",
    "SecretRef",
    "find_inline_secret",
    "normal_mac",
]

MAC_PATTERN: Final = r"^[0-9a-fA-F]{2}([:-][0-9a-fA-F]{2}){5}$"
MAX_MACS: Final = 16
MAX_NODES_PER_BULK: Final = 10_000
"""A batch covers at most this many nodes (the command queue's bound)."""

Mac = Annotated[str, msgspec.Meta(pattern=MAC_PATTERN)]
SecretRef = Annotated[str, msgspec.Meta(pattern=SECRET_REF_PATTERN)]
VerbName = Literal["inspect", "commission", "deploy", "release", "retire", "adopt"]
IMAGE_REF_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
ImageRef = Annotated[str, msgspec.Meta(pattern=IMAGE_REF_PATTERN)]
ProfileId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class NodeBmc(_Msg, frozen=True, kw_only=True):
    """The node's BMC: how the site agent reaches it. The password is behind ``credentials_ref``."""

    driver: Literal["redfish", "ipmi", "sim"]
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    credentials_ref: SecretRef | None = None
    system_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    insecure: bool = False

    def to_document(self) -> dict[str, Any]:
        """As stored in ``nodes.bmc`` and relayed in BMC commands (absent fields left out)."""
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}


class EnrollNode(_Msg, frozen=True, kw_only=True):
    """``metal.enroll``: a new node in ``enrolled`` (or, with the id of a ``discovered`` node,
    that node enrolled: its BMC, MACs and labels given)."""

    site_id: Name
    id: NodeId | None = None
    tenant_id: Name = "root"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] = msgspec.field(default_factory=list)
    bmc: NodeBmc | None = None


class MetalVerb(_Msg, frozen=True, kw_only=True):
    """``metal.<verb>`` of one node; ``image`` for deploy, ``profile`` instead of the verb's."""

    node_id: NodeId
    tenant_id: Name | None = None
    image: ImageRef | None = None
    profile: ProfileId | None = None


class BulkVerb(_Msg, frozen=True, kw_only=True):
    """``metal.bulk``: one verb over many nodes (ids, or a selector: ``site`` and labels), under
    one destructive batch. Nodes in the wrong state are reported, the rest go ahead."""

    verb: VerbName
    node_ids: Annotated[list[NodeId], msgspec.Meta(max_length=MAX_NODES_PER_BULK)] | None = None
    selector: Annotated[dict[str, str], msgspec.Meta(max_length=64)] | None = None
    tenant_id: Name | None = None
    image: ImageRef | None = None
    profile: ProfileId | None = None


_INLINE_SECRET: Final = re.compile(
    r"^(pass(word|wd)?|secret|credentials?|private_?key|token)$", re.IGNORECASE
)


def find_inline_secret(value: Any, path: str = "") -> str | None:
    """The path of the first key that would carry a credential inline (``password``,
    ``secret``, ``credentials``, …), or None. ``credentialsRef`` is the allowed form."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _INLINE_SECRET.match(key):
                return here
            found = find_inline_secret(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = find_inline_secret(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def normal_mac(mac: str) -> str:
    """``AA-BB-…`` as ``aa:bb:…``: how MACs are stored and compared."""
    return mac.lower().replace("-", ":")
