"""bcd, the node agent: ``bcd join``, ``bcd run``, ``bcd inventory``.

Every machine path (the token file, the state folder, /sys, /proc, /dev, /etc) is read under
``--root`` (``BCD_ROOT``, default ``/``), so tests point bcd at a prepared tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import configure_logging

from .bus import adopt_config_drive, fetch_bus_files
from .daemon import MODES, detect_mode, serve
from .hardware import claims, inventory
from .join import DEFAULT_STATE_DIR, JOIN_WAIT_S, BcdState, install_service, join, read_cmdline
from .medium import check_bus_ca, read_boot_medium
from .simulation import SimRunner, install_disk_hook
from .system import Machine

__all__ = ["main", "run"]


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bcd", description="Better Compute node agent")
    parser.add_argument("--root", default=env.get("BCD_ROOT", "/"), help="the machine's root folder")
    parser.add_argument("--state-dir", default=env.get("BCD_STATE_DIR", DEFAULT_STATE_DIR))
    parser.add_argument("--subject-root", default=env.get("BC_SUBJECT_ROOT"))
    parser.add_argument("--log-level", default=env.get("BCD_LOG_LEVEL", "info"))
    parser.add_argument(
        "--simulate",
        action="store_true",
        default=env.get("BCD_SIMULATE") == "1",
        help="a simulated machine: record programs, count disk writes (docs/metal-sim.md)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    j = sub.add_parser("join", help="join the control plane with a single-use token")
    j.add_argument("--control-plane", help="https://, wss:// or nats:// URL (else bcd.control_plane=)")
    j.add_argument("--token-file", help="the join token's file (else bcd.token= on the kernel command line)")
    j.add_argument("--node", help="the node id the token was minted for")
    j.add_argument("--site", help="the site this machine boots in (else bcd.site=)")
    j.add_argument("--no-service", action="store_true", help="do not install and start bcd.service")
    j.add_argument(
        "--wait",
        type=float,
        default=JOIN_WAIT_S,
        metavar="SECONDS",
        help=f"while bc-pki does not answer (the site cut off from the hub), ask again for this long"
        f" (default {JOIN_WAIT_S:g}; 0: fail at once)",
    )
    r = sub.add_parser("run", help="serve commands")
    r.add_argument("--mode", choices=MODES, default=env.get("BCD_MODE"))
    r.add_argument("--control-plane", help="default: the one bcd joined")
    r.add_argument(
        "--join",
        action="store_true",
        help="not joined yet: join first with bcd.token= of the kernel line (the ramdisk's init)",
    )
    sub.add_parser("inventory", help="print the machine's inventory as JSON")
    sub.add_parser("claims", help="print the hardware claims a join shows")
    return parser


async def _join(args: argparse.Namespace, state: BcdState, env: Mapping[str, str]) -> int:
    machine = state.machine
    cmdline = read_cmdline(machine)
    control_plane = args.control_plane or cmdline.get("control_plane")
    if not control_plane:
        raise BcError(ErrorCode.INVALID_INPUT, "give --control-plane", {"path": "control-plane"})
    if args.token_file:
        token_path = (
            machine.path(args.token_file) if args.token_file.startswith("/") else Path(args.token_file)
        )
        try:
            token = token_path.read_text().strip()
        except OSError as exc:
            raise BcError(
                ErrorCode.INVALID_INPUT, f"cannot read the token file: {exc.strerror}", {"path": "token-file"}
            ) from None
    elif cmdline.get("token_from") == "media":  # on the BMC's virtual CD, never the boot network
        token_path = None
        medium = read_boot_medium(machine)
        check_bus_ca(medium, cmdline)
        token = medium.token
    else:
        token_path = None
        token = cmdline.get("token", "")
    if not token:
        raise BcError(
            ErrorCode.INVALID_INPUT, "no join token (--token-file or bcd.token=)", {"path": "token-file"}
        )
    # the bus CA (checked against the kernel line's digest) and the joining certificate; an
    # installed OS, booted without those kernel words, has them on its config drive (unless
    # BC_NATS_CA names a CA by hand; a ramdisk never takes an earlier OS's drive)
    fetched = fetch_bus_files(cmdline, state.folder)
    if not fetched and not env.get("BC_NATS_CA") and detect_mode(machine) == "installed":
        adopt_config_drive(machine, state.folder)
    enrollment = await join(
        state,
        control_plane=control_plane,
        token=token,
        node_id=args.node,
        subject_root=args.subject_root or cmdline.get("subject_root") or "bc",
        site_id=args.site or cmdline.get("site"),
        wait_s=args.wait,
    )
    if token_path is not None:
        token_path.unlink(missing_ok=True)  # spent: nothing left to steal
    if not args.no_service:
        install_service(machine)
    print(json.dumps({"nodeId": enrollment.agent_id, "certId": enrollment.cert_id, "role": enrollment.role,
                      "siteId": enrollment.site_id}))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser(os.environ).parse_args(argv)
    configure_logging(level=args.log_level, stream=sys.stderr)
    try:
        code = asyncio.run(run(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)


async def run(
    argv: list[str],
    env: Mapping[str, str] = os.environ,
    *,
    stop: asyncio.Event | None = None,
    signals: bool = True,
    connected: Callable[[Any], None] | None = None,
    raise_errors: bool = False,
) -> int:
    """One bcd command (``argv`` as ``python -m bcd`` gets it) in the running event loop; its exit
    code. ``main`` runs it as the process; the metal simulator's lean host (``bcd.lean``) runs many
    machines' at once, each with its own ``env`` (root, ledger), ``stop`` and no signal handlers,
    and ``connected`` is told of each machine's NATS connection (so a power-off can cut it);
    ``raise_errors`` raises a ``BcError`` rather than printing it and returning 1."""
    args = _parser(env).parse_args(argv)
    machine = Machine(root=Path(args.root))
    if args.simulate:
        machine = Machine(root=machine.root, runner=SimRunner(machine.root))
        install_disk_hook(machine, ledger=env.get("BCD_SIM_LEDGER"), faults=env.get("BCD_SIM_FAULTS"))
    state = BcdState(machine, args.state_dir)
    try:
        if args.command == "join":
            return await _join(args, state, env)
        if args.command == "run":
            if args.join and state.enrollment() is None:
                # one process for both: a second Python start costs the ramdisk seconds
                joining = argparse.Namespace(
                    control_plane=args.control_plane, token_file=None, node=None, site=None,
                    no_service=True, subject_root=args.subject_root, wait=JOIN_WAIT_S,
                )  # fmt: skip
                await _join(joining, state, env)
            await serve(
                state, mode=detect_mode(machine, args.mode), control_plane=args.control_plane,
                subject_root=args.subject_root, simulate=args.simulate, stop=stop, signals=signals,
                connected=connected,
            )  # fmt: skip
            return 0
        if args.command == "claims":
            print(json.dumps({k: v for k, v in _claims_doc(machine).items() if v}))
            return 0
        print(msgspec.json.format(msgspec.json.encode(inventory(machine))).decode())
        return 0
    except BcError as err:
        if raise_errors:
            raise
        where = f" (at {err.path})" if err.path else ""
        extra = f" {json.dumps(err.details['claims'])}" if "claims" in err.details else ""
        print(f"bcd: error: {err.code.value}: {err.message}{where}{extra}", file=sys.stderr)
        return 1


def _claims_doc(machine: Machine) -> dict[str, object]:
    found = claims(machine)
    return {"macs": found.macs, "productUuid": found.product_uuid, "serial": found.serial,
            "gpuUuids": found.gpu_uuids, "hostname": found.hostname}  # fmt: skip


if __name__ == "__main__":
    main()
