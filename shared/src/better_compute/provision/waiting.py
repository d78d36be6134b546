"""``step_not_ready``: how a control-plane step says "not yet, run me again later"."""

from __future__ import annotations

from typing import Final

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["DEFAULT_NOT_READY_MS", "MAX_REASON_CHARS", "CommandNotReady", "StepNotReady", "step_not_ready"]

DEFAULT_NOT_READY_MS: Final = 5_000
MAX_REASON_CHARS: Final = 300


class StepNotReady(Exception):  # noqa: N818 - the page's name; a signal to wait, not an error
    """Raised by a step that cannot finish yet. Not an error: the engine settles nothing and
    runs the step again after ``retry_after_ms``, never later than its deadline.

    Args:
        retry_after_ms: positive whole milliseconds.
        reason: what the step waits for, in a few words (``"no DHCP lease for 52:54:…"``);
            the engine keeps it as the step's ``waitingFor`` and ``bcx why`` says it. Never a
            secret: it is shown to operators.

    Raises:
        BcError: ``INVALID_INPUT`` at ``ms`` for anything but a positive int, at ``reason`` for
        anything but a string of at most ``MAX_REASON_CHARS``.
    """

    def __init__(self, retry_after_ms: int = DEFAULT_NOT_READY_MS, reason: str | None = None) -> None:
        if isinstance(retry_after_ms, bool) or not isinstance(retry_after_ms, int) or retry_after_ms <= 0:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"step_not_ready takes positive whole milliseconds, got {retry_after_ms!r}",
                {"path": "ms"},
            )
        if reason is not None and (not isinstance(reason, str) or not 0 < len(reason) <= MAX_REASON_CHARS):
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"step_not_ready's reason is a string of 1 to {MAX_REASON_CHARS} characters",
                {"path": "reason"},
            )
        super().__init__(f"step not ready, retry in {retry_after_ms} ms" + (f": {reason}" if reason else ""))
        self.retry_after_ms = retry_after_ms
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (StepNotReady, (self.retry_after_ms, self.reason))


class CommandNotReady(StepNotReady):
    """What ``await_command`` raises while its command is live: a ``StepNotReady`` like any
    other (``retry_after_ms`` is ``COMMAND_POLL_MS``) that also names the command. The engine
    waits for that command's settle instead of running the step again after the ms: it records
    the command as the one the step waits on, and the command's event (or the engine's command
    watch) wakes the step. A step's own ``step_not_ready`` keeps its ms.

    Args:
        retry_after_ms: as ``StepNotReady``; when a runner knows no better.
        command_id: the live command (``cmd_…``).
        key: its key (``wf:<id>:<step>#<attempt>[:<key>]``).
        kind: its kind (``power.setPower``).
        state: its state when it was looked at (``pending``, ``running``, …).
    """

    def __init__(
        self, retry_after_ms: int, *, command_id: str, key: str, kind: str, state: str = "pending"
    ) -> None:
        super().__init__(retry_after_ms)
        self.command_id = command_id
        self.key = key
        self.kind = kind
        self.state = state

    def __reduce__(self) -> tuple[object, ...]:
        return (_command_not_ready, (self.retry_after_ms, self.command_id, self.key, self.kind, self.state))


def _command_not_ready(ms: int, command_id: str, key: str, kind: str, state: str) -> CommandNotReady:
    return CommandNotReady(ms, command_id=command_id, key=key, kind=kind, state=state)


def step_not_ready(ms: int = DEFAULT_NOT_READY_MS, *, reason: str | None = None) -> StepNotReady:
    """The exception to raise when a step must wait: ``raise step_not_ready(2000)``, or with
    what it waits for: ``raise step_not_ready(2000, reason="no lease for 52:54:00:00:00:01")``."""
    return StepNotReady(ms, reason)
