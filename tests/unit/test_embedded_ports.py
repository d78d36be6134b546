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
