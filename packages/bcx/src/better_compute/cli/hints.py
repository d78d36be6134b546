"""Errors that name the fix: the ``(hint: …)`` bcx adds to an error it prints.

A hint is looked up by the error's code and what the error is about: for ``NOT_FOUND`` the kind
of thing the message names (``no node n1`` → ``bcx nodes list``), else the command's group; for
``UNAVAILABLE`` whether NATS or a service is away, and where the NATS URL came from (a context is
named); for ``UNAUTHENTICATED`` / ``PERMISSION_DENIED`` the credentials in force; for
``INVALID_*`` the path to fix. No hint is better than a wrong one: anything else gets none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from ..core.errors import BcError, ErrorCode

__all__ = ["HintContext", "hint_for", "site_of"]

_SELECTOR_SITE = re.compile(r"(?:^|,)\s*site\s*=\s*([A-Za-z0-9_.-]+)")


def site_of(site: object, selector: object) -> str | None:
    """The site a command names: its ``--site``, else the ``site=`` term of its ``--selector``."""
    if isinstance(site, str) and site:
        return site
    if isinstance(selector, str) and (m := _SELECTOR_SITE.search(selector)):
        return m.group(1)
    return None


@dataclass(frozen=True)
class HintContext:
    """What bcx knows about the run that failed."""

    command: tuple[str, ...] = ()
    """The command's words (``("nodes", "show")``)."""
    context: str | None = None
    """The bcx context in use, if any."""
    nats_from: str | None = None
    """Where the NATS URL came from: ``--nats-url``, ``$BC_NATS_URL``, ``context eu-1``, or None."""
    creds: str | None = None
    """The credentials file in force (its path)."""
    site: str | None = None
    """The command's site (``--site``, or ``site=`` of ``--selector``), carried into a
    ``nodes list`` hint."""


# What a NOT_FOUND message names → the list that shows what exists, most specific first.
_NOT_FOUND_NOUNS: Final = (
    (re.compile(r"\bcontext\b"), "bcx context list"),
    (re.compile(r"\benrollment rule\b"), "bcx enrollment-rules list"),
    (re.compile(r"\bjoin token\b"), "bcx tokens list"),
    (re.compile(r"\bcertificate\b"), "bcx certs list"),
    (re.compile(r"\bsecret\b"), "bcx secrets list"),
    (re.compile(r"\bbatch\b"), "bcx batches list"),
    (re.compile(r"\bcommand\b"), "bcx commands list"),
    (re.compile(r"\bimage\b"), "bcx images list"),
    (re.compile(r"\bprofile\b"), "bcx profiles list"),
    (re.compile(r"\bworkflow\b"), "bcx workflows list"),
    (re.compile(r"\bnodes?\b"), "bcx nodes list"),
)

# A command group → its list, when the message names nothing above.
_GROUP_LISTS: Final = {
    "nodes": "bcx nodes list",
    "workflows": "bcx workflows list",
    "profiles": "bcx profiles list",
    "images": "bcx images list",
    "batches": "bcx batches list",
    "commands": "bcx commands list",
    "agents": "bcx agents list",
    "tokens": "bcx tokens list",
    "certs": "bcx certs list",
    "secrets": "bcx secrets list",
    "enrollment-rules": "bcx enrollment-rules list",
    "context": "bcx context list",
    "inspect": "bcx nodes list",
    "commission": "bcx nodes list",
    "deploy": "bcx nodes list",
    "release": "bcx nodes list",
    "retire": "bcx nodes list",
    "adopt": "bcx nodes list",
    "bulk": "bcx nodes list",
    "why": "bcx nodes list",
}


def _not_found(err: BcError, ctx: HintContext) -> str | None:
    hint = next((h for pattern, h in _NOT_FOUND_NOUNS if pattern.search(err.message)), None)
    if hint is None and ctx.command:
        hint = _GROUP_LISTS.get(ctx.command[0])
    if hint == "bcx nodes list" and ctx.site:
        hint += f" --site {ctx.site}"
    return hint


def _nats_source(ctx: HintContext) -> str:
    if ctx.nats_from and ctx.nats_from.startswith("context "):
        name = ctx.nats_from.removeprefix("context ")
        return f"the NATS URL of context {name} (bcx context show {name})"
    if ctx.nats_from:
        return f"the NATS URL from {ctx.nats_from}"
    return "the NATS URL (bcx context show)"


def _unavailable(err: BcError, ctx: HintContext) -> str | None:
    if "service" in err.details:
        where = f" on context {ctx.context}" if ctx.context else ""
        return f"bcx status{' --context ' + ctx.context if ctx.context else ''} shows what answers{where}"
    if "url" in err.details:
        return f"is NATS up there? check {_nats_source(ctx)}"
    if err.path == "nats_url":
        return "bcx dev up, or bcx context use NAME (bcx context list)"
    if err.code is ErrorCode.TIMEOUT and "did not answer" in err.message:
        return "bcx status shows what answers"
    return None


def _credentials(ctx: HintContext) -> str:
    if ctx.context:
        creds = f" ({ctx.creds})" if ctx.creds else " (it has none)"
        return f"check the credentials of context {ctx.context}{creds}: bcx context show {ctx.context}"
    if ctx.creds:
        return f"check the credentials file {ctx.creds}"
    return "give NATS credentials: --creds FILE, $BC_NATS_CREDS, or a context (bcx context add)"


def _invalid(err: BcError, ctx: HintContext) -> str | None:
    file = err.details.get("file")
    if err.path == "nats_creds":
        return _credentials(ctx)
    if err.path == "nats_ca":
        return "give the bus CA's certificate: $BC_NATS_CA=/path/to/ca.pem (deploy/README.md)"
    if isinstance(file, str) and err.path:
        return f"fix {err.path} in {file}"
    if isinstance(file, str):
        return f"fix {file}"
    if err.path and ctx.command:
        return f"fix {err.path}; bcx {' '.join(ctx.command)} --help"
    return None


def hint_for(err: BcError, ctx: HintContext) -> str | None:
    """The hint for ``err`` met by the command of ``ctx``, or None."""
    match err.code:
        case ErrorCode.NOT_FOUND:
            return _not_found(err, ctx)
        case ErrorCode.UNAVAILABLE | ErrorCode.TIMEOUT:
            return _unavailable(err, ctx)
        case ErrorCode.UNAUTHENTICATED | ErrorCode.PERMISSION_DENIED:
            return _credentials(ctx)
        case ErrorCode.INVALID_INPUT | ErrorCode.INVALID_CONFIG:
            return _invalid(err, ctx)
        case _:
            return None
