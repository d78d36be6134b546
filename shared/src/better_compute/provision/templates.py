"""User-data templates and ``render_template``.

A template is a string with ``{{name}}`` placeholders (``{{ name }}`` too) or a function of the
variables. Values may never add lines to the document: a value holding a line break or ``{{`` is
refused. Build structured formats (Ignition JSON, YAML) as data and serialise them instead of
splicing strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from better_compute.core.errors import BcError, ErrorCode

from ._names import TEMPLATE_NAME_PATTERN, matches

__all__ = [
    "TEMPLATE_VARIABLES",
    "Template",
    "UserData",
    "render_template",
    "template_variables",
]

TEMPLATE_VARIABLES: Final = (
    "nodeId",
    "hostname",
    "joinToken",
    "controlPlaneUrl",
    "bcdUrl",
    "bcdSha256",
)

Template = str | Callable[[Mapping[str, str]], str]

# Only identifiers are placeholders, so Jinja expressions such as `{{ v1.local_hostname }}` in
# a cloud-init template pass through untouched.
_PLACEHOLDER: Final = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# Everything str.splitlines() breaks on.
_LINE_BREAK: Final = re.compile("[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_URL: Final = r"^https?://[^\s{}]+$"
# Where the installed OS's bcd reaches the control plane: https:// (NATS over WebSocket at that
# address) or NATS itself (nats://, tls://), which bcd uses as it is (a VM reaches a test's NATS as
# nats://10.0.2.2:<port>).
_CONTROL_PLANE_URL: Final = r"^(https?|nats|tls)://[^\s{}]+$"
_SHA256: Final = r"^[0-9a-f]{64}$"


def render_template(template: Template, variables: Mapping[str, str | None]) -> str:
    """Render ``template`` with ``variables``.

    Args:
        template: a string with ``{{name}}`` placeholders, or a function of the variables.
        variables: usually ``TEMPLATE_VARIABLES``; a ``None`` value counts as no value.

    Raises:
        BcError: ``INVALID_INPUT`` at ``variables.<name>`` for a value that is not a string or
            holds a line break or ``{{``; ``INVALID_CONFIG`` at ``template.<name>`` for a
            placeholder with no value, and at ``template`` for a template that is neither a
            string nor a function returning one.
    """
    if not isinstance(variables, Mapping):
        raise BcError(ErrorCode.INVALID_INPUT, "variables must be a mapping", {"path": "variables"})
    values: dict[str, str] = {}
    for name, value in variables.items():
        path = f"variables.{name}"
        if value is None:
            continue
        if not isinstance(name, str) or not isinstance(value, str):
            raise BcError(ErrorCode.INVALID_INPUT, "template values must be strings", {"path": path})
        if _LINE_BREAK.search(value):
            raise BcError(ErrorCode.INVALID_INPUT, "a value must not hold a line break", {"path": path})
        if "{{" in value:
            raise BcError(ErrorCode.INVALID_INPUT, "a value must not hold '{{'", {"path": path})
        values[name] = value

    if isinstance(template, str):

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in values:
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"placeholder {{{{{name}}}}} has no value",
                    {"path": f"template.{name}"},
                )
            return values[name]

        # One pass: a substituted value is never scanned for placeholders again.
        return _PLACEHOLDER.sub(substitute, template)

    if not callable(template):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "a template is a string or a function of the variables",
            {"path": "template"},
        )
    try:
        rendered = template(MappingProxyType(values))
    except KeyError as exc:
        missing = exc.args[0] if exc.args else None
        if isinstance(missing, str) and missing not in values:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                f"the template reads {missing!r}, which has no value",
                {"path": f"template.{missing}"},
            ) from exc
        raise
    if not isinstance(rendered, str):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"a template function must return a string, got {type(rendered).__name__}",
            {"path": "template"},
        )
    return rendered


@dataclass(frozen=True, kw_only=True, eq=False)
class UserData:
    """User-data settings of ``provision_module``.

    Args:
        control_plane_url: where installed nodes reach the control plane.
        bcd_url: where the installed OS downloads bcd.
        bcd_sha256: hex SHA-256 of that download.
        templates: templates by name (``acme-talos.yaml``), added to the built-in ones.

    Raises:
        BcError: ``INVALID_CONFIG`` at the bad argument (``templates.acme.yaml``).
    """

    control_plane_url: str | None = None
    bcd_url: str | None = None
    bcd_sha256: str | None = None
    templates: Mapping[str, Template] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, pattern, what in (
            ("control_plane_url", _CONTROL_PLANE_URL, "an http(s), nats:// or tls:// URL"),
            ("bcd_url", _URL, "an http(s) URL"),
        ):
            value = getattr(self, name)
            if value is not None and not matches(pattern, value):
                raise BcError(ErrorCode.INVALID_CONFIG, f"expected {what}", {"path": name})
        if self.bcd_sha256 is not None and not matches(_SHA256, self.bcd_sha256):
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "expected 64 lowercase hex digits",
                {"path": "bcd_sha256"},
            )
        if not isinstance(self.templates, Mapping):
            raise BcError(ErrorCode.INVALID_CONFIG, "expected a mapping", {"path": "templates"})
        for name, template in self.templates.items():
            if not matches(TEMPLATE_NAME_PATTERN, name):
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    f"template names are like acme-talos.yaml, got {name!r}",
                    {"path": f"templates.{name}"},
                )
            if not isinstance(template, str) and not callable(template):
                raise BcError(
                    ErrorCode.INVALID_CONFIG,
                    "a template is a string or a function of the variables",
                    {"path": f"templates.{name}"},
                )
        # Frozen: the caller's dict must not change the templates after the fact.
        object.__setattr__(self, "templates", MappingProxyType(dict(self.templates)))


def template_variables(
    *, node_id: str, join_token: str, user_data: UserData | None
) -> Mapping[str, str | None]:
    """The variables a user-data template sees for one node (unset settings are ``None``)."""
    settings = user_data if user_data is not None else UserData()
    return MappingProxyType(
        {
            "nodeId": node_id,
            "hostname": node_id.replace("_", "-"),
            "joinToken": join_token,
            "controlPlaneUrl": settings.control_plane_url,
            "bcdUrl": settings.bcd_url,
            "bcdSha256": settings.bcd_sha256,
        }
    )
