"""What every bcx command module shares: a connected API client, argument parsing helpers."""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import getpass
import json
import os
import re
import socket
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from ..clients import EngineClient
from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..runtime.urls import resolve_nats_url
from ..service.client import ApiClient, connect
from ..wire import Subjects
from ..wire.subjects import operator_inbox_prefix, valid_token

if TYPE_CHECKING:
    from nats.aio.client import Client as Nats

__all__ = [
    "actor",
    "add_tenant_flag",
    "api_client",
    "as_rows",
    "connect_bus",
    "engine_client",
    "operator_inbox",
    "parse_labels",
    "read_document",
    "short",
]


def actor() -> str:
    """Who runs this bcx, as the services' audit records it: ``$BC_ACTOR``, else
    ``<login>@<host>`` (a claim: docs/audit.md)."""
    given = os.environ.get("BC_ACTOR", "").strip()
    if given:
        return given
    try:
        login = getpass.getuser()
    except (KeyError, OSError):
        login = f"uid{os.getuid()}"
    return f"{login}@{socket.gethostname()}"


def _creds_name(creds: str) -> str | None:
    """The ``name`` of the user JWT in a NATS credentials file (None when it has none)."""
    try:
        text = Path(creds).read_text()
    except OSError:
        return None  # connect() says what is wrong with the file
    found = re.search(r"-----BEGIN NATS USER JWT-----\s*(\S+)\s*------END NATS USER JWT------", text)
    if not found:
        return None
    try:
        payload = found.group(1).split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    name = claims.get("name") if isinstance(claims, dict) else None
    return name if isinstance(name, str) and name else None


def operator_inbox(url: str, creds: str | None) -> str:
    """bcx's inbox prefix on the bus at ``url``: ``_INBOX_OPS.<user>``, the user being the URL's
    (``nats://alice:…@host``) or the name in the credentials file, so that its replies come where
    only that user may read (deploy/nats/accounts.conf). ``INVALID_CONFIG`` when the user cannot be
    one subject token."""
    user = urlsplit(url.split(",")[0]).username or (_creds_name(creds) if creds else None)
    if user is not None and not valid_token(user):
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"the NATS user {user!r} cannot name an inbox: letters, digits, '-' and '_' only",
            {"path": "nats_url" if not creds else "nats_creds"},
        )
    return operator_inbox_prefix(user)


def stop_if_interrupted() -> None:
    """At the top of each round of a loop that follows (``events tail``, the ``watch``es): raise
    the cancel a Ctrl-C asked for when an await swallowed it. On Python 3.11 ``asyncio.wait_for``
    drops a cancel that arrives as its wait completes, and nats-py waits that way in every
    request, flush and ``next_msg``; a following bcx then went on after its Ctrl-C while events
    flowed (the doc test's ``events tail``, CI). The task still counts the cancel
    (``Task.cancelling``), so it is raised here, within one round."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def connect_bus(settings: Settings) -> Nats:
    """bcx's NATS connection to the deployment of ``settings`` (its URL and credentials file),
    with its operator's own inbox prefix (``operator_inbox``)."""
    url = resolve_nats_url(settings)
    return await connect(
        url,
        name="bcx",
        allow_reconnect=False,
        creds=settings.nats_creds,
        ca=settings.nats_ca,
        inbox_prefix=operator_inbox(url, settings.nats_creds),
    )


@asynccontextmanager
async def api_client(settings: Settings) -> AsyncIterator[ApiClient]:
    """An ``ApiClient`` on the deployment's NATS, closed on exit."""
    nc = await connect_bus(settings)
    try:
        yield ApiClient(nc, Subjects(root=settings.subject_root), actor=actor())
    finally:
        await nc.close()


@asynccontextmanager
async def engine_client(settings: Settings) -> AsyncIterator[EngineClient]:
    """An ``EngineClient`` on the deployment's NATS, closed on exit."""
    async with api_client(settings) as api:
        yield EngineClient(api)


TENANT_HELP = "tenant (default: $BC_TENANT, the context's, else root)"


def add_tenant_flag(parser: argparse.ArgumentParser, help: str = TENANT_HELP) -> None:
    """``--tenant``, whose default main fills in: ``$BC_TENANT``, the context's tenant, else root."""
    parser.add_argument("--tenant", help=help)
    parser.set_defaults(context_tenant=True)


def as_rows(items: list[Any]) -> list[dict[str, Any]]:
    """Replies (Structs) as camelCase dicts: the rows of a table."""
    out: list[dict[str, Any]] = msgspec.to_builtins(items)
    return out


def short(value: Any, width: int = 60) -> str:
    """``value`` on one line of at most ``width`` characters (JSON unless it is text)."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


@functools.cache
def _yaml12_loader() -> Any:
    """YAML as a profile author means it: ``true``/``false`` are the only booleans (YAML 1.2), so
    ``action: off`` stays the string ``off`` (PyYAML's 1.1 rules made it False), and dates stay
    strings. Built on first use: a command that reads no YAML does not load PyYAML."""
    import yaml

    class Yaml12Loader(yaml.SafeLoader):
        pass

    yaml11_only = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")
    Yaml12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in yaml11_only]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Yaml12Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    return Yaml12Loader


def load_yaml(text: str) -> Any:
    """A YAML document by YAML 1.2's booleans (``_yaml12_loader``)."""
    import yaml

    return yaml.load(text, Loader=_yaml12_loader())  # a SafeLoader: no object tags


def read_document(path: str) -> dict[str, Any]:
    """A JSON (``.json``), TOML (``.toml``) or YAML (``.yaml``/``.yml``) document from a file;
    ``-`` reads JSON or YAML from stdin."""
    import yaml

    try:
        if path == "-":
            import sys

            data: Any = load_yaml(sys.stdin.read())  # JSON is YAML
        elif path.endswith(".toml"):
            data = tomllib.loads(Path(path).read_text())
        elif path.endswith((".yaml", ".yml")):
            data = load_yaml(Path(path).read_text())
        else:
            data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"cannot read {path}: {exc.strerror}", {"path": "file"}
        ) from exc
    except (ValueError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise BcError(ErrorCode.INVALID_INPUT, f"{path} is not valid: {exc}", {"path": "file"}) from exc
    if not isinstance(data, dict):
        raise BcError(ErrorCode.INVALID_INPUT, f"{path} must hold one object", {"path": "file"})
    return data


def parse_labels(pairs: list[str] | None) -> dict[str, str]:
    """``--label key=value`` options as a dict; ``INVALID_INPUT`` at ``label`` for one without ``=``."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BcError(ErrorCode.INVALID_INPUT, f"labels are key=value, got {pair!r}", {"path": "label"})
        out[key] = value
    return out
