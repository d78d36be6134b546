"""The engine's retry decision is ``RetryPolicy``'s own code, on the policy the step stored
(issue 24): what the unit test of the policy checks is what runs."""

from __future__ import annotations

import pytest

from bc_engine.core.retries import retry_delay_s
from bc_engine.store import StepRow
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import RetryPolicy, parse_retry

pytestmark = pytest.mark.unit


def _row(retry: object, attempt: int, retry_base: int = 0) -> StepRow:
    return StepRow(
        workflow_id="wf_1", idx=2, action="a.b", runs_on="control-plane", mode="run", command=None,
        input={}, timeout_ms=60_000, state="running", attempt=attempt, started_at=None, deadline=None,
        finished_at=None, retry=retry, retry_base=retry_base,
    )  # fmt: skip


def test_a_stored_policy_reads_back_as_the_policy() -> None:
    policy = parse_retry({"attempts": 4, "backoff": "1s", "maxBackoff": "3s", "on": ["CONFLICT"]}, "retry")
    assert RetryPolicy.from_stored(policy.to_stored()) == policy
    assert RetryPolicy.from_stored(None) is None
    assert RetryPolicy.from_stored({"attempts": "many"}) is None


def test_the_engine_waits_and_stops_as_the_policy_says() -> None:
    policy = parse_retry({"attempts": 4, "backoff": "1s", "maxBackoff": "3s", "on": ["CONFLICT"]}, "retry")
    stored = policy.to_stored()
    conflict, invalid = BcError(ErrorCode.CONFLICT, "x"), BcError(ErrorCode.INVALID_INPUT, "x")
    assert [retry_delay_s(_row(stored, n), conflict) for n in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert retry_delay_s(_row(stored, 4), conflict) is None  # four attempts ran
    assert retry_delay_s(_row(stored, 5, retry_base=4), conflict) == 1.0  # an operator's retry
    assert retry_delay_s(_row(stored, 1), invalid) is None
    assert retry_delay_s(_row(None, 1), conflict) is None
