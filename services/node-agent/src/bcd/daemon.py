"""``bcd run``: serve node commands through the agent SDK, each result signed with the node key.

The same program serves in the ramdisk (inventory, wipe, image write; no converger) and in the
installed OS (inventory and the host converger). A kind the mode does not serve is rejected
by the SDK (``unsupported-kind: this agent does not run node.converge``); the kinds a mode serves
are what the agent announces, so the ramdisk never claims ``node.converge``. Both modes sign
every result, a rejection too, with the node key.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Literal

from better_compute.agent import Agent, Command, CommandHandler, CommandRejected, Enrollment
from better_compute.backoff import Backoff
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.service.client import ApiClient, connect
from better_compute.wire import Subjects
from better_compute.wire.commands import (
    ConvergeResult,
    ImageWriteResult,
    NodeConverge,
    NodeImageWrite,
    NodeInventoryResult,
    NodeWipe,
    WipeResult,
    decode_payload,
)

from .bus import carried_bus
from .configdrive import ConfigDrive
from .converger import Converger
from .disks import wipe
from .hardware import inventory
from .image import image_write
from .join import BcdState, agent_nats_options, nats_url, read_cmdline
from .simulation import tagged
from .system import Machine

__all__ = ["MODES", "Mode", "detect_mode", "node_handlers", "serve"]

Mode = Literal["ramdisk", "installed"]
MODES: Final = ("ramdisk", "installed")
RAMDISK_KINDS: Final = ("node.inventory", "node.wipe", "node.imageWrite")
INSTALLED_KINDS: Final = ("node.inventory", "node.converge")


def log() -> Any:
    """bcd's logger, as configured when it logs (never bound before ``configure_logging``)."""
    return get_logger(component="bcd")


def detect_mode(machine: Machine, given: str | None = None) -> Mode:
    """``given``, else ``bcd.mode=`` on the kernel command line, else ``ramdisk`` when
    ``/etc/bcd/ramdisk`` exists, else ``installed``."""
    choice = given or read_cmdline(machine).get("mode")
    if choice is None:
        choice = "ramdisk" if machine.path("/etc/bcd/ramdisk").exists() else "installed"
    if choice not in MODES:
        raise BcError(
            ErrorCode.INVALID_INPUT, f"mode is ramdisk or installed, got {choice!r}", {"path": "mode"}
        )
    return "ramdisk" if choice == "ramdisk" else "installed"


def node_handlers(
    machine: Machine,
    mode: Mode,
    *,
    converger: Converger | None = None,
    fetch_secret: Callable[[str], Awaitable[bytes]] | None = None,
    node_id: str | None = None,
    bus: bytes | None = None,
) -> dict[str, CommandHandler]:
    """The command handlers bcd serves in ``mode``. ``fetch_secret`` reads a value through the
    secrets gate (an image write's ``userDataRef``); ``node_id`` is this node's (the config
    drive's instance id); ``bus`` the bus files the config drive carries to the installed OS
    (``bus.carried_bus``)."""

    async def node_inventory(cmd: Command) -> NodeInventoryResult:
        return await asyncio.to_thread(inventory, machine)

    async def node_wipe(cmd: Command) -> WipeResult:
        payload = decode_payload(cmd.payload, NodeWipe, path="payload")
        return await asyncio.to_thread(wipe, machine, disks=payload.disks, mode=payload.mode)

    async def node_image_write(cmd: Command) -> ImageWriteResult:
        payload = decode_payload(cmd.payload, NodeImageWrite, path="payload")
        drive = None
        if payload.user_data_ref:
            if fetch_secret is None or node_id is None:
                raise CommandRejected("unsupported: this daemon cannot fetch user data")
            # Fetched before anything is written: a refused fetch leaves the disk as it was.
            # The gate opens it while this command is live (docs/pki-and-secrets.md).
            user_data = await fetch_secret(payload.user_data_ref)
            drive = ConfigDrive(user_data=user_data, node_id=node_id, bus=bus)
        loop = asyncio.get_running_loop()

        def progress(message: str, percent: float | None) -> None:
            asyncio.run_coroutine_threadsafe(cmd.progress(message, percent=percent), loop)

        return await asyncio.to_thread(
            image_write,
            machine,
            url=payload.url,
            sha256=payload.sha256,
            fmt=payload.format,
            disk=payload.disk,
            progress=progress,
            config_drive=drive,
        )

    async def node_converge(cmd: Command) -> ConvergeResult:
        assert converger is not None
        payload = decode_payload(cmd.payload, NodeConverge, path="payload")
        return await converger.converge(generation=payload.generation, units=payload.units)

    if mode == "ramdisk":
        return {"node.inventory": node_inventory, "node.wipe": node_wipe, "node.imageWrite": node_image_write}
    return {
        "node.inventory": node_inventory,
        "node.converge": node_converge,
    }


async def serve(
    state: BcdState,
    *,
    mode: Mode,
    control_plane: str | None = None,
    subject_root: str | None = None,
    stop: asyncio.Event | None = None,
    simulate: bool = False,
    signals: bool = True,
    connected: Callable[[Any], None] | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT, unless ``signals`` is off: the simulator's
    lean host serves many machines in one process); rides out control-plane outages.
    ``connected`` is told of the NATS connection once it is made."""
    enrollment: Enrollment | None = state.enrollment()
    if enrollment is None:
        raise BcError(
            ErrorCode.INVALID_STATE,
            "this machine has not joined: run bcd join first",
            {"path": str(state.enrollment_file), "reason": "not-joined"},
        )
    saved = state.settings()
    url = nats_url(control_plane or str(saved.get("controlPlane") or ""))
    subjects = Subjects(root=subject_root or str(saved.get("subjectRoot") or "bc"))
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    nc = await connect_as_agent(url, lambda: agent_nats_options(state, enrollment), stop)
    if nc is None:
        return
    if connected is not None:
        connected(nc)
    try:
        await _serve_on(nc, state, enrollment, mode, subjects, stop, simulate=simulate)
    finally:
        await nc.close()


UNREACHABLE_BACKOFF: Final = (1.0, 30.0)
"""First and longest wait (seconds) between tries while NATS does not answer."""
REFUSED_BACKOFF: Final = (1.0, 10.0)
"""First and longest wait (seconds) between tries while NATS refuses this certificate: shorter
than an outage's, as the refusal ends the moment the site agent confirms the boot entry."""
REFUSED_PATIENCE_S: Final = 900.0
"""How long refusals last before bcd stops expecting a confirm soon: a ``pending`` certificate is
refused only until its boot entry closes clean (``netboot.quiet_seconds``, 120 s by default),
a revoked one for ever."""
REFUSED_LONG_CAP_S: Final = 600.0
"""The longest wait between tries once the refusals have outlasted ``REFUSED_PATIENCE_S``."""


async def connect_as_agent(
    url: str,
    options: Callable[[], Mapping[str, Any]],
    stop: asyncio.Event,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Any | None:
    """Connect to NATS with ``options()`` (made afresh for each try), riding out a server that is
    away and one that refuses this agent's certificate; ``None`` once ``stop`` is set. Each wait is
    jittered (a site's machines do not retry in step). Anything else (a CA not trusted, a bad
    configuration) is raised.

    A refusal is what a deploy/ leaf answers while the certificate is ``pending`` (joined with a
    ``held`` token, the boot entry not closed clean yet, docs/security.md): it lasts until the site
    agent confirms the entry, so bcd keeps trying rather than exiting, every few seconds
    (``REFUSED_BACKOFF``). The leaf does not tell bcd why it refused, and a revoked certificate is
    refused the same way for ever: once the refusals have lasted ``REFUSED_PATIENCE_S``, the waits
    grow to ``REFUSED_LONG_CAP_S``, so a revoked machine costs its leaf a handshake every few
    minutes, and one confirmed that late connects within minutes of the confirm."""
    unreachable, refused = (
        Backoff(first=UNREACHABLE_BACKOFF[0], cap=UNREACHABLE_BACKOFF[1]),
        Backoff(first=REFUSED_BACKOFF[0], cap=REFUSED_BACKOFF[1]),
    )
    refused_since: float | None = None
    while not stop.is_set():
        try:
            return await connect(url, **options())
        except BcError as err:
            if err.code is ErrorCode.UNAVAILABLE:
                wait = unreachable.next()
                log().warning("control_plane_unreachable", retry_in_s=round(wait, 1))
            elif err.code is ErrorCode.UNAUTHENTICATED:
                refused_since = clock() if refused_since is None else refused_since
                if refused.cap < REFUSED_LONG_CAP_S and clock() - refused_since >= REFUSED_PATIENCE_S:
                    refused.cap = REFUSED_LONG_CAP_S
                    log().warning(
                        "control_plane_refused_certificate_for_long",
                        refused_for_s=round(clock() - refused_since),
                        hint="a pending certificate is confirmed within minutes: this one is likely revoked;"
                        f" trying again at most every {REFUSED_LONG_CAP_S:.0f} s",
                    )  # fmt: skip
                wait = refused.next()
                log().warning(
                    "control_plane_refused_certificate", retry_in_s=round(wait, 1), tries=refused.failures,
                    hint="pending until the site agent confirms the boot entry, or revoked",
                )  # fmt: skip
            else:
                raise
        await _pause(stop, wait)
    return None


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds`` or until ``stop`` is set (a test runs it on a fake clock)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def _serve_on(
    nc: Any,
    state: BcdState,
    enrollment: Enrollment,
    mode: Mode,
    subjects: Subjects,
    stop: asyncio.Event,
    *,
    simulate: bool = False,
) -> None:
    api = ApiClient(nc, subjects)
    secrets = SecretsClient(api)

    async def fetch_secret(ref: str) -> bytes:
        return await secrets.fetch(ref=ref, identity=enrollment.identity)

    converger = Converger(state.machine, fetch_secret=fetch_secret) if mode == "installed" else None
    handlers: Mapping[str, CommandHandler] = node_handlers(
        state.machine,
        mode,
        converger=converger,
        fetch_secret=fetch_secret,
        node_id=enrollment.agent_id,
        bus=carried_bus(state.folder) if mode == "ramdisk" else None,
    )
    if simulate:
        handlers = tagged(handlers)  # the simulated disks see which command writes them
    agent = Agent(
        enrollment=enrollment,
        handlers=handlers,
        journal=state.journal_file,
        nc=nc,
        subjects=subjects,
        sign_results=True,
        max_concurrency=4,
    )
    log().info("bcd_serving", node_id=enrollment.agent_id, mode=mode, kinds=sorted(handlers))
    async with agent:
        runner = asyncio.create_task(agent.run(), name="bcd-agent")
        stopper = asyncio.create_task(stop.wait(), name="bcd-stop")
        try:
            done, _ = await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # cancelled too (the lean host's pulled plug): nothing left waiting
            agent.request_stop()
            stopper.cancel()
        if runner in done:
            runner.result()
        else:
            await runner
