"""A node as an operator names it on bcx's command line: its id (``node_…``) or its name
(``lab1-m001``, or ``lab1/lab1-m001`` when two sites have a node of that name).

An argument that takes a node is declared with ``type=node_ref``; before the command runs,
``run`` turns every name among its arguments into the node's id with one ``nodes.list`` by name
each, so the command itself only ever sees ids. A value with a ``_`` (``node_…``, ``wf_…``) is an
id and is left as it is: a name never has one (``core.names.NODE_NAME_PATTERN``), and a command
given only ids makes no extra request.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

from ..core.errors import BcError, ErrorCode
from ..core.names import NODE_NAME_PATTERN, describe_pattern

if TYPE_CHECKING:
    from ..clients import EngineClient
    from ..config import Settings

__all__ = ["NODE_HELP", "NodeRef", "node_names", "node_ref", "resolve_node", "run"]

NODE_HELP = "node id (node_…) or name (lab1-m001; site/name when two sites have it)"

_NAME = re.compile(NODE_NAME_PATTERN)


class NodeRef(str):
    """A command-line value that names a node: its id or its name (``run`` resolves it)."""

    __slots__ = ()


def node_ref(text: str) -> NodeRef:
    """The argparse ``type`` of an argument that takes a node (id or name)."""
    return NodeRef(text)


def _is_id(text: str) -> bool:
    return "_" in text


async def resolve_node(engine: EngineClient, given: str, *, path: str) -> str:
    """The id of the node ``given`` names: an id as it is, else the node with that name
    (``site/name`` picks the site).

    Raises:
        BcError: ``INVALID_INPUT`` at ``path`` for a malformed name or one that two sites use;
            ``NOT_FOUND`` at ``path`` when no node has it.
    """
    given = str(given)  # a NodeRef's own methods may answer the NodeRef itself
    if _is_id(given):
        return given
    site, _, name = given.rpartition("/")
    if not _NAME.match(name):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"give a node id (node_…) or a node's name ({describe_pattern(NODE_NAME_PATTERN)};"
            " site/name picks the site)",
            {"path": path},
        )
    page = await engine.list_nodes(name=name, site_id=site or None, limit=20)
    if not page.nodes:
        where = f" in site {site}" if site else ""
        raise BcError(ErrorCode.NOT_FOUND, f"no node named {name}{where}", {"path": path})
    if len(page.nodes) > 1:
        sites = ", ".join(sorted(n.site_id for n in page.nodes))
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"nodes of several sites are named {name} ({sites}): give site/name, e.g."
            f" {page.nodes[0].site_id}/{name}",
            {"path": path, "reason": "ambiguous-name"},
        )
    return page.nodes[0].id


async def node_names(engine: EngineClient, node_ids: list[str], *, most: int = 50) -> dict[str, str]:
    """The names of those of ``node_ids`` that have one (the first ``most``; a node the engine
    cannot read now is left out: a name is a help to the reader, never a condition)."""
    names: dict[str, str] = {}
    for node_id in node_ids[:most]:
        try:
            node = await engine.get_node(id=node_id)
        except BcError as err:
            if err.code.value in ("UNAVAILABLE", "TIMEOUT"):
                break  # no engine answers now: the ids alone, at once
            continue
        if node.name:
            names[node_id] = node.name
    return names


def _named(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The arguments that hold a node name (not an id) to resolve: (dest, value or list). The
    others become plain strings (the codec encodes ``str``, not its subclasses)."""
    found = []
    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, NodeRef) and not _is_id(v) for v in values):
            found.append((dest, value))
        elif isinstance(value, NodeRef):
            setattr(args, dest, str(value))
        elif isinstance(value, list) and any(isinstance(v, NodeRef) for v in value):
            setattr(args, dest, [str(v) for v in value])
    return found


async def run(args: argparse.Namespace, settings: Settings) -> int:
    """Resolve the node names among ``args`` to ids, then run the command (``args.func``)."""
    named = _named(args)
    if named:
        from .common import engine_client

        async with engine_client(settings) as engine:
            for dest, value in named:
                if isinstance(value, list):
                    ids = [str(await resolve_node(engine, v, path=dest)) for v in value]
                    setattr(args, dest, ids)
                else:
                    setattr(args, dest, str(await resolve_node(engine, value, path=dest)))
    code: int = await args.func(args, settings)
    return code
