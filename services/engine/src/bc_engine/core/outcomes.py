"""What one attempt of one step came to, for the reconciler pass to settle: ``Ok`` (the result),
``Fail`` (the error) or ``Wait`` (look again at that time: a command still runs, a step is not
ready, one of our services is away). The step runners (``bc_engine.steps``) return them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from better_compute.core.errors import BcError, ErrorCode

from ..store import StepRow

__all__ = ["QUEUE_RETRY_S", "Fail", "Ok", "Outcome", "Wait", "timed_out"]

QUEUE_RETRY_S = 2.0  # the command-queue did not answer: try again this soon


@dataclass(frozen=True)
class Ok:
    result: Any
    encoded: str | None = None  # the result as JSON, when the runner already encoded it

    def json(self) -> str:
        """The result as JSON text, encoded once (the settle stores it)."""
        return self.encoded if self.encoded is not None else msgspec.json.encode(self.result).decode()


@dataclass(frozen=True)
class Fail:
    error: BcError


@dataclass(frozen=True)
class Wait:
    at: float


Outcome = Ok | Fail | Wait


def timed_out(step: StepRow) -> BcError:
    """The step's deadline passed; ``details.waitingFor`` says what it waited for, if anything."""
    details: dict[str, Any] = {"path": f"steps[{step.idx}]"}
    if step.waiting_for:
        details["waitingFor"] = step.waiting_for
    return BcError(
        ErrorCode.TIMEOUT, f"step {step.action} did not finish within {step.timeout_ms} ms", details
    )
