"""What earlier runs of a control-plane step attempt got back, kept in this engine process so the
next run of the same attempt does not ask again.

A control-plane step runs its whole body on every pass until it returns: ``metal.ensureRamdisk``
reads the ramdisk override, mints its join token (``tokens.issue``), stores it
(``secrets.put``), then finds each command it already sent by enqueueing it again. Each of
those calls is idempotent for the attempt, so a re-run gets the same answers; the memo keeps
them: the attempt's mint secret and which services it marked as minted in, its join tokens by
idempotency key, its secret refs by key and a digest of the value, and its commands that ended
(a terminal command never changes) by node and key. A pass that finds them skips the round trip.
A command it saw live is read again by its id (``commands.get``: one read by primary key in the
command queue), not enqueued again (a find-before-create: an insert that conflicts, then a read).

Nothing depends on it: a miss (another engine ran the attempt, the memo was evicted, the process
restarted) makes the same idempotent calls as without it. It is memory only, never written
anywhere: it holds join tokens. One entry per workflow (a workflow runs one step attempt at a
time), least recently used first out; an entry is dropped when its attempt settles (the step
succeeded or failed: a retry's attempt has new keys), and replaced when another attempt of the
workflow runs. An aborted attempt never runs again (a resume starts a new attempt), so its
revoked token cannot be handed out; the entry is dropped when the abort's clean-up pass looks at
the workflow, or ages out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

from better_compute.wire.cmdq import TERMINAL_STATES, CommandView
from better_compute.wire.pki import IssuedJoinToken

__all__ = ["MAX_MEMO_RESULT", "MAX_MEMO_WORKFLOWS", "AttemptMemo", "AttemptMemos"]

MAX_MEMO_WORKFLOWS: Final = 4096
"""Workflows whose running attempt is remembered; the least recently run goes first."""
MAX_MEMO_RESULT: Final = 64 * 1024
"""A command whose result is larger is not kept (an inventory): asked again, as without a memo."""


@dataclass
class AttemptMemo:
    """What the runs of one step attempt got back (see the module)."""

    workflow_id: str
    step: int
    attempt: int
    mint_secret: bytes | None = None
    marked: set[str] = field(default_factory=set)
    """The services the attempt is recorded as having minted in (``pki``, ``secrets``)."""
    tokens: dict[str, IssuedJoinToken] = field(default_factory=dict)
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)
    commands: dict[tuple[str, str], CommandView] = field(default_factory=dict)
    sent: dict[tuple[str, str], str] = field(default_factory=dict)
    """The id of each command an earlier run found live, by node and key: the next run reads it
    by id (``commands.get``) rather than enqueueing it again."""
    found: dict[str, object] = field(default_factory=dict)
    """What the step's own reads found in an earlier run, by the name it gave them
    (``RunContext.once``)."""

    def command(self, node_id: str, key: str, kind: str) -> CommandView | None:
        """The command of ``key`` on ``node_id`` when an earlier run saw it end."""
        view = self.commands.get((node_id, key))
        return view if view is not None and view.kind == kind else None

    def keep_command(self, node_id: str, view: CommandView) -> None:
        """Keep ``view`` if it ended (and its result is small): it never changes again; else
        its id, to read it by."""
        if view.state in TERMINAL_STATES and len(view.result or b"") <= MAX_MEMO_RESULT:
            self.commands[(node_id, view.key)] = view
        self.sent[(node_id, view.key)] = view.id


class AttemptMemos:
    """The memo of each workflow's running step attempt, bounded (least recently used out)."""

    def __init__(self, limit: int = MAX_MEMO_WORKFLOWS) -> None:
        self.limit = limit
        self._by_workflow: OrderedDict[str, AttemptMemo] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_workflow)

    def of(self, workflow_id: str, step: int, attempt: int) -> AttemptMemo:
        """The memo of this attempt: the one kept, or a new one (which replaces another
        attempt's of the same workflow)."""
        memo = self._by_workflow.get(workflow_id)
        if memo is not None and memo.step == step and memo.attempt == attempt:
            self._by_workflow.move_to_end(workflow_id)
            return memo
        memo = AttemptMemo(workflow_id=workflow_id, step=step, attempt=attempt)
        self._by_workflow[workflow_id] = memo
        self._by_workflow.move_to_end(workflow_id)
        while len(self._by_workflow) > self.limit:
            self._by_workflow.popitem(last=False)
        return memo

    def drop(self, workflow_id: str) -> None:
        """Forget the workflow's attempt (it settled, or the workflow stopped running)."""
        self._by_workflow.pop(workflow_id, None)
