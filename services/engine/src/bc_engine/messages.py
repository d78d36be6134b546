"""Requests and replies of ``bc.api.engine.*`` (camelCase on the wire)."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from better_compute.core.names import Name
from better_compute.wire.metal import MAX_MACS, Mac, NodeBmc
from better_compute.wire.paging import DEFAULT_LIMIT, Cursor, Limit

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_LABELS",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_REASON",
    "MAX_STEP_INPUT_BYTES",
    "CreateNode",
    "CreateProfile",
    "DeleteNode",
    "DeleteProfile",
    "GetNode",
    "GetProfile",
    "GetWorkflow",
    "LabelNode",
    "ListNodes",
    "ListProfiles",
    "ListSteps",
    "ListWorkflows",
    "ProfileRef",
    "StartWorkflow",
    "UpdateNode",
    "WorkflowVerb",
]


# Bounds of free fields, checked where they enter (docs/lists-and-limits.md lists them).
MAX_LABELS: Final = 64
MAX_LABEL_KEY: Final = 63
MAX_LABEL_VALUE: Final = 256
MAX_DOCUMENT_BYTES: Final = 256 * 1024
"""A profile document, as JSON."""
MAX_STEP_INPUT_BYTES: Final = 64 * 1024
"""One step's ``with``, as JSON."""
MAX_REASON: Final = 1024

Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
"""A profile's version: stored as a PostgreSQL ``int``."""


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


class CreateNode(_Req, frozen=True, kw_only=True):
    site_id: Name
    id: str | None = None
    tenant_id: Name = "root"
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Checked by ``check_labels``: key syntax, value size and count."""
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] = msgspec.field(default_factory=list)
    bmc: NodeBmc | None = None


class GetNode(_Req, frozen=True, kw_only=True):
    id: str


class UpdateNode(_Req, frozen=True, kw_only=True):
    """Fields given replace the node's (``labels`` all of them); the bounds of ``CreateNode``."""

    id: str
    site_id: Name | None = None
    labels: dict[str, str] | None = None
    macs: Annotated[list[Mac], msgspec.Meta(max_length=MAX_MACS)] | None = None
    bmc: NodeBmc | None = None


class LabelNode(_Req, frozen=True, kw_only=True):
    """Set some labels and remove others; the result has the bounds of ``CreateNode``."""

    id: str
    set: dict[str, str] = msgspec.field(default_factory=dict)
    remove: Annotated[list[str], msgspec.Meta(max_length=MAX_LABELS)] = msgspec.field(default_factory=list)


class DeleteNode(_Req, frozen=True, kw_only=True):
    id: str


class ListSteps(_Req, frozen=True, kw_only=True):
    """Every registered step and driver operation (a deployment has few: no paging)."""


class ListNodes(_Req, frozen=True, kw_only=True):
    """By id; ``cursor`` is the ``next`` of the page before."""

    site_id: str | None = None
    tenant_id: str | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class CreateProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    document: dict[str, Any]
    public: bool = False
    replace: bool = False


class GetProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: Version | None = None


class DeleteProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: Version


class ListProfiles(_Req, frozen=True, kw_only=True):
    """By id, version and tenant; ``cursor`` is the ``next`` of the page before."""

    tenant_id: str = "root"
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None


class ProfileRef(_Req, frozen=True, kw_only=True):
    """``profiles.validate`` / ``profiles.render``: a stored profile, or a document."""

    tenant_id: str = "root"
    id: str | None = None
    version: Version | None = None
    document: dict[str, Any] | None = None


class StartWorkflow(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    profile_id: str
    profile_version: Version | None = None
    node_id: str | None = None
    owner: str | None = None


class GetWorkflow(_Req, frozen=True, kw_only=True):
    """The workflow and its steps from the first; when the steps' results outgrow one
    reply, ``stepsNext`` in the reply is the ``steps_cursor`` of the rest."""

    id: str
    steps_cursor: Cursor | None = None


class WorkflowVerb(_Req, frozen=True, kw_only=True):
    id: str
    reason: Reason | None = None


class ListWorkflows(_Req, frozen=True, kw_only=True):
    node_id: str | None = None
    state: Literal["running", "succeeded", "failed", "aborted"] | None = None
    profile_id: str | None = None
    tenant_id: str | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""
    before: str | None = None  # workflow id: page backwards from there (before ``cursor``)
