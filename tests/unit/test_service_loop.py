"""The services and the site agent run on uvloop unless ``BC_EVENT_LOOP=asyncio`` says otherwise."""

from __future__ import annotations

import asyncio

import pytest

from better_compute.service.loop import run_loop, uses_uvloop

pytestmark = pytest.mark.unit


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_and_asyncio_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BC_EVENT_LOOP", raising=False)
    assert uses_uvloop()
    assert run_loop(_loop_module()).startswith("uvloop")
    monkeypatch.setenv("BC_EVENT_LOOP", "asyncio")
    assert not uses_uvloop()
    assert run_loop(_loop_module()).startswith("asyncio")
