"""The keys that name a workflow step attempt's work in every service.

``wf:<workflow_id>:<step>#<attempt>[:<key>]`` keys an attempt's commands (command-queue), join
tokens (pki) and secrets (secrets); ``wf:<workflow_id>`` prefixes all of a workflow's. Built only
here (``provision.step_command_key`` is the step author's face of it), so the format cannot drift
between the services that fence an attempt by it.
"""

from __future__ import annotations

import re
from typing import Final

from .errors import BcError, ErrorCode

__all__ = ["any_workflow_command_prefix", "attempt_key", "step_key_prefix", "workflow_command_prefix"]

_KEY_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_WORKFLOWS: Final = "wf"


def any_workflow_command_prefix() -> str:
    """``wf``: every workflow's command keys are under it (``wf:<workflow_id>…``), and no other
    command's (the engine's host-section and discovery commands are keyed apart). bc-secrets
    opens a node's standing secret to any workflow's live command for that node by it."""
    return _WORKFLOWS


def workflow_command_prefix(workflow_id: str) -> str:
    """``wf:<workflow_id>``: what every command key of the workflow starts with (the workflow's
    destructive batch is keyed by it, and an abort cancels every command under it)."""
    return f"{_WORKFLOWS}:{workflow_id}"


def step_key_prefix(workflow_id: str, step: int) -> str:
    """``wf:<workflow_id>:<step>``: what the keys of every attempt of one step start with."""
    return f"{workflow_command_prefix(workflow_id)}:{step}"


def attempt_key(workflow_id: str, step: int, attempt: int, key: str | None = None) -> str:
    """``wf:<workflow_id>:<step>#<attempt>[:<key>]``.

    What an attempt mints or sends is keyed by it or by a key under it (the next character is
    ``:``), so ``wf:X:3#1`` never covers ``wf:X:3#12``.

    Args:
        key: tells several commands of one step apart (``boot-device``); letters, digits,
            ``.``, ``_`` and ``-``, up to 64 characters.

    Raises:
        BcError: ``INVALID_INPUT`` at ``key`` for a malformed key.
    """
    base = f"{step_key_prefix(workflow_id, step)}#{attempt}"
    if key is None:
        return base
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "command keys are 1-64 letters, digits, '.', '_' or '-'",
            {"path": "key"},
        )
    return f"{base}:{key}"
