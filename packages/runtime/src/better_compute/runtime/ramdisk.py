"""``bcx ramdisk build``: the bcd ramdisk, built from packages.

A kernel (Debian's ``linux-image-amd64``: the cloud flavour lacks AHCI, e1000 and the server
NICs), busybox (``busybox-static``) and bcd as one executable (PyInstaller ``--onedir``, with the
C libraries it links from this machine's Debian ``libc6``), packed into a gzip- or zstd-compressed
cpio (newc) written here in Python, so device nodes such as ``/dev/console`` need no root and
nothing is loop-mounted. The packages come with ``apt-get download`` and are unpacked with
``dpkg-deb -x``; nothing is installed on this machine.

Every part is cached under ``cache_dir`` by what it is made of (package versions, bcd's and the
SDK's sources and installed distributions, the init), so a second build is a copy.

Python API (``better_compute.runtime.ramdisk``)::

    art = build(Path("out"))                      # out/vmlinuz, out/initrd.img, out/manifest.json
    parts = prepare_parts()                       # kernel, modules, busybox, bcd: cached
    tree = ramdisk_tree(parts, init=MY_INIT, extra={"/etc/x": b"..."})
    write_cpio(tree, Path("my.img"))              # another initramfs from the same parts
    tree.materialize(Path("rootfs"))              # or the same files as a folder (mkfs.ext4 -d)
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from ..config import DEFAULT_RAMDISK_DIR
from ..core.errors import BcError, ErrorCode
from .ramdisk_init import INIT, NET_UP, UDHCPC_SCRIPT

__all__ = [
    "ALWAYS_MODULES",
    "BUILDER_VERSION",
    "DEFAULT_CMDLINE",
    "DEFAULT_MODULES",
    "DEFAULT_OUT",
    "HARDWARE_MODULES",
    "Entry",
    "RamdiskArtifacts",
    "RamdiskParts",
    "Tree",
    "build",
    "default_cache_dir",
    "prepare_parts",
    "ramdisk_tree",
    "write_cpio",
]

BUILDER_VERSION: Final = "1"
"""Bumped when the builder's own output changes for the same inputs (part of every cache key)."""

DEFAULT_OUT: Final = DEFAULT_RAMDISK_DIR
"""Where ``bcx ramdisk build`` writes and ``bcx dev up`` looks (``[ramdisk] dir``)."""

DEFAULT_CMDLINE: Final = "console=tty0 console=ttyS0,115200n8 quiet"
"""The consoles, and ``quiet``: without it the kernel prints its whole command line, the boot
entry's ``bcd.token=`` included, on the serial console (a BMC's serial-over-LAN)."""
KERNEL_PACKAGE: Final = "linux-image-amd64"
BUSYBOX_PACKAGE: Final = "busybox-static"

HARDWARE_MODULES: Final = (
    # virtual machines
    "virtio_pci", "virtio_blk", "virtio_net", "virtio_scsi", "virtio_rng", "virtio_console",
    # disks and their controllers
    "nvme", "ahci", "ata_piix", "sd_mod", "sr_mod", "megaraid_sas", "mpt3sas", "smartpqi", "hpsa",
    "usb_storage", "uas", "xhci_pci", "ehci_pci", "ohci_pci", "uhci_hcd",
    # NICs of common servers
    "e1000", "e1000e", "igb", "igc", "ixgbe", "i40e", "ice", "bnxt_en", "tg3", "bnx2", "mlx4_en",
    "mlx5_core", "r8169", "vmxnet3", "ena",
    # keyboards on a BMC's console
    "hid_generic", "usbhid",
)  # fmt: skip
"""Drivers put into the ramdisk (with what they depend on); the init loads those the machine's
devices ask for (by modalias), as udev would."""

ALWAYS_MODULES: Final = (
    "isofs", "vfat", "ext4", "nls_cp437", "nls_iso8859_1", "nls_utf8", "crc32c_generic", "sd_mod",
)  # fmt: skip
"""Modules the init loads whatever the hardware: file systems (config drives, ISOs, an OS's)."""

DEFAULT_MODULES: Final = HARDWARE_MODULES + tuple(m for m in ALWAYS_MODULES if m not in HARDWARE_MODULES)
"""Every module put into the ramdisk (with everything it depends on)."""

_CHUNK: Final = 1 << 20
KEEP_BUILDS: Final = 6
"""Initramfs builds and bcd executables the cache keeps (the most recently used)."""


def _bad(message: str, path: str, **details: Any) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path, **details})


def _failed(message: str, **details: Any) -> BcError:
    return BcError(ErrorCode.UNAVAILABLE, message, details)


def default_cache_dir() -> Path:
    """``$BC_RAMDISK_CACHE``, else ``$XDG_CACHE_HOME/better-compute/ramdisk`` (``~/.cache/…``)."""
    given = os.environ.get("BC_RAMDISK_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "better-compute" / "ramdisk"


# -- the tree of files -----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One file system object of the ramdisk, at an absolute ``path``."""

    path: str
    kind: Literal["dir", "file", "symlink", "char", "block"]
    mode: int = 0o755
    data: bytes | None = None
    source: Path | None = None
    target: str | None = None
    rdev: tuple[int, int] = (0, 0)

    def content(self) -> bytes:
        if self.kind == "symlink":
            return (self.target or "").encode()
        if self.data is not None:
            return self.data
        if self.source is not None:
            return self.source.read_bytes()
        return b""


@dataclass
class Tree:
    """The ramdisk's files by path; parents are made as needed."""

    entries: dict[str, Entry] = field(default_factory=dict)

    def _parents(self, path: str) -> None:
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            if parent not in self.entries:
                self.entries[parent] = Entry(parent, "dir", 0o755)

    def add(self, entry: Entry) -> None:
        if not entry.path.startswith("/") or entry.path == "/":
            raise _bad(f"expected an absolute file path, got {entry.path!r}", "path")
        self._parents(entry.path)
        self.entries[entry.path] = entry

    def dir(self, path: str, mode: int = 0o755) -> None:
        self.add(Entry(path, "dir", mode))

    def file(
        self, path: str, *, data: bytes | None = None, source: Path | None = None, mode: int = 0o644
    ) -> None:
        self.add(Entry(path, "file", mode, data=data, source=source))

    def symlink(self, path: str, target: str) -> None:
        self.add(Entry(path, "symlink", 0o777, target=target))

    def device(
        self, path: str, kind: Literal["char", "block"], major: int, minor: int, mode: int = 0o600
    ) -> None:
        self.add(Entry(path, kind, mode, rdev=(major, minor)))

    def copy_dir(self, source: Path, dest: str) -> None:
        """``source``'s files (symlinks kept as links) under ``dest``."""
        for root, dirs, files in os.walk(source):
            rel = os.path.relpath(root, source)
            base = (dest if rel == "." else f"{dest}/{rel}").replace("//", "/").rstrip("/")
            if base:
                self.dir(base)
            for name in sorted(dirs + files):
                full = Path(root) / name
                if full.is_symlink():
                    self.symlink(f"{base}/{name}", os.readlink(full))
                elif full.is_file():
                    self.file(f"{base}/{name}", source=full, mode=stat.S_IMODE(full.stat().st_mode))

    def materialize(self, folder: Path) -> None:
        """Write the tree into ``folder`` (device nodes need root; without it they are left out)."""
        folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.entries):
            entry = self.entries[path]
            target = folder / path.lstrip("/")
            if entry.kind == "dir":
                target.mkdir(parents=True, exist_ok=True)
                target.chmod(entry.mode)
            elif entry.kind == "symlink":
                target.unlink(missing_ok=True)
                target.symlink_to(entry.target or "")
            elif entry.kind == "file":
                target.write_bytes(entry.content())
                target.chmod(entry.mode)
            elif os.geteuid() == 0:
                target.unlink(missing_ok=True)
                kind = stat.S_IFCHR if entry.kind == "char" else stat.S_IFBLK
                os.mknod(target, kind | entry.mode, os.makedev(*entry.rdev))


def write_cpio(tree: Tree, out: Path, *, compress: Literal["zstd", "gzip", "none"] = "zstd") -> None:
    """Write ``tree`` as a cpio archive (newc, as the kernel reads an initramfs), compressed.

    Owners are root, times are 0: the same tree gives the same bytes.
    """
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    raw: Any
    with open(tmp, "wb") as fh:
        if compress == "zstd":
            import zstandard

            cctx = zstandard.ZstdCompressor(level=9, threads=-1)
            raw = cctx.stream_writer(fh, closefd=False)
        elif compress == "gzip":
            raw = gzip.GzipFile(filename="", fileobj=fh, mode="wb", compresslevel=6, mtime=0)
        else:
            raw = fh
        try:
            for ino, path in enumerate(sorted(tree.entries), start=1):
                _cpio_entry(raw, tree.entries[path], ino)
            _cpio_header(raw, "TRAILER!!!", ino=0, mode=0, size=0, nlink=1)
        finally:
            if raw is not fh:
                raw.close()
    tmp.replace(out)


_KIND_BITS: Final = {
    "dir": stat.S_IFDIR,
    "file": stat.S_IFREG,
    "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR,
    "block": stat.S_IFBLK,
}


def _cpio_header(
    out: Any, name: str, *, ino: int, mode: int, size: int, nlink: int, rdev: tuple[int, int] = (0, 0)
) -> None:
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev[0], rdev[1], len(encoded), 0)
    header = b"070701" + b"".join(b"%08x" % f for f in fields)
    out.write(header + encoded + b"\0" * ((4 - (len(header) + len(encoded)) % 4) % 4))


def _cpio_entry(out: Any, entry: Entry, ino: int) -> None:
    data = b"" if entry.kind in ("dir", "char", "block") else entry.content()
    mode = _KIND_BITS[entry.kind] | (entry.mode & 0o7777)
    _cpio_header(
        out,
        entry.path.lstrip("/"),
        ino=ino,
        mode=mode,
        size=len(data),
        nlink=2 if entry.kind == "dir" else 1,
        rdev=entry.rdev,
    )
    out.write(data + b"\0" * ((4 - len(data) % 4) % 4))


# -- packages --------------------------------------------------------------------------------


def _run(argv: list[str], *, cwd: Path | None = None, what: str) -> str:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _failed(f"{what}: {exc}", command=argv[0]) from None
    if done.returncode != 0:
        raise _failed(
            f"{what}: {argv[0]} exited {done.returncode}: {done.stderr.strip()[-600:]}", command=argv[0]
        )
    return done.stdout


def _apt_show(*packages: str) -> dict[str, dict[str, str]]:
    """Each package's candidate version's fields (what ``apt-get download`` fetches), in one
    ``apt-cache`` run."""
    text = _run(
        ["apt-cache", "show", "--no-all-versions", *packages], what=f"apt-cache show {' '.join(packages)}"
    )
    found: dict[str, dict[str, str]] = {}
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in paragraph.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith(" ") and key not in fields:
                fields[key] = value.strip()
        if "Package" in fields and "Version" in fields:
            found.setdefault(fields["Package"], fields)
    for package in packages:
        if package not in found:
            raise _failed(f"apt knows no package {package} (run apt-get update?)", package=package)
    return found


def _versions() -> tuple[str, str, str]:
    """The versioned kernel package the metapackage depends on, its version, busybox's version."""
    shown = _apt_show(KERNEL_PACKAGE, BUSYBOX_PACKAGE)
    meta = shown[KERNEL_PACKAGE]
    match = re.search(r"(linux-image-[0-9][^\s,(]*)\s*(?:\(=\s*([^)]+)\))?", meta.get("Depends", ""))
    if match is None:
        raise _failed(f"{KERNEL_PACKAGE} depends on no linux-image-<version> package", package=KERNEL_PACKAGE)
    package = match.group(1)
    version = match.group(2) or _apt_show(package)[package]["Version"]
    return package, version, shown[BUSYBOX_PACKAGE]["Version"]


def _download(package: str, version: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for deb in folder.glob(f"{package}_*.deb"):
        return deb
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        _run(
            ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", f"{package}={version}"],
            cwd=Path(tmp),
            what=f"apt-get download {package}",
        )
        got = sorted(Path(tmp).glob("*.deb"))
        if not got:
            raise _failed(f"apt-get download {package} wrote no .deb", package=package)
        target = folder / f"{package}_{version.replace(':', '%3a')}.deb"
        got[0].replace(target)
    return target


def _installed_version(package: str) -> str | None:
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


# -- kernel modules --------------------------------------------------------------------------


def _modinfo(ko: Path) -> dict[str, list[str]]:
    """The ``.modinfo`` section of a kernel module (an ELF64 file): ``depends``, ``alias``, …"""
    data = ko.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return {}
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    found: dict[str, list[str]] = {}
    for i in range(shnum):
        name_off, offset, size = section(i)
        end = data.index(b"\0", str_off + name_off)
        if data[str_off + name_off : end] != b".modinfo":
            continue
        for item in data[offset : offset + size].split(b"\0"):
            key, sep, value = item.decode("utf-8", "replace").partition("=")
            if sep:
                found.setdefault(key, []).append(value)
    return found


def _module_name(path: Path) -> str:
    return path.name.split(".ko")[0].replace("-", "_")


@dataclass(frozen=True)
class _Modules:
    files: dict[str, Path]  # name -> .ko, every module the closure needs
    deps: dict[str, list[str]]  # name -> names it depends on
    aliases: dict[str, list[str]]
    missing: list[str]


def _module_closure(tree: Path, wanted: Iterable[str]) -> _Modules:
    """The modules ``wanted`` names and all they depend on (from each module's ``.modinfo``);
    names the kernel builds in or lacks are skipped (``missing`` for the latter)."""
    by_name = {_module_name(p): p for p in (tree / "kernel").rglob("*.ko*")}
    builtin = {_module_name(Path(line)) for line in (tree / "modules.builtin").read_text().split()}
    files: dict[str, Path] = {}
    deps: dict[str, list[str]] = {}
    aliases: dict[str, list[str]] = {}
    missing: list[str] = []
    todo = [w.replace("-", "_") for w in wanted]
    while todo:
        name = todo.pop()
        if name in files or name in builtin:
            continue
        ko = by_name.get(name)
        if ko is None:
            missing.append(name)
            continue
        info = _modinfo(ko)
        files[name] = ko
        deps[name] = [d.replace("-", "_") for v in info.get("depends", []) for d in v.split(",") if d]
        softdeps = " ".join(info.get("softdep", []))
        extra = [w.replace("-", "_") for w in softdeps.replace("pre:", " ").replace("post:", " ").split()]
        aliases[name] = info.get("alias", [])
        todo.extend(deps[name] + [e for e in extra if e in by_name])
    return _Modules(files=files, deps=deps, aliases=aliases, missing=sorted(set(missing)))


def _load_order(mods: _Modules, wanted: list[str]) -> list[str]:
    """``wanted`` and every module they need, each after the ones it needs itself."""
    load: list[str] = []
    seen: set[str] = set()

    def visit(dep: str) -> None:
        if dep in seen or dep not in mods.files:
            return
        seen.add(dep)
        for sub in mods.deps[dep]:
            visit(sub)
        load.append(dep)

    for dep in wanted:
        visit(dep)
    return load


def _modules_dep(mods: _Modules, tree: Path) -> str:
    """``modules.dep`` as modprobe reads it: each module, then every module it needs
    (transitively), listed so that modprobe, loading them from the last to the first, loads each
    after the ones it needs."""

    def rel(name: str) -> str:
        return mods.files[name].relative_to(tree).as_posix()

    lines = []
    for name in sorted(mods.files):
        load = _load_order(mods, mods.deps[name])
        lines.append(f"{rel(name)}: {' '.join(rel(d) for d in reversed(load))}".rstrip())
    return "\n".join(lines) + "\n"


# -- the parts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RamdiskParts:
    """What every image made from these packages is assembled from (cached, read-only)."""

    kernel: Path
    """``vmlinuz``."""
    kernel_release: str
    """``uname -r`` of that kernel: ``6.1.0-57-amd64``."""
    modules: Path
    """``lib/modules/<release>`` holding only the chosen modules, their ``modules.dep`` and
    ``modules.alias``; ``modules.list`` names the ones to load."""
    busybox: Path
    bcd: Path
    """bcd's PyInstaller ``--onedir`` folder (``bcd/bcd`` is the executable)."""
    libs: Path
    """The C libraries bcd links from this machine, under their absolute paths."""
    packages: Mapping[str, str]
    """Debian package -> version of everything inside."""
    key: str
    """A digest of all of the above's inputs."""


def _sources_digest() -> tuple[str, dict[str, str]]:
    """A digest of bcd's and the SDK's sources and of every installed distribution's version."""
    digest = hashlib.sha256()
    folders = []
    for top in ("bcd", "better_compute"):
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            raise BcError(ErrorCode.INVALID_CONFIG, f"cannot find the {top} package to pack", {"path": top})
        # better_compute is a namespace package: one folder per distribution (SDK, runtime, ...)
        folders += sorted(Path(location) for location in spec.submodule_search_locations)
    for folder in folders:
        for file in sorted(folder.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                digest.update(file.relative_to(folder.parent).as_posix().encode() + b"\0")
                digest.update(hashlib.sha256(file.read_bytes()).digest())
    dists = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            dists[name.lower()] = dist.version
    for name in sorted(dists):
        digest.update(f"{name}=={dists[name]}\n".encode())
    return digest.hexdigest(), dists


def _atomic_dir(target: Path, make: Callable[[Path], None]) -> Path:
    """``target``, made by ``make(tmp)`` in a temporary sibling and renamed into place."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _kernel_part(cache: Path, package: str, version: str, modules: tuple[str, ...]) -> Path:
    key = hashlib.sha256(f"{BUILDER_VERSION}:{package}={version}:{','.join(modules)}".encode()).hexdigest()[
        :16
    ]

    def make(tmp: Path) -> None:
        deb = _download(package, version, cache / "debs")
        with tempfile.TemporaryDirectory(dir=cache) as unpack:
            root = Path(unpack)
            _run(["dpkg-deb", "-x", str(deb), str(root)], what=f"dpkg-deb -x {deb.name}")
            vmlinuz = sorted((root / "boot").glob("vmlinuz-*"))
            if not vmlinuz:
                raise _failed(f"{deb.name} holds no /boot/vmlinuz-*", package=package)
            release = vmlinuz[0].name.removeprefix("vmlinuz-")
            tree = root / "lib" / "modules" / release
            mods = _module_closure(tree, modules)
            shutil.copy2(vmlinuz[0], tmp / "vmlinuz")
            out = tmp / "modules" / release
            for ko in mods.files.values():
                dest = out / ko.relative_to(tree)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ko, dest)
            for name in ("modules.builtin", "modules.order", "modules.builtin.modinfo"):
                if (tree / name).exists():
                    shutil.copy2(tree / name, out / name)
            (out / "modules.dep").write_text(_modules_dep(mods, tree))
            alias_lines = [
                f"alias {alias} {name}" for name in sorted(mods.aliases) for alias in mods.aliases[name]
            ]
            (out / "modules.alias").write_text("\n".join(alias_lines) + "\n")
            always = [m for m in ALWAYS_MODULES if m in modules and m not in mods.missing]
            (out / "modules.list").write_text("\n".join(always) + "\n")
            (tmp / "kernel.json").write_text(
                json.dumps({"release": release, "modules": sorted(mods.files), "missing": mods.missing})
            )

    return _atomic_dir(cache / "parts" / f"kernel-{key}", make)


def _busybox_part(cache: Path, version: str) -> Path:
    key = hashlib.sha256(f"{BUILDER_VERSION}:{BUSYBOX_PACKAGE}={version}".encode()).hexdigest()[:16]

    def make(tmp: Path) -> None:
        deb = _download(BUSYBOX_PACKAGE, version, cache / "debs")
        with tempfile.TemporaryDirectory(dir=cache) as unpack:
            _run(["dpkg-deb", "-x", str(deb), unpack], what=f"dpkg-deb -x {deb.name}")
            shutil.copy2(Path(unpack) / "bin" / "busybox", tmp / "busybox")
        listed = _run([str(tmp / "busybox"), "--list"], what="busybox --list")
        (tmp / "applets").write_text(listed)

    return _atomic_dir(cache / "parts" / f"busybox-{key}", make)


_ENTRY: Final = "from bcd.__main__ import main\n\nif __name__ == '__main__':\n    main()\n"
# Pulled in through imports bcd never takes at run time (a backend zstandard does not pick here,
# the build tools): left out to keep the ramdisk small.
_EXCLUDES: Final = (
    "zstandard.backend_cffi",
    "zstandard._cffi",
    "setuptools",
    "pkg_resources",
    "tkinter",
    "pytest",
)


def _bcd_part(cache: Path, sources: str) -> Path:
    key = hashlib.sha256(f"{BUILDER_VERSION}:{sources}:{_EXCLUDES}".encode()).hexdigest()[:16]

    def make(tmp: Path) -> None:
        work = tmp / "work"
        work.mkdir()
        (work / "bcd_entry.py").write_text(_ENTRY)
        argv = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--onedir", "--name", "bcd",
                "--distpath", str(tmp / "dist"), "--workpath", str(work / "build"), "--specpath", str(work),
                "--log-level", "WARN", "--collect-submodules", "bcd", "--collect-data", "bcd",
                "--strip"]  # fmt: skip
        for module in _EXCLUDES:
            argv += ["--exclude-module", module]
        if shutil.which("strip") is None:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "strip is missing (Debian binutils): the packed libraries' symbols go (libpython 23 -> 6 MB)",
                {"path": "strip"},
            )
        if importlib.util.find_spec("PyInstaller") is None:
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "PyInstaller is not installed: pip install 'bcx[ramdisk]' (uv sync --all-extras)",
                {"path": "pyinstaller"},
            )
        _run([*argv, str(work / "bcd_entry.py")], cwd=work, what="PyInstaller (bcd)")
        (tmp / "dist" / "bcd").rename(tmp / "bcd")
        shutil.rmtree(tmp / "dist")
        shutil.rmtree(work)
        libs = tmp / "libs"
        for lib in _system_libs(tmp / "bcd"):
            dest = libs / lib.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), dest)

    return _atomic_dir(cache / "parts" / f"bcd-{key}", make)


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def _system_libs(bundle: Path) -> list[str]:
    """The libraries outside ``bundle`` its programs and extensions load (glibc's, mostly)."""
    found: set[str] = set()
    # what the bundle brings itself (libssl, libpython…) its extension modules find there
    bundled = {f.name for f in bundle.rglob("*.so*")}
    for file in bundle.rglob("*"):
        if not file.is_file() or file.is_symlink() or not _is_elf(file):
            continue
        done = subprocess.run(["ldd", str(file)], capture_output=True, text=True, check=False)
        for line in done.stdout.splitlines():
            match = re.search(r"(/\S+)\s+\(0x", line)
            lib = match.group(1) if match else None
            if lib is None or lib.startswith(str(bundle)):
                continue
            # the executable loads before PyInstaller points the loader at the bundle: it gets
            # every library from here; extension modules load later and find the bundle's own
            if file.parent == bundle or Path(lib).name not in bundled:
                found.add(lib)
    return sorted(found)


def prepare_parts(
    *,
    cache_dir: Path | None = None,
    modules: Iterable[str] = DEFAULT_MODULES,
    say: Callable[[str], None] = lambda _m: None,
) -> RamdiskParts:
    """The kernel, its chosen modules, busybox and bcd: from the cache, or fetched and built.

    Raises:
        BcError: ``UNAVAILABLE`` when apt, dpkg-deb or PyInstaller fail (their message in it),
            ``INVALID_CONFIG`` when PyInstaller or bcd is not installed.
    """
    cache = (cache_dir or default_cache_dir()).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    wanted = tuple(dict.fromkeys(modules))
    kernel_pkg, kernel_version, busybox_version = _versions()
    sources, dists = _sources_digest()
    t0 = time.monotonic()
    kernel = _kernel_part(cache, kernel_pkg, kernel_version, wanted)
    say(f"kernel    {kernel_pkg} {kernel_version} ({time.monotonic() - t0:.1f}s)")
    t0 = time.monotonic()
    busybox = _busybox_part(cache, busybox_version)
    say(f"busybox   {BUSYBOX_PACKAGE} {busybox_version} ({time.monotonic() - t0:.1f}s)")
    t0 = time.monotonic()
    bcd = _bcd_part(cache, sources)
    say(f"bcd       PyInstaller {dists.get('pyinstaller', '?')} ({time.monotonic() - t0:.1f}s)")
    info = json.loads((kernel / "kernel.json").read_text())
    packages = {
        KERNEL_PACKAGE: kernel_version,
        kernel_pkg: kernel_version,
        BUSYBOX_PACKAGE: busybox_version,
        "libc6": _installed_version("libc6") or "unknown",
    }
    key = hashlib.sha256(f"{kernel.name}:{busybox.name}:{bcd.name}".encode()).hexdigest()
    return RamdiskParts(
        kernel=kernel / "vmlinuz",
        kernel_release=str(info["release"]),
        modules=kernel / "modules" / str(info["release"]),
        busybox=busybox / "busybox",
        bcd=bcd / "bcd",
        libs=bcd / "libs",
        packages=packages,
        key=key,
    )


def ramdisk_tree(
    parts: RamdiskParts,
    *,
    init: str = INIT,
    extra: Mapping[str, bytes | Path] | None = None,
    release: str = "bc-ramdisk",
) -> Tree:
    """The ramdisk's files: busybox (every applet a link), the modules, bcd under ``/opt/bcd``
    (``/usr/bin/bcd`` runs it), the C libraries it needs, ``/init`` and ``extra`` (path ->
    content or a file to copy), which may replace any of them."""
    tree = Tree()
    for folder in ("/proc", "/sys", "/dev", "/run", "/tmp", "/root", "/var/lib/bcd", "/etc/bcd", "/mnt"):
        tree.dir(folder, 0o1777 if folder == "/tmp" else 0o755)
    tree.device("/dev/console", "char", 5, 1)
    tree.device("/dev/null", "char", 1, 3, 0o666)
    tree.file("/bin/busybox", source=parts.busybox, mode=0o755)
    for applet in (parts.busybox.parent / "applets").read_text().split():
        if applet != "busybox":
            tree.symlink(f"/bin/{applet}", "busybox")
    tree.symlink("/sbin", "bin")
    tree.symlink("/usr/bin", "../bin")
    tree.symlink("/usr/sbin", "../bin")
    tree.copy_dir(parts.modules, f"/lib/modules/{parts.kernel_release}")
    tree.copy_dir(parts.bcd, "/opt/bcd")
    tree.copy_dir(parts.libs, "/")
    tree.file("/bin/bcd", data=b'#!/bin/sh\nexec /opt/bcd/bcd "$@"\n', mode=0o755)
    tree.file("/init", data=init.encode(), mode=0o755)
    tree.file("/etc/bc-ramdisk/net-up", data=NET_UP.encode(), mode=0o755)
    tree.file("/etc/bc-ramdisk/modules", source=parts.modules / "modules.list")
    tree.file("/etc/bc-ramdisk/release", data=f"{release} {parts.key[:12]}\n".encode())
    tree.file("/etc/udhcpc/default.script", data=UDHCPC_SCRIPT.encode(), mode=0o755)
    tree.file("/etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n")
    tree.file("/etc/group", data=b"root:x:0:\n")
    tree.file("/etc/hostname", data=b"")
    tree.file("/etc/resolv.conf", data=b"")
    for path, content in (extra or {}).items():
        if isinstance(content, Path):
            tree.file(path, source=content, mode=stat.S_IMODE(content.stat().st_mode))
        else:
            tree.file(path, data=content, mode=0o755 if content.startswith(b"#!") else 0o644)
    return tree


@dataclass(frozen=True)
class RamdiskArtifacts:
    """What ``build`` wrote."""

    kernel: Path
    initrd: Path
    manifest: Path

    def read_manifest(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.manifest.read_text())
        return loaded


def _file_doc(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return {"file": path.name, "sha256": digest.hexdigest(), "size": path.stat().st_size}


def build(
    out_dir: Path,
    *,
    cache_dir: Path | None = None,
    init: str = INIT,
    extra: Mapping[str, bytes | Path] | None = None,
    modules: Iterable[str] = DEFAULT_MODULES,
    compress: Literal["zstd", "gzip"] = "zstd",
    say: Callable[[str], None] = lambda _m: None,
) -> RamdiskArtifacts:
    """Build the ramdisk into ``out_dir``: ``vmlinuz``, ``initrd.img`` and ``manifest.json``
    (each file's sha256 and size, the Debian packages and versions inside, bcd's size, the
    modules). A build with the same inputs is copied from the cache.

    ``init`` and ``extra`` make another initramfs from the same parts (the test OS image).

    Raises:
        BcError: as ``prepare_parts``; ``INVALID_INPUT`` at ``out`` when it cannot be written.
    """
    started = time.monotonic()
    cache = (cache_dir or default_cache_dir()).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "a+b") as lock:
        # one builder at a time per cache: a second (another test worker) waits, then copies
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(out_dir, cache, init, extra, modules, compress, say, started)


def _build_locked(
    out_dir: Path,
    cache: Path,
    init: str,
    extra: Mapping[str, bytes | Path] | None,
    modules: Iterable[str],
    compress: Literal["zstd", "gzip"],
    say: Callable[[str], None],
    started: float,
) -> RamdiskArtifacts:
    modules = tuple(modules)
    parts = prepare_parts(cache_dir=cache, modules=modules, say=say)
    digest = hashlib.sha256(f"{parts.key}:{compress}:{init}".encode())
    for path in sorted(extra or {}):
        content = (extra or {})[path]
        digest.update(path.encode() + b"\0")
        digest.update(hashlib.sha256(content.read_bytes() if isinstance(content, Path) else content).digest())
    key = digest.hexdigest()[:24]

    def make(tmp: Path) -> None:
        t0 = time.monotonic()
        tree = ramdisk_tree(parts, init=init, extra=extra)
        write_cpio(tree, tmp / "initrd.img", compress=compress)
        shutil.copy2(parts.kernel, tmp / "vmlinuz")
        kernel_info = json.loads((parts.kernel.parent / "kernel.json").read_text())
        manifest = {
            "kind": "bc-ramdisk",
            "key": key,
            "builtAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "kernel": _file_doc(tmp / "vmlinuz"),
            "initrd": {**_file_doc(tmp / "initrd.img"), "compression": compress},
            "kernelRelease": parts.kernel_release,
            "cmdline": DEFAULT_CMDLINE,
            "packages": dict(parts.packages),
            "python": {
                "version": ".".join(map(str, sys.version_info[:3])),
                "pyinstaller": _dist_version("pyinstaller"),
            },
            "bcd": {"path": "/opt/bcd/bcd", "bytes": _tree_size(parts.bcd),
                    "libsBytes": _tree_size(parts.libs)},
            "modules": {"alwaysLoaded": [m for m in ALWAYS_MODULES if m not in kernel_info["missing"]],
                        "included": kernel_info["modules"], "notInKernel": kernel_info["missing"]},
            "buildSeconds": round(time.monotonic() - t0, 1),
        }  # fmt: skip
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    t0 = time.monotonic()
    built = _atomic_dir(cache / "builds" / key, make)
    say(f"initramfs {key} ({time.monotonic() - t0:.1f}s)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("vmlinuz", "initrd.img", "manifest.json"):
            tmp = out_dir / f".{name}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            try:
                os.link(built / name, tmp)  # the cache never changes a built file: share it
            except OSError:
                shutil.copyfile(built / name, tmp)
            tmp.replace(out_dir / name)
    except OSError as exc:
        raise _bad(f"cannot write {out_dir}: {exc.strerror or exc}", "out") from None
    _prune(cache / "builds", keep=KEEP_BUILDS, used=built)
    _prune(cache / "parts", keep=KEEP_BUILDS, used=parts.bcd.parent, prefix="bcd-")
    say(f"done in {time.monotonic() - started:.1f}s: {out_dir}")
    return RamdiskArtifacts(
        kernel=out_dir / "vmlinuz", initrd=out_dir / "initrd.img", manifest=out_dir / "manifest.json"
    )


def _prune(folder: Path, *, keep: int, used: Path, prefix: str = "") -> None:
    """Keep the ``keep`` most recently used entries of ``folder`` (``used`` is one now): every
    change to bcd's sources makes a new 100 MB bcd and a new initramfs."""
    now = time.time()
    os.utime(used, (now, now))
    entries = [
        e for e in folder.iterdir() if e.is_dir() and e.name.startswith(prefix) and not e.name.startswith(".")
    ]
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tree_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
