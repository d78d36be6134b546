"""``python -m better_compute.testing.service_forkserver``: the services' fork server for tests.

An end-to-end test starts engine, command-queue, pki and secrets (and often a site agent or a
simulated agent) as OS processes, hundreds of times a run; each ``python -m bc_<service>`` spends
about 1 s of CPU importing before it serves (the site agent 1.5 s). This server imports them once
and forks a child per request: each child is still its own OS process (own pid, environment,
working directory, log file, exit code; signals reach it as they reach a ``subprocess.Popen``
child, SIGKILL included) and runs the service's ``__main__`` with the arguments ``python -m``
would give it. The protocol is ``better_compute.testing.zygote``'s (``{"id", "argv", "env", "log",
"cwd"}`` → ``{"id", "pid"}``, ``{"exit", "code"}``); ``argv[0]`` names the module. It forks only
from its one thread; when its stdin closes it kills its children and exits. ``ServiceProcesses``,
``SiteAgentProcess``, ``SimAgent`` and ``BcdProcess`` are its clients
(``processes.spawn_forked``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import runpy
import sys
import warnings
from typing import IO, Any

from ..runtime.dev import SERVICES
from ..service.forks import serve_forks


def _child(doc: dict[str, Any]) -> None:
    """In the forked child: become that service, then exit with its code."""
    code = 1
    try:
        fd = os.open(doc["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if "cwd" in doc:
            os.chdir(doc["cwd"])
        os.environ.clear()
        os.environ.update(doc["env"])
        from ..service import killpoints

        # read at import, in the server: this process's own BC_KILL_AT (or none)
        killpoints.configure(os.environ.get("BC_KILL_AT"), os.environ.get("BC_KILL_MARKER_DIR"))
        random.seed()  # not the server's sequence
        module, *_ = doc["argv"]
        sys.argv = list(doc["argv"])
        # the server imported <module>.__main__ to share it; running it again as __main__ is the
        # point, so runpy's warning about it ("found in sys.modules") is not one here
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # as the interpreter does: the message on stderr, exit code 1
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    for package in (*SERVICES.values(), "bc_site_agent", "bcd"):
        importlib.import_module(f"{package}.__main__")
    importlib.import_module("better_compute.agent.sim")
    # Shared with every child until written to; frozen, the collector in a child does not touch
    # (and so copy) every page of it.
    gc.collect()
    gc.freeze()
    serve_forks(inp, out, _child)


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
