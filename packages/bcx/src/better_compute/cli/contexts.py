"""bcx contexts: named deployments in ``~/.config/bcx/config.toml``.

A context is a NATS URL, optionally a NATS credentials file (its path: bcx never reads it
out), the bus CA's certificate for a ``tls://`` URL (its path), a tenant and a subject root.
``current`` names the one in use. The file::

    current = "eu-1"

    [contexts.eu-1]
    nats_url = "tls://nats.eu-1.example:4222"
    creds = "/home/me/.config/bcx/eu-1.creds"
    ca = "/home/me/.config/bcx/eu-1-ca.pem"
    tenant = "acme"

Where each setting comes from, first found wins (docs/bcx.md):

1. a flag: ``--nats-url``, ``--creds``, ``--tenant``; then the context named by ``--context``
2. the environment (``BC_NATS_URL``, ``BC_NATS_CREDS``, ``BC_TENANT``) and ``bc.toml``
3. the current context (``current`` in the file)
4. the defaults (the embedded NATS of ``bcx dev up``, no credentials, tenant ``root``)

The file is ``$BCX_CONFIG``, else ``$XDG_CONFIG_HOME/bcx/config.toml``, else
``~/.config/bcx/config.toml``. Anything wrong in it is ``INVALID_CONFIG`` with ``details.path``
the key (``contexts.eu-1.nats_url``) and ``details.file`` the file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ..config import Settings
from ..core.errors import BcError, ErrorCode
from ..files import atomic_write
from ..logging import safe_url
from .output import FORMATS, print_json, print_table

__all__ = [
    "DEFAULT_TENANT",
    "BcxConfig",
    "Context",
    "Selection",
    "config_path",
    "load_config",
    "origins",
    "register",
    "save_config",
    "select",
    "tenant_for",
]

DEFAULT_TENANT: Final = "root"
TENANT_ENV: Final = "BC_TENANT"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_KEYS: Final = ("nats_url", "creds", "ca", "tenant", "subject_root")


@dataclass(frozen=True)
class Context:
    """One deployment: where its NATS is, and how bcx talks to it."""

    name: str
    nats_url: str
    creds: str | None = None
    ca: str | None = None
    """The bus CA's certificate file, which the NATS servers' TLS certificates chain to."""
    tenant: str | None = None
    subject_root: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "natsUrl": safe_url(self.nats_url),
            "creds": self.creds,
            "ca": self.ca,
            "tenant": self.tenant,
            "subjectRoot": self.subject_root,
        }


@dataclass
class BcxConfig:
    """The whole file: the contexts, and which one is current."""

    path: Path
    current: str | None = None
    contexts: dict[str, Context] = field(default_factory=dict)


def config_path() -> Path:
    """``$BCX_CONFIG``, else ``$XDG_CONFIG_HOME/bcx/config.toml``, else ``~/.config/bcx/config.toml``."""
    given = os.environ.get("BCX_CONFIG")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "bcx" / "config.toml"


def _bad(file: Path, path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, f"{file}: {message}", {"path": path, "file": str(file)})


def _text(file: Path, where: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(file, where, f"{where} must be a non-empty string")
    return value


def check_name(name: str, *, path: str = "name") -> str:
    """A context name: letters, digits, ``-`` and ``_`` (a bare TOML key), at most 63."""
    if not _NAME.fullmatch(name):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"a context name is letters, digits, - and _ (at most 63), got {name!r}",
            {"path": path},
        )
    return name


def _check_url(file: Path, where: str, url: str) -> str:
    if not re.match(r"(nats|tls|ws|wss)://[^\s]+$", url):
        raise _bad(file, where, f"{where} must be a nats:// (or tls://, ws://, wss://) URL")
    return url


def load_config(path: Path | None = None) -> BcxConfig:
    """The contexts file; an empty one when it does not exist.

    Raises:
        BcError: ``INVALID_CONFIG`` with ``details.path`` the key and ``details.file`` the file.
    """
    file = path or config_path()
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return BcxConfig(path=file)
    except OSError as exc:
        raise _bad(file, "", f"cannot read: {exc.strerror}") from exc
    try:
        data = tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise _bad(file, "", f"not TOML: {exc}") from exc
    for key in data:
        if key not in ("current", "contexts"):
            raise _bad(file, key, f"unknown key {key!r} (current, contexts)")
    contexts_raw = data.get("contexts", {})
    if not isinstance(contexts_raw, dict):
        raise _bad(file, "contexts", "contexts must be a table of [contexts.NAME] tables")
    contexts: dict[str, Context] = {}
    for name, body in contexts_raw.items():
        where = f"contexts.{name}"
        if not _NAME.fullmatch(name):
            raise _bad(file, where, f"a context name is letters, digits, - and _, got {name!r}")
        if not isinstance(body, dict):
            raise _bad(file, where, f"{where} must be a table")
        for key in body:
            if key not in _KEYS:
                raise _bad(file, f"{where}.{key}", f"unknown key {key!r} ({', '.join(_KEYS)})")
        if "nats_url" not in body:
            raise _bad(file, f"{where}.nats_url", f"{where} has no nats_url")
        values = {key: _text(file, f"{where}.{key}", body[key]) for key in _KEYS if key in body}
        _check_url(file, f"{where}.nats_url", values["nats_url"])
        contexts[name] = Context(name=name, **values)
    current = data.get("current")
    if current is not None:
        current = _text(file, "current", current)
        if current not in contexts:
            raise _bad(file, "current", f"current names {current!r}, which is not among the contexts")
    return BcxConfig(path=file, current=current, contexts=contexts)


def _toml_str(value: str) -> str:
    # JSON's string escapes are TOML basic-string escapes
    return json.dumps(value, ensure_ascii=False)


def save_config(config: BcxConfig) -> None:
    """Write the file (mode 0600: it names credential files), replacing it whole."""
    lines: list[str] = ["# bcx contexts (docs/bcx.md); `bcx context` edits this file", ""]
    if config.current is not None:
        lines += [f"current = {_toml_str(config.current)}", ""]
    for ctx in config.contexts.values():
        lines.append(f"[contexts.{ctx.name}]")
        for key in _KEYS:
            value = getattr(ctx, key)
            if value is not None:
                lines.append(f"{key} = {_toml_str(value)}")
        lines.append("")
    if config.path.exists() and not config.path.is_file():
        # BCX_CONFIG=/dev/null reads as no contexts; replacing it would replace /dev/null
        raise _bad(config.path, "", "is not a regular file: bcx does not write it")
    config.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(config.path, "\n".join(lines))


@dataclass(frozen=True)
class Selection:
    """The context in use for this run and how it was chosen (``flag`` or ``current``), and the
    top-level settings it gives at each level of precedence."""

    context: Context | None
    chosen_by: str | None
    file: Path

    def settings(self) -> dict[str, Any]:
        ctx = self.context
        if ctx is None:
            return {}
        return {
            "nats_url": ctx.nats_url,
            "nats_creds": ctx.creds,
            "nats_ca": ctx.ca,
            "subject_root": ctx.subject_root,
        }

    @property
    def name(self) -> str | None:
        return self.context.name if self.context else None


def select(flag: str | None, *, config: BcxConfig | None = None) -> Selection:
    """The context named by ``--context``, else the current one, else none.

    Raises:
        BcError: ``NOT_FOUND`` at ``context`` for a ``--context`` that is not in the file.
    """
    config = config or load_config()
    if flag is not None:
        check_name(flag, path="context")
        if flag not in config.contexts:
            raise BcError(ErrorCode.NOT_FOUND, f"no context {flag} in {config.path}", {"path": "context"})
        return Selection(config.contexts[flag], "flag", config.path)
    if config.current is not None:
        return Selection(config.contexts[config.current], "current", config.path)
    return Selection(None, None, config.path)


def tenant_for(args: argparse.Namespace, selection: Selection) -> str:
    """A command's tenant: ``--tenant``, else ``$BC_TENANT``, else the context's, else root."""
    given = getattr(args, "tenant", None)
    if given:
        return str(given)
    if selection.chosen_by == "flag" and selection.context and selection.context.tenant:
        return selection.context.tenant
    env = os.environ.get(TENANT_ENV, "").strip()
    if env:
        return env
    if selection.context and selection.context.tenant:
        return selection.context.tenant
    return DEFAULT_TENANT


# -- bcx context ...


async def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    config = load_config()
    rows = [{**c.as_dict(), "current": c.name == config.current} for c in config.contexts.values()]
    if args.json:
        print_json({"file": str(config.path), "current": config.current, "contexts": rows})
        return 0
    for row in rows:
        row["mark"] = "*" if row["current"] else ""
    print_table(
        rows,
        [("mark", "CURRENT"), ("name", "NAME"), ("natsUrl", "NATS URL"), ("tenant", "TENANT"),
         ("creds", "CREDENTIALS")],
        empty=f"no contexts in {config.path} (add one: bcx context add NAME --nats-url URL)",
    )  # fmt: skip
    return 0


def _origin(
    args: argparse.Namespace, sel: Selection, flag: object, var: str, ctx_value: str | None, value: object
) -> str:
    if flag:
        return "flag"
    if sel.chosen_by == "flag" and ctx_value:
        return f"context {sel.name}"
    if os.environ.get(var):
        return f"${var}"
    if ctx_value and ctx_value == value:
        return f"context {sel.name}"
    if var != TENANT_ENV and value not in (None, getattr(Settings(), var[3:].lower(), None)):
        return "bc.toml"
    return "default"


def origins(args: argparse.Namespace, sel: Selection, settings: Settings) -> list[dict[str, Any]]:
    """Each connection setting in force for this run (a credentials file by its path), and
    where it came from: ``flag``, ``context NAME``, ``$BC_…``, ``bc.toml`` or ``default``."""
    ctx = sel.context or Context(name="", nats_url="")
    tenant = tenant_for(args, sel)
    nats = settings.nats_url
    return [
        {"setting": "nats_url", "value": safe_url(nats) if nats else "(the embedded one of bcx dev up)",
         "from": _origin(args, sel, args.nats_url, "BC_NATS_URL", ctx.nats_url, nats)},
        {"setting": "nats_creds", "value": settings.nats_creds,
         "from": _origin(args, sel, args.creds, "BC_NATS_CREDS", ctx.creds, settings.nats_creds)},
        {"setting": "nats_ca", "value": settings.nats_ca,
         "from": _origin(args, sel, None, "BC_NATS_CA", ctx.ca, settings.nats_ca)},
        {"setting": "tenant", "value": tenant,
         "from": _origin(args, sel, getattr(args, "tenant", None), TENANT_ENV, ctx.tenant, tenant)},
        {"setting": "subject_root", "value": settings.subject_root,
         "from": _origin(args, sel, args.subject_root, "BC_SUBJECT_ROOT", ctx.subject_root,
                         settings.subject_root)},
    ]  # fmt: skip


async def cmd_show(args: argparse.Namespace, settings: Settings) -> int:
    """One context as written (``NAME``), or without one, what this run would use and why."""
    config = load_config()
    if args.name is not None:
        check_name(args.name)
        if args.name not in config.contexts:
            raise BcError(ErrorCode.NOT_FOUND, f"no context {args.name} in {config.path}", {"path": "name"})
        doc = {**config.contexts[args.name].as_dict(), "current": args.name == config.current}
        if args.json:
            print_json(doc)
        else:
            for key, value in doc.items():
                print(f"{key:<12} {'-' if value is None else value}")
        return 0
    sel: Selection = args.selection
    rows = origins(args, sel, settings)
    if args.json:
        print_json({"file": str(config.path), "context": sel.name, "settings": rows})
        return 0
    how = {"flag": " (--context)", "current": " (current)"}.get(sel.chosen_by or "", "")
    print(f"context  {sel.name or '(none)'}{how}   file {config.path}")
    print_table(rows, [("setting", "SETTING"), ("value", "VALUE"), ("from", "FROM")])
    return 0


async def cmd_use(args: argparse.Namespace, settings: Settings) -> int:
    config = load_config()
    check_name(args.name)
    if args.name not in config.contexts:
        raise BcError(ErrorCode.NOT_FOUND, f"no context {args.name} in {config.path}", {"path": "name"})
    config.current = args.name
    save_config(config)
    if args.json:
        print_json({"current": args.name, "file": str(config.path)})
    else:
        print(f"current context: {args.name}")
    _warn_env()
    return 0


def _warn_env() -> None:
    shadowing = [v for v in ("BC_NATS_URL", "BC_NATS_CREDS", TENANT_ENV) if os.environ.get(v)]
    if shadowing:
        sys.stderr.write(
            f"note: {', '.join('$' + v for v in shadowing)} set in this shell win over the current "
            "context (unset them, or use --context)\n"
        )


def _new_context(args: argparse.Namespace) -> Context:
    creds = args.context_creds
    if creds is not None:
        creds = str(Path(creds).expanduser().absolute())
        if not Path(creds).is_file():
            raise BcError(ErrorCode.INVALID_INPUT, f"no credentials file {creds}", {"path": "creds"})
    ca = args.context_ca
    if ca is not None:
        ca = str(Path(ca).expanduser().absolute())
        if not Path(ca).is_file():
            raise BcError(ErrorCode.INVALID_INPUT, f"no CA file {ca}", {"path": "ca"})
    return Context(
        name=args.name,
        nats_url=args.context_nats_url,
        creds=creds,
        ca=ca,
        tenant=args.context_tenant,
        subject_root=args.context_subject_root,
    )


async def cmd_add(args: argparse.Namespace, settings: Settings) -> int:
    config = load_config()
    check_name(args.name)
    if args.name in config.contexts and not args.replace:
        raise BcError(
            ErrorCode.CONFLICT,
            f"context {args.name} exists in {config.path} (--replace to overwrite it)",
            {"path": "name"},
        )
    if not re.match(r"(nats|tls|ws|wss)://[^\s]+$", args.context_nats_url):
        raise BcError(
            ErrorCode.INVALID_INPUT, "--nats-url must be a nats:// (or tls://, ws://, wss://) URL",
            {"path": "nats_url"},
        )  # fmt: skip
    ctx = _new_context(args)
    config.contexts[args.name] = ctx
    if config.current is None or args.use:
        config.current = args.name
    save_config(config)
    if args.json:
        print_json({**ctx.as_dict(), "current": config.current == args.name, "file": str(config.path)})
    else:
        now = " (current)" if config.current == args.name else ""
        print(f"context {args.name} added{now}: {safe_url(ctx.nats_url)}  in {config.path}")
    return 0


async def cmd_remove(args: argparse.Namespace, settings: Settings) -> int:
    config = load_config()
    check_name(args.name)
    if config.contexts.pop(args.name, None) is None:
        raise BcError(ErrorCode.NOT_FOUND, f"no context {args.name} in {config.path}", {"path": "name"})
    if config.current == args.name:
        config.current = None
    save_config(config)
    if args.json:
        print_json({"removed": args.name, "current": config.current})
    else:
        print(f"context {args.name} removed" + ("" if config.current else "; no context is current"))
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    ctx = sub.add_parser("context", help="named deployments (NATS URL, credentials, tenant) in bcx's config")
    csub = ctx.add_subparsers(dest="context_command", required=True, metavar="COMMAND")
    p = csub.add_parser("list", parents=[common], help="the contexts; * marks the current one")
    p.set_defaults(func=cmd_list)
    p = csub.add_parser(
        "show", parents=[common], help="one context, or (without NAME) each setting in force and its source"
    )
    p.add_argument("name", nargs="?", help="a context (default: what this run uses)")
    p.set_defaults(func=cmd_show)
    p = csub.add_parser("use", parents=[common], help="make a context the current one")
    p.add_argument("name", help="the context's name")
    p.set_defaults(func=cmd_use)
    # Not the common flags: --nats-url, --creds, --tenant and --subject-root here are the
    # context's, not this run's (argparse's "resolve" would strip them from the shared parent).
    p = csub.add_parser("add", help="add a context (the first one added becomes current)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    p.add_argument("-o", "--output", choices=FORMATS, default=argparse.SUPPRESS, help="table, json or yaml")
    p.add_argument("name", help="the context's name")
    p.add_argument("--nats-url", dest="context_nats_url", required=True, help="the deployment's NATS URL")
    p.add_argument("--creds", dest="context_creds", help="a NATS credentials file (its path is kept)")
    p.add_argument(
        "--ca",
        dest="context_ca",
        help="the bus CA's certificate, for a tls:// URL (bcx bus ca; its path is kept)",
    )
    p.add_argument("--tenant", dest="context_tenant", help="the tenant commands use by default")
    p.add_argument("--subject-root", dest="context_subject_root", help="the deployment's subject root")
    p.add_argument("--use", action="store_true", help="make it the current context")
    p.add_argument("--replace", action="store_true", help="overwrite a context of that name")
    p.set_defaults(func=cmd_add)
    p = csub.add_parser("remove", parents=[common], help="remove a context")
    p.add_argument("name", help="the context's name")
    p.set_defaults(func=cmd_remove)
