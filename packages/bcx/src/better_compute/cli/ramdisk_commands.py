"""``bcx ramdisk build``: the bcd ramdisk from packages (docs/real-machines.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from ..config import Settings
from ..runtime.os_image import build_os_image
from ..runtime.ramdisk import build
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


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    ramdisk = sub.add_parser("ramdisk", help="the bcd ramdisk: build it from packages").add_subparsers(
        dest="ramdisk_command", required=True, metavar="COMMAND"
    )
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
