"""Requests and replies of ``bc.api.engine.*`` (camelCase on the wire)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "CreateNode",
    "CreateProfile",
    "DeleteProfile",
    "GetNode",
    "GetProfile",
    "GetWorkflow",
    "ListNodes",
    "ListProfiles",
    "ListWorkflows",
    "ProfileRef",
    "StartWorkflow",
    "WorkflowVerb",
]


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    pass


class CreateNode(_Req, frozen=True, kw_only=True):
    site_id: str
    id: str | None = None
    tenant_id: str = "root"
    labels: dict[str, str] = msgspec.field(default_factory=dict)


class GetNode(_Req, frozen=True, kw_only=True):
    id: str


class ListNodes(_Req, frozen=True, kw_only=True):
    site_id: str | None = None
    tenant_id: str | None = None
    limit: int = 100


class CreateProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    document: dict[str, Any]
    public: bool = False
    replace: bool = False


class GetProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: int | None = None


class DeleteProfile(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    id: str
    version: int


class ListProfiles(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"


class ProfileRef(_Req, frozen=True, kw_only=True):
    """``profiles.validate`` / ``profiles.render``: a stored profile, or a document."""

    tenant_id: str = "root"
    id: str | None = None
    version: int | None = None
    document: dict[str, Any] | None = None


class StartWorkflow(_Req, frozen=True, kw_only=True):
    tenant_id: str = "root"
    profile_id: str
    profile_version: int | None = None
    node_id: str | None = None
    owner: str | None = None


class GetWorkflow(_Req, frozen=True, kw_only=True):
    id: str


class WorkflowVerb(_Req, frozen=True, kw_only=True):
    id: str
    reason: str | None = None


class ListWorkflows(_Req, frozen=True, kw_only=True):
    node_id: str | None = None
    state: Literal["running", "succeeded", "failed", "aborted"] | None = None
    profile_id: str | None = None
    tenant_id: str | None = None
    limit: int = 100
    before: str | None = None  # workflow id: page backwards from there
