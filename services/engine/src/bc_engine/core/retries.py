"""Retry policies at run time: whether a failed attempt runs again on its own, and when.

The policy a step resolved with (its profile step's ``retry``, else its definition's default) is
stored on the step row. A failed attempt whose code the policy lists, with fewer than
``attempts`` attempts run since the workflow started (or since an operator's retry or resume,
``retry_base``), is settled back to ``pending`` with ``retry_at`` = now + the backoff instead of
failing the workflow. The next attempt then starts like any later attempt (``engine._advance``):
not before ``retry_at``, and only once the failed attempt is superseded (its tokens and secrets
revoked, its commands cancelled and fenced, none still running at an agent), under its own
idempotency key ``wf:<workflow>:<step>#<attempt>``.
"""

from __future__ import annotations

from better_compute.core.errors import BcError
from better_compute.provision import RetryPolicy

from ..store import StepRow

__all__ = ["retry_delay_s"]


def retry_delay_s(step: StepRow, error: BcError) -> float | None:
    """Seconds until the next attempt when the step's policy retries ``error``, else None."""
    policy = RetryPolicy.from_stored(step.retry)
    ran = step.attempt - step.retry_base
    if policy is None or not policy.retries(error.code.value, ran):
        return None
    return policy.delay_ms(ran) / 1000
