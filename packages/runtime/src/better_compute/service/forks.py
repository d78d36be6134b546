"""The fork servers' loop: bcd's for the metal simulator (``bcd.forkserver``) and the test kit's
for the services (``better_compute.testing.service_forkserver``). Protocol on the server's
stdin/stdout, one JSON document a line: a request ``{"id": n, ...}`` forks a child, answered
``{"id": n, "pid": pid}``; ``{"exit": pid, "code": code}`` when a child ends. It forks only from
its one thread; when its stdin closes it kills its children and returns."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
from collections.abc import Callable
from typing import IO, Any

__all__ = ["serve_forks"]


def serve_forks(inp: IO[bytes], out: IO[bytes], child: Callable[[dict[str, Any]], None]) -> None:
    """The protocol's loop: fork ``child(doc)`` for each request read from ``inp``
    (``child`` never returns: it ends with ``os._exit``), say each child's pid and, once it ends,
    its exit code on ``out``; when ``inp`` closes, kill the children left and return."""

    def say(doc: dict[str, Any]) -> None:
        out.write((json.dumps(doc) + "\n").encode())
        out.flush()

    buffer = b""
    fd = inp.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the client is gone
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                doc = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    child(doc)
                say({"id": doc["id"], "pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    try:
        text = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read()  # noqa: SIM115
    except OSError:
        return []
    return [int(p) for p in text.split()]
