"""bcd's connection to NATS before it serves (``bcd.daemon.connect_as_agent``): a server away and
a refused certificate are waited out with a jittered backoff, anything else is raised."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from bcd import daemon
from better_compute.backoff import Backoff
from better_compute.core.errors import BcError, ErrorCode
from better_compute.testing.waiting import until

pytestmark = pytest.mark.unit


def _refusing(times: int, code: ErrorCode, tries: list[dict[str, Any]]) -> Any:
    async def connect(url: str, **options: Any) -> object:
        tries.append(options)
        if len(tries) <= times:
            raise BcError(code, "NATS at tls://leaf refused this connection's credentials")
        return "connection"

    return connect


async def test_a_refused_certificate_is_tried_again_with_backoff_until_nats_lets_it_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deploy/ leaf refuses a ``pending`` certificate until the site agent confirms the boot
    entry; bcd exited on the first refusal. Now it logs each one and tries again, never at once."""
    tries: list[dict[str, Any]] = []
    monkeypatch.setattr(daemon, "connect", _refusing(3, ErrorCode.UNAUTHENTICATED, tries))
    monkeypatch.setattr(daemon, "REFUSED_BACKOFF", (0.01, 0.02))
    with capture_logs() as logs:
        nc = await daemon.connect_as_agent("tls://leaf", lambda: {"name": "bcd"}, asyncio.Event())
    assert nc == "connection"
    assert len(tries) == 4
    refused = [e for e in logs if e["event"] == "control_plane_refused_certificate"]
    assert [e["tries"] for e in refused] == [1, 2, 3]
    assert all(e["log_level"] == "warning" and e["retry_in_s"] >= 0 for e in refused)


def test_the_waits_after_a_refusal_are_jittered_and_never_a_tight_loop() -> None:
    first, cap = daemon.REFUSED_BACKOFF
    assert first >= 0.5
    assert cap <= 30
    waits = {Backoff(first=first, cap=cap).next() for _ in range(20)}
    assert len(waits) > 1  # jittered
    assert min(waits) >= first / 2


async def test_a_stop_ends_the_wait_and_other_errors_are_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = asyncio.Event()
    tries: list[dict[str, Any]] = []
    monkeypatch.setattr(daemon, "connect", _refusing(100, ErrorCode.UNAUTHENTICATED, tries))
    waiting = asyncio.ensure_future(daemon.connect_as_agent("tls://leaf", dict, stop))
    await until(lambda: len(tries) >= 2, timeout=10, what="a try after the first refusal")
    stop.set()
    assert await asyncio.wait_for(waiting, 5) is None
    monkeypatch.setattr(daemon, "connect", _refusing(1, ErrorCode.INVALID_CONFIG, []))
    with pytest.raises(BcError) as err:
        await daemon.connect_as_agent("tls://leaf", dict, asyncio.Event())
    assert err.value.code is ErrorCode.INVALID_CONFIG


async def test_a_refusal_that_outlasts_any_pending_certificate_is_tried_again_only_every_few_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 23: a revoked bcd is refused for ever and tried again every 5-10 s for ever. A pending
    certificate is refused only until its boot entry closes clean (``netboot.quiet_seconds``,
    120 s by default): once the refusals have lasted ``REFUSED_PATIENCE_S``, bcd waits up to
    ``REFUSED_LONG_CAP_S`` between tries, logs that once, and still connects when let in."""
    tries: list[dict[str, Any]] = []
    waits: list[float] = []
    now = [0.0]
    monkeypatch.setattr(daemon, "connect", _refusing(200, ErrorCode.UNAUTHENTICATED, tries))

    async def pause(_stop: asyncio.Event, seconds: float) -> None:  # the wait between tries, on a fake clock
        waits.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(daemon, "_pause", pause)
    with capture_logs() as logs:
        nc = await daemon.connect_as_agent(
            "tls://leaf", lambda: {"name": "bcd"}, asyncio.Event(), clock=lambda: now[0]
        )
    assert nc == "connection"
    patience = daemon.REFUSED_PATIENCE_S
    early = [w for w, at in zip(waits, _elapsed(waits), strict=True) if at < patience]
    late = [
        w for w, at in zip(waits, _elapsed(waits), strict=True) if at >= patience + daemon.REFUSED_LONG_CAP_S
    ]
    assert early
    assert max(early) <= daemon.REFUSED_BACKOFF[1]
    assert late
    assert min(late) >= daemon.REFUSED_LONG_CAP_S / 2
    assert daemon.REFUSED_LONG_CAP_S >= 300
    told = [e for e in logs if e["event"] == "control_plane_refused_certificate_for_long"]
    assert len(told) == 1


def _elapsed(waits: list[float]) -> list[float]:
    """When each wait started, counted from the first refusal."""
    out, at = [], 0.0
    for w in waits:
        out.append(at)
        at += w
    return out
