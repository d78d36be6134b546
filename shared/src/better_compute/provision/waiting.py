"""``step_not_ready``: how a control-plane step says "not yet, run me again later"."""

from __future__ import annotations

from typing import Final

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["DEFAULT_NOT_READY_MS", "StepNotReady", "step_not_ready"]

DEFAULT_NOT_READY_MS: Final = 5_000


class StepNotReady(Exception):  # noqa: N818 - the page's name; a signal to wait, not an error
    """Raised by a step that cannot finish yet. Not an error: the engine settles nothing and
    runs the step again after ``retry_after_ms``, never later than its deadline.

    Args:
        retry_after_ms: positive whole milliseconds.

    Raises:
        BcError: ``INVALID_INPUT`` at ``ms`` for anything but a positive int.
    """

    def __init__(self, retry_after_ms: int = DEFAULT_NOT_READY_MS) -> None:
        if isinstance(retry_after_ms, bool) or not isinstance(retry_after_ms, int) or retry_after_ms <= 0:
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"step_not_ready takes positive whole milliseconds, got {retry_after_ms!r}",
                {"path": "ms"},
            )
        super().__init__(f"step not ready, retry in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[object, ...]:
        return (StepNotReady, (self.retry_after_ms,))


def step_not_ready(ms: int = DEFAULT_NOT_READY_MS) -> StepNotReady:
    """The exception to raise when a step must wait: ``raise step_not_ready(2000)``."""
    return StepNotReady(ms)
