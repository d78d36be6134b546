"""Console-script entry for a service: flags, settings, logging, signals."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from ..config import SettingsSource
from ..core.errors import BcError
from ..logging import configure_logging, get_logger
from .base import Service
from .loop import run_loop

__all__ = ["run_service"]


def run_service(cls: type[Service], argv: list[str] | None = None) -> None:
    """Parse flags, then serve ``cls`` until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog=cls.name, description=cls.description or cls.name)
    parser.add_argument("--config", help="bc.toml path (default: $BC_CONFIG or ./bc.toml)")
    parser.add_argument("--nats-url", help="NATS URL (default: $BC_NATS_URL or embedded)")
    parser.add_argument("--database-url", help="PostgreSQL URL (default: $BC_DATABASE_URL or embedded)")
    parser.add_argument("--app", help="package.module:attr of the deployment's App")
    parser.add_argument("--subject-root", help="root of every subject (default bc)")
    parser.add_argument("--state-dir", help="state directory of the embedded servers")
    parser.add_argument("--health-port", type=int, help="serve GET /healthz and /metrics on 127.0.0.1:PORT")
    parser.add_argument("--instance", help="instance name (default host-pid)")
    parser.add_argument("--log-level", help="debug, info, warning, error")
    args = parser.parse_args(argv)
    if args.config:
        # the app (``metal()`` reads ``[ramdisk]``) loads the same file as the service
        os.environ["BC_CONFIG"] = args.config
    try:
        source = SettingsSource(
            args.config,
            nats_url=args.nats_url,
            database_url=args.database_url,
            app=args.app,
            subject_root=args.subject_root,
            state_dir=args.state_dir,
            health_port=args.health_port,
            instance=args.instance,
            log_level=args.log_level,
        )
        settings = source.read()
    except BcError as err:
        print(f"{cls.name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(level=settings.log_level)
    try:
        svc = cls(settings)
        svc.settings_source = source  # its file is watched: the live settings change at once
        run_loop(_serve(svc))
    except BcError as err:
        # The path names what to fix (a broken plugin: entry_points.<name>); never a traceback.
        get_logger(service=cls.name).error(
            "service_failed", code=err.code.value, error=err.message, path=err.path
        )
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


async def _serve(svc: Service) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, svc.request_stop)
    async with svc:
        await svc.run()
