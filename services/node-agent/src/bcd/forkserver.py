"""``python -m bcd.forkserver``: bcd's fork server for the metal simulator.

The simulator (``better_compute.testing.metal_sim``) boots a bcd per simulated machine, twice a
boot (``join``, then ``run``). This server imports bcd once and forks a child per request, so
each is still its own OS process (own pid, environment, log file, exit code, killable with
SIGKILL) running ``bcd.__main__.main`` with the arguments ``python -m bcd`` would get, without
the Python start-up (2.3 s of CPU each). Protocol on stdin/stdout, one JSON document a line:
``{"id": n, "argv": [...], "env": {...}, "log": path}`` → ``{"id": n, "pid": pid}``, and
``{"exit": pid, "code": code}`` when a child ends. It forks only from its one thread; when its
stdin closes it kills its children and exits. The client is
``better_compute.testing.metal_sim.zygote.BcdZygote``. For simulation and tests only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import IO, Any

from better_compute.service.forks import serve_forks


def _child(doc: dict[str, Any]) -> None:
    """In the forked child: become that bcd, then exit with its code."""
    code = 1
    try:
        os.setpgid(0, 0)
        fd = os.open(doc["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(doc["env"])
        from better_compute.service import killpoints

        # read at import, in the server: this bcd's own BC_KILL_AT (or none) from its environment
        killpoints.configure(os.environ.get("BC_KILL_AT"), os.environ.get("BC_KILL_MARKER_DIR"))
        import random

        random.seed()  # not the server's sequence
        from bcd.__main__ import main

        sys.argv = ["bcd", *doc["argv"]]
        main(doc["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    import bcd.__main__
    import bcd.daemon  # noqa: F401

    # What the imports made is shared with every child until written to; a collection in a
    # child would touch (and so copy) every page of it. Frozen, it stays out of the collector:
    # a thousand simulated machines share one copy of bcd's modules instead of each its own.
    gc.collect()
    gc.freeze()
    serve_forks(inp, out, _child)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
