"""The SDK's waiting helpers: until() returns what it waited for or says what never came."""

from __future__ import annotations

import pytest

from better_compute.core.errors import BcError, ErrorCode
from better_compute.testing import refused, until


async def test_until_returns_the_first_truthy_answer_of_a_plain_or_async_check() -> None:
    answers = iter([None, 0, "", "there"])
    assert await until(lambda: next(answers), interval=0) == "there"

    calls = 0

    async def third_time() -> int:
        nonlocal calls
        calls += 1
        return calls if calls == 3 else 0

    assert await until(third_time, interval=0) == 3


async def test_until_gives_up_after_its_timeout_naming_what_and_the_last_error() -> None:
    def settling() -> bool:
        raise ConnectionError("cluster still electing")

    with pytest.raises(AssertionError, match=r"leader elected: not met within 0.05s.*still electing"):
        await until(settling, timeout=0.05, interval=0.01, ignore=(ConnectionError,), what="leader elected")


async def test_an_error_not_ignored_fails_at_once() -> None:
    def broken() -> bool:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await until(broken, timeout=5, ignore=(ConnectionError,))


async def test_refused_returns_the_error_and_fails_when_the_call_succeeds() -> None:
    async def refuse() -> None:
        raise BcError(ErrorCode.CONFLICT, "already there", {"path": "id"})

    async def accept() -> str:
        return "fine"

    err = await refused(refuse())
    assert (err.code, err.path) == (ErrorCode.CONFLICT, "id")
    with pytest.raises(AssertionError, match="expected a refusal"):
        await refused(accept())
