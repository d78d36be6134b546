"""Network boot: the iPXE entry per MAC that commands install, and the scripts served for it.

A machine's iPXE (its NIC ROM, or chain-loaded) fetches ``/boot.ipxe``, which chains to
``/boot/mac/${net0/mac:hexhyp}``. That answers the MAC's entry (kernel, initrd, command line, or
a whole script); an entry marked one-time is consumed by the answer that serves it (durably,
before the answer leaves). An unknown MAC gets the discovery ramdisk when discovery is on for
the site, and otherwise a script that exits to the next (local) boot device.

A one-time entry that carries a node's join token is the node's identity on an unauthenticated
network: whoever asks first gets it. So serving it also takes the node's other entries (the same
token, its other MACs) and leaves a *served* mark per MAC for ``SERVED_WINDOW_S``; a MAC asked
for again while marked gets nothing (``ALREADY_SERVED_SCRIPT``) and the agent reports the token
to bc-pki, which burns it and what it issued, and the engine quarantines the node: a stolen
token is a detected denial, never a silent identity (issue 23, H1; docs/site-agent.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.files import atomic_write
from better_compute.logging import get_logger, register_secret

__all__ = [
    "ALREADY_SERVED_SCRIPT",
    "IPXE_UNSAFE",
    "LOCAL_BOOT_SCRIPT",
    "SERVED_WINDOW_S",
    "BootEntries",
    "BootEntry",
    "Served",
    "discovery_cmdline",
    "discovery_script",
    "entry_script",
    "first_stage",
    "normalize_mac",
]

_MAC_RE = re.compile(r"^[0-9a-f]{2}([:-][0-9a-f]{2}){5}$")

LOCAL_BOOT_SCRIPT = (
    "#!ipxe\necho bc-site-agent: no boot entry for this machine: booting from local disk\nexit\n"
)

ALREADY_SERVED_SCRIPT = (
    "#!ipxe\necho bc-site-agent: this machine's boot entry was already served to someone:"
    " the node is quarantined, an operator looks\nexit\n"
)
SERVED_WINDOW_S = 600.0
"""How long a served node entry's MACs stay marked: a power-cycled machine asks for its script
within minutes (its POST). A later network boot of the MAC without a new entry (a machine that
boots from the network first, long after its ramdisk) is an ordinary unknown MAC again."""


def normalize_mac(mac: str, *, path: str = "mac") -> str:
    low = mac.strip().lower()
    if not _MAC_RE.match(low):
        raise BcError(
            ErrorCode.INVALID_INPUT, "expected a MAC address like 52:54:00:12:34:56", {"path": path}
        )
    return low.replace("-", ":")


@dataclass(frozen=True, kw_only=True)
class BootEntry:
    mac: str
    kernel: str | None = None
    initrd: str | None = None
    cmdline: str = ""
    script: str | None = None
    one_time: bool = True
    command_id: str = ""
    join_token: str | None = field(default=None, repr=False)
    """The ramdisk's join token (resolved from the command's ``joinTokenRef``), served as
    ``bcd.token=`` on the kernel line; kept in the 0600 entry file until the entry is served."""


# What iPXE's script language acts on inside a line: ``${…}`` expands a setting, ``||``, ``&&``
# and a ``;`` word chain commands, a ``#`` word starts a comment; control characters (a line
# break above all) end the line or drive the console. None of it belongs in a URL or a kernel
# command line, so a value holding any is refused, never escaped (iPXE has no quoting).
IPXE_UNSAFE: Final = re.compile(r"\$\{|\|\||&&|(?:^|\s)[;#]|[\x00-\x1f\x7f]")
_NO_ENTRY_SCRIPT: Final = (
    "#!ipxe\necho bc-site-agent: the boot entry for this machine cannot be served: booting from"
    " local disk\nexit\n"
)


def _ipxe_safe(text: str, path: str) -> str:
    """``text`` for a line of an iPXE script; ``INVALID_INPUT`` at ``path`` when it holds
    anything iPXE would run, expand or cut (``IPXE_UNSAFE``)."""
    if IPXE_UNSAFE.search(text):
        raise BcError(
            ErrorCode.INVALID_INPUT,
            "no line breaks, control characters, '${', '||', '&&' or a word starting with ';' or '#'"
            " (iPXE would act on them)",
            {"path": path},
        )
    return text


def _ipxe_url(text: str, path: str) -> str:
    if any(c.isspace() for c in text):  # a space would end the URL and start a kernel argument
        raise BcError(ErrorCode.INVALID_INPUT, "a URL holds no whitespace", {"path": path})
    return _ipxe_safe(text, path)


def entry_script(entry: BootEntry, *, extra: str = "") -> str:
    """The iPXE script of ``entry``; ``extra`` goes on its kernel line after the entry's own
    words (the site agent's ``bcd.bus=`` and ``bcd.bus_ca_sha256=``, ``bus_cmdline``)."""
    if entry.script is not None:
        script = entry.script
        return script if script.startswith("#!ipxe") else "#!ipxe\n" + script
    lines = ["#!ipxe"]
    try:
        lines.append(f"echo bc-site-agent: boot entry for {_ipxe_url(entry.mac, 'mac')}")
        # checked again here: an entry file an older agent wrote, or a join token, was not
        if entry.kernel:
            cmdline = _ipxe_safe(entry.cmdline, "cmdline")
            if entry.join_token is not None:
                cmdline = f"{cmdline} bcd.token={_ipxe_url(entry.join_token, 'joinToken')}"
            if extra:
                cmdline = f"{cmdline} {_ipxe_safe(extra, 'extra')}"
            lines.append(f"kernel {_ipxe_url(entry.kernel, 'kernel')} {cmdline.strip()}".rstrip())
        if entry.initrd:
            lines.append(f"initrd {_ipxe_url(entry.initrd, 'initrd')}")
    except BcError as err:
        get_logger(component="netboot").warning("netboot_entry_unsafe", mac=entry.mac[:32], path=err.path)
        return _NO_ENTRY_SCRIPT
    lines.append("boot")
    return "\n".join(lines) + "\n"


def bus_cmdline(public_url: str, ca_pem: bytes | None) -> str:
    """What a machine's bcd needs to reach the site's TLS-only leaf node: where this agent serves
    the bus files (``bcd.bus=``) and the SHA-256 of the bus CA it will find there, which bcd
    checks (``bcd.bus_ca_sha256=``). Empty when the agent has no bus CA (a bus without TLS)."""
    if not ca_pem:
        return ""
    return f"bcd.bus={public_url}/bus bcd.bus_ca_sha256={hashlib.sha256(ca_pem).hexdigest()}"


def first_stage() -> str:
    return "#!ipxe\nchain --autofree boot/mac/${net0/mac:hexhyp}\n"


def discovery_script(kernel: str | None, initrd: str | None, cmdline: str) -> str:
    if not kernel:
        return LOCAL_BOOT_SCRIPT
    return entry_script(BootEntry(mac="discovery", kernel=kernel, initrd=initrd, cmdline=cmdline))


def discovery_cmdline(base: str, *, site_id: str, token_file: Path | None, control_plane: str | None) -> str:
    """The discovery ramdisk's kernel command line: the configured one, then what its bcd joins
    with: ``bcd.site=`` (this agent's site, so a token of another site is refused),
    ``bcd.token=`` (the site's discovery token, read from its file at each boot so a new one
    needs no restart) and ``bcd.control_plane=``. A token file that cannot be read or holds no
    token adds no token (bcd then has nothing to join with) and is logged without its content."""
    words = [base.strip(), f"bcd.site={site_id}"]
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError:
            token = ""
        if token and not any(c.isspace() for c in token) and not IPXE_UNSAFE.search(token):
            register_secret(token)
            words.append(f"bcd.token={token}")
    if control_plane:
        words.append(f"bcd.control_plane={control_plane}")
    return _ipxe_safe(" ".join(w for w in words if w), "netboot.discovery_cmdline")


@dataclass(frozen=True)
class Served:
    """What ``BootEntries.take`` found: the entry to serve, or the served mark of a MAC whose
    one-time node entry was already served (``again``), or neither (an unknown MAC)."""

    entry: BootEntry | None
    again: dict[str, Any] | None


class BootEntries:
    """Entries on disk, one JSON file per MAC under ``folder`` (they survive restarts)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()

    def _file(self, mac: str) -> Path:
        return self.folder / (mac.replace(":", "-") + ".json")

    def _served_file(self, mac: str) -> Path:
        return self.folder / (mac.replace(":", "-") + ".served")

    def set(
        self, payload: dict[str, Any], *, command_id: str = "", join_token: str | None = None
    ) -> BootEntry:
        """Install the entry of ``payload`` (a ``netboot.setEntry``) with the join token its
        ``joinTokenRef`` resolved to, if any."""
        mac = normalize_mac(str(payload.get("mac", "")))
        entry = BootEntry(
            mac=mac,
            kernel=_opt(payload, "kernel"),
            initrd=_opt(payload, "initrd"),
            cmdline=_ipxe_safe(str(payload.get("cmdline") or ""), "cmdline"),
            script=payload.get("script"),
            one_time=bool(payload.get("oneTime", True)),
            command_id=command_id,
            join_token=join_token,
        )
        if entry.script is None and entry.kernel is None:
            raise BcError(ErrorCode.INVALID_INPUT, "give kernel (and initrd) or script", {"path": "kernel"})
        doc = {
            "mac": entry.mac,
            "kernel": entry.kernel,
            "initrd": entry.initrd,
            "cmdline": entry.cmdline,
            "script": entry.script,
            "oneTime": entry.one_time,
            "commandId": command_id,
            "joinToken": join_token,
        }
        with self._lock:
            self._write(self._file(mac), doc)
            self._served_file(mac).unlink(missing_ok=True)  # a new entry: a new boot, a new token
        return entry

    @staticmethod
    def _write(target: Path, doc: dict[str, Any]) -> None:
        atomic_write(target, json.dumps(doc))

    def get(self, mac: str) -> BootEntry | None:
        try:
            doc = json.loads(self._file(normalize_mac(mac)).read_text())
        except (OSError, ValueError):
            return None
        return BootEntry(
            mac=doc["mac"],
            kernel=doc.get("kernel"),
            initrd=doc.get("initrd"),
            cmdline=doc.get("cmdline") or "",
            script=doc.get("script"),
            one_time=bool(doc.get("oneTime", True)),
            command_id=doc.get("commandId") or "",
            join_token=_registered(doc.get("joinToken")),
        )

    def take(self, mac: str, *, now: float | None = None) -> Served:
        """What to serve ``mac`` now (see the module). A one-time entry is removed (durably)
        before it is served; one with a join token takes the node's other entries with it and
        marks every MAC of them served."""
        now = time.time() if now is None else now
        with self._lock:
            entry = self.get(mac)
            if entry is None:
                return Served(entry=None, again=self._served(mac, now))
            if entry.one_time:
                taken = [entry]
                if entry.join_token is not None:
                    token = entry.join_token
                    taken += [e for e in self._all() if e.mac != entry.mac and e.join_token == token]
                    digest = hashlib.sha256(entry.join_token.encode()).hexdigest()
                    for e in taken:
                        mark = {"mac": e.mac, "tokenSha256": digest, "servedAt": now, "servedMac": entry.mac}
                        self._write(self._served_file(e.mac), mark)
                for e in taken:
                    self._file(e.mac).unlink(missing_ok=True)
                fd = os.open(self.folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return Served(entry=entry, again=None)

    def _all(self) -> list[BootEntry]:
        found = (self.get(p.stem.replace("-", ":")) for p in sorted(self.folder.glob("*.json")))
        return [e for e in found if e is not None]

    def _served(self, mac: str, now: float) -> dict[str, Any] | None:
        """The served mark of ``mac`` while it is within its window (an older one is removed)."""
        path = self._served_file(normalize_mac(mac))
        try:
            mark = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(mark, dict) or now - float(mark.get("servedAt", 0)) > SERVED_WINDOW_S:
            path.unlink(missing_ok=True)
            return None
        return mark

    def clear(self, mac: str) -> bool:
        mac = normalize_mac(mac)
        target = self._file(mac)
        with self._lock:
            existed = target.exists()
            target.unlink(missing_ok=True)
            self._served_file(mac).unlink(missing_ok=True)
        return existed


def _registered(token: str | None) -> str | None:
    if token:
        register_secret(token)  # read back after a restart: still kept out of every log
    return token or None


def _opt(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    return _ipxe_url(str(value), key) if value else None
