"""bcd's join asks again, with the same key, when bc-pki took the request and never answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import bcd.join as bcd_join
from bcd.join import BcdState, join
from bcd.system import Machine
from better_compute.agent import Enrollment
from better_compute.core.errors import BcError, ErrorCode
from better_compute.testing.machines import RecordingRunner, prepare_machine
from better_compute.wire.pki import JoinClaims


class _Nats:
    async def close(self) -> None:
        pass


class _NoPause:
    def __init__(self, **_: Any) -> None:
        pass

    def next(self) -> float:
        return 0.0


async def test_a_join_that_timed_out_is_asked_again_with_the_same_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ask times out (the bc-pki that took it was SIGKILLed: it may have spent the
    token); the second, with the same key, gets the certificate. Before, bcd gave up on the
    timeout and the machine never joined; and a second ask with a new key is refused by bc-pki."""
    keys: list[Any] = []

    async def enroll(pki: Any, *, token: str, claims: Any, site_id: Any, key: Any = None) -> Enrollment:
        keys.append(key)
        if len(keys) == 1:
            raise BcError(ErrorCode.TIMEOUT, "bc.api.pki.agents.join did not answer within 10.0s")
        return Enrollment(
            agent_id="node_1", cert_id="cert_1", site_id="lab1", tenant_id="root", role="provisioned",
            certificate_pem="-----BEGIN CERTIFICATE-----\n", private_key=key,
        )  # fmt: skip

    async def connect(*_: Any, **__: Any) -> _Nats:
        return _Nats()

    monkeypatch.setattr(bcd_join, "enroll", enroll)
    monkeypatch.setattr(bcd_join, "connect", connect)
    monkeypatch.setattr(bcd_join, "Backoff", _NoPause)
    machine = Machine(root=prepare_machine(tmp_path / "root"), runner=RecordingRunner())  # type: ignore[arg-type]
    state = BcdState(machine)
    got = await join(
        state, control_plane="nats://127.0.0.1:1", token="bcjt_" + "A" * 43, node_id="node_1",
        claims=JoinClaims(macs=["aa:bb:cc:00:00:01"]), wait_s=60,
    )  # fmt: skip
    assert got.agent_id == "node_1"
    assert len(keys) == 2
    assert keys[0] is keys[1]
    assert state.enrollment() is not None
