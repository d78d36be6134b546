"""A restarted embedded server keeps its address while a client briefly holds the port."""

from __future__ import annotations

import socket
import threading

import pytest

from better_compute.runtime.embedded import _port_frees, free_port

pytestmark = pytest.mark.unit


def test_a_port_held_for_a_moment_is_waited_for_and_one_held_on_is_given_up() -> None:
    port = free_port()
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    assert not _port_frees(port, within=0.3)  # still held: another port, then
    released = threading.Event()

    def release() -> None:
        released.wait(5)
        holder.close()

    t = threading.Thread(target=release)
    t.start()
    released.set()
    assert _port_frees(port, within=5)  # let go of: the old address is taken back
    t.join()


def test_a_port_given_is_not_given_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody listens on a port ``free_port`` gave until its server starts: the next call could
    pick it again. CI: a site agent whose boot network and metrics listeners got the same port."""
    from collections import deque

    from better_compute.runtime import embedded

    picks = iter([20_011, 20_011, 20_013])

    class Rng:
        def randrange(self, _low: int, _high: int) -> int:
            return next(picks)

    monkeypatch.setattr(embedded.random, "SystemRandom", Rng)
    monkeypatch.setattr(embedded, "_ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(embedded, "_GIVEN", deque(maxlen=4096))
    assert (free_port(), free_port()) == (20_011, 20_013)
