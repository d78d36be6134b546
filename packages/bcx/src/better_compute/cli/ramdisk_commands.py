"""``bcx ramdisk build``: the bcd ramdisk from packages (docs/real-machines.md); ``bcx ramdisk
set|show|clear``: the ramdisk the shipped profiles boot, changed while the engines run."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from ..config import Settings
from ..runtime.os_image import build_os_image
from ..runtime.ramdisk import build
from ..wire.metal import RamdiskView, SetRamdisk
from .output import print_json

__all__ = ["register"]


async def ramdisk_build(args: argparse.Namespace, settings: Settings) -> int:
    cache = Path(args.cache) if args.cache else None

    def say(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    if args.os_image:
        return await _os_image(args, cache, say)
    out = Path(args.out or settings.ramdisk.dir)

    made = await asyncio.to_thread(build, out, cache_dir=cache, compress=args.compress, say=say)
    manifest = made.read_manifest()
    if args.json:
        print_json({"dir": str(out), **manifest})
        return 0
    for part in ("kernel", "initrd"):
        doc = manifest[part]
        print(f"{out / doc['file']}  {doc['size']:>10} bytes  sha256 {doc['sha256']}")
    print(f"{made.manifest}  (packages: {', '.join(f'{k} {v}' for k, v in manifest['packages'].items())})")
    return 0


async def _os_image(args: argparse.Namespace, cache: Path | None, say: Any) -> int:
    out = Path(args.out or OS_IMAGE_OUT)
    made = await asyncio.to_thread(build_os_image, out, cache_dir=cache, say=say)
    if args.json:
        print_json({"dir": str(out), "image": str(made.image), "sha256": made.sha256, "size": made.size})
        return 0
    print(f"{made.image}  {made.size:>10} bytes  sha256 {made.sha256}")
    print(f"{made.manifest}  (register it: bcx images register, docs/images.md)")
    return 0


OS_IMAGE_OUT = ".state/test-os"


async def ramdisk_set(args: argparse.Namespace, settings: Settings) -> int:
    from ..wire.codec import convert
    from .common import engine_client

    given = {
        "kernel": args.kernel, "initrd": args.initrd, "kernelSha256": args.kernel_sha256,
        "initrdSha256": args.initrd_sha256, "cmdline": args.cmdline, "script": args.script,
    }  # fmt: skip
    body = convert({k: v for k, v in given.items() if v is not None}, SetRamdisk)
    async with engine_client(settings) as engine:
        view = await engine.set_ramdisk(body)
    return _show(view, args)


async def ramdisk_show(args: argparse.Namespace, settings: Settings) -> int:
    from .common import engine_client

    async with engine_client(settings) as engine:
        view = await engine.get_ramdisk()
    return _show(view, args)


async def ramdisk_clear(args: argparse.Namespace, settings: Settings) -> int:
    from .common import engine_client

    async with engine_client(settings) as engine:
        view = await engine.clear_ramdisk()
    return _show(view, args)


def _show(view: RamdiskView, args: argparse.Namespace) -> int:
    if args.json:
        print_json(view)
        return 0
    if not view.set:
        print(
            "ramdisk: none set: the shipped profiles boot their own ([ramdisk] of bc.toml, metal(ramdisk=…))"
        )
        return 0
    print(f"ramdisk: set by {view.set_by} at {view.since}: the shipped profiles boot it, every engine")
    for label, value in (
        ("kernel", view.kernel), ("initrd", view.initrd), ("kernel sha256", view.kernel_sha256),
        ("initrd sha256", view.initrd_sha256), ("cmdline", view.cmdline), ("script", view.script),
    ):  # fmt: skip
        if value is not None:
            print(f"  {label:<14} {value}")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    ramdisk = sub.add_parser(
        "ramdisk", help="the bcd ramdisk: build it; set the one the profiles boot"
    ).add_subparsers(dest="ramdisk_command", required=True, metavar="COMMAND")
    p = ramdisk.add_parser(
        "set",
        parents=[common],
        help="the ramdisk the shipped profiles boot from now on (every engine, no restart)",
    )
    p.add_argument("--kernel", help="the kernel's http(s) URL (with --initrd)")
    p.add_argument("--initrd", help="the initrd's http(s) URL")
    p.add_argument("--kernel-sha256", help="the kernel's sha256: the site agent serves it from its cache")
    p.add_argument("--initrd-sha256", help="the initrd's sha256")
    p.add_argument("--cmdline", help="the kernel command line")
    p.add_argument("--script", help="an iPXE script's http(s) URL instead of kernel and initrd")
    p.set_defaults(func=ramdisk_set)
    p = ramdisk.add_parser("show", parents=[common], help="the ramdisk set with bcx ramdisk set, if any")
    p.set_defaults(func=ramdisk_show)
    p = ramdisk.add_parser(
        "clear", parents=[common], help="the shipped profiles boot their own ramdisk again"
    )
    p.set_defaults(func=ramdisk_clear)
    p = ramdisk.add_parser(
        "build", parents=[common], help="kernel, busybox and bcd into vmlinuz, initrd.img and manifest.json"
    )
    p.add_argument("--out", help="output folder (default [ramdisk] dir: .state/ramdisk)")
    p.add_argument(
        "--cache", help="build cache (default $BC_RAMDISK_CACHE or ~/.cache/better-compute/ramdisk)"
    )
    p.add_argument("--compress", choices=("zstd", "gzip"), default="zstd", help="initramfs compression")
    p.add_argument(
        "--os-image",
        action="store_true",
        help="build the test OS image instead (a raw disk: syslinux, the same kernel and bcd, booting "
        f"into bcd in installed mode; default --out {OS_IMAGE_OUT})",
    )
    p.set_defaults(func=ramdisk_build)
