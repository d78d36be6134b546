"""Network boot: the iPXE entry per MAC that commands install, and the scripts served for it.

A machine's iPXE (its NIC ROM, or chain-loaded) fetches ``/boot.ipxe``, which chains to
``/boot/mac/${net0/mac:hexhyp}``. That answers the MAC's entry (kernel, initrd, command line, or
a whole script); an entry marked one-time is consumed by the answer that serves it (durably,
before the answer leaves). An unknown MAC gets the discovery ramdisk when discovery is on for
the site, and otherwise a script that exits to the next (local) boot device.

A one-time entry that carries a node's join token is the node's identity on an unauthenticated
network: whoever asks first gets it. So serving it also takes the node's other entries (the same
token, its other MACs), leaves a *served* mark per MAC for ``SERVED_WINDOW_S`` and opens a
*hold* on the token (``Hold``): bc-pki holds every certificate a join with that token gets
``pending`` until this agent reports the entry closed clean (``tokens.confirm``). It is clean
once the quiet period (``netboot.quiet_seconds``) has passed after the later of the last serve
and this agent's power-on of the node, with no ask from another address. An ask for a marked
MAC from the address the entry went to is the machine booting again before its ramdisk ran
(a NIC ROM that retried, a reset during POST): it gets the same entry again while the hold is
open, and after the hold closed clean the local boot script when this agent has powered the
node on since (the machine booting again, e.g. a power cycle after commission). Any other ask for
a marked MAC gets nothing (``ALREADY_SERVED_SCRIPT``) and the agent
reports the token to bc-pki (``tokens.burn``), which revokes it and what it issued, and the
engine quarantines the node: a thief who asked first never holds a valid certificate, and one
who asked second is a detected denial (issue 23, H1; docs/site-agent.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.files import atomic_write
from better_compute.logging import get_logger, register_secret

__all__ = [
    "ALREADY_SERVED_SCRIPT",
    "DEFAULT_QUIET_SECONDS",
    "IPXE_UNSAFE",
    "LOCAL_BOOT_SCRIPT",
    "SERVED_WINDOW_S",
    "BootEntries",
    "BootEntry",
    "Hold",
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
DEFAULT_QUIET_SECONDS = 120.0
"""How long after a node entry's last serve (or the agent's power-on of the node, if later) no
other address may ask for it before the entry is closed clean (``netboot.quiet_seconds``). It
must exceed the time a machine takes from power-on to its iPXE's ask (its POST): a thief who
asks first is caught only by the machine's own ask within it."""


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
    node_id: str = ""
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
    one-time node entry was already served to someone else (``again``), or neither (an unknown
    MAC)."""

    entry: BootEntry | None
    again: dict[str, Any] | None
    local: bool = False
    """The machine booting again after its entry closed clean, because this agent powered it on
    since: it gets the local boot script, and nothing is burned."""


@dataclass(frozen=True, kw_only=True)
class Hold:
    """A served node entry's token while the agent watches its boot network: ``open`` until its
    quiet period passed (``clean``, reported with ``tokens.confirm``), another address asked
    (``burned``, reported with ``tokens.burn``) or ``netboot.clearEntry`` withdrew it
    (``withdrawn``: never confirmed)."""

    token_sha256: str
    node_id: str
    mac: str
    """The MAC it was first served for."""
    served_from: str
    served_at: float
    last_served_at: float
    powered_at: float = 0.0
    state: str = "open"
    powered_after_close: float = 0.0
    """When this agent powered the node on after the hold closed clean (0: it did not)."""

    def quiet_from(self) -> float:
        return max(self.last_served_at, self.powered_at)


class BootEntries:
    """Entries on disk, one JSON file per MAC under ``folder`` (they survive restarts)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._hold_cache: dict[str, Hold] | None = None
        """The hold files as read once (then kept with every write): the quiet-period look runs
        every second, and read every file each time (a site's machines served in the last ten
        minutes), a thousand at a site cost a fifth of a core doing nothing."""
        self._entry_cache: dict[str, BootEntry] | None = None
        self._mark_cache: dict[str, dict[str, Any]] | None = None
        """The entry files and the served marks, by MAC, as read once and then kept with every
        write, as the holds are: this object is the folder's only writer. A join-token entry's
        take looked for the node's other entries in every entry file, and each close or
        withdrawal rewrote the marks found in every served file; with a hundred machines of a
        site in flight, a third of the site agent's busy samples (py-spy, bench_fleet at 1,000)."""

    def _file(self, mac: str) -> Path:
        return self.folder / (mac.replace(":", "-") + ".json")

    def _served_file(self, mac: str) -> Path:
        return self.folder / (mac.replace(":", "-") + ".served")

    def _hold_file(self, digest: str) -> Path:
        return self.folder / (digest + ".hold")

    def set(
        self,
        payload: dict[str, Any],
        *,
        command_id: str = "",
        join_token: str | None = None,
        node_id: str = "",
    ) -> BootEntry:
        """Install the entry of ``payload`` (a ``netboot.setEntry``) with the join token its
        ``joinTokenRef`` resolved to, if any, for ``node_id`` (the command's node)."""
        mac = normalize_mac(str(payload.get("mac", "")))
        entry = BootEntry(
            mac=mac,
            kernel=_opt(payload, "kernel"),
            initrd=_opt(payload, "initrd"),
            cmdline=_ipxe_safe(str(payload.get("cmdline") or ""), "cmdline"),
            script=payload.get("script"),
            one_time=bool(payload.get("oneTime", True)),
            command_id=command_id,
            node_id=node_id,
            join_token=join_token,
        )
        if entry.script is None and entry.kernel is None:
            raise BcError(ErrorCode.INVALID_INPUT, "give kernel (and initrd) or script", {"path": "kernel"})
        with self._lock:
            cached = self._entries()
            self._write(self._file(mac), _doc(entry))
            cached[mac] = entry
            self._drop_mark(mac)  # a new entry: a new boot, a new token
        return entry

    @staticmethod
    def _write(target: Path, doc: dict[str, Any], *, sync_folder: bool = True) -> None:
        atomic_write(target, json.dumps(doc), sync_folder=sync_folder)

    def get(self, mac: str) -> BootEntry | None:
        return self._entries().get(normalize_mac(mac))

    def _entries(self) -> dict[str, BootEntry]:
        if self._entry_cache is None:
            found: dict[str, BootEntry] = {}
            for path in sorted(self.folder.glob("*.json")):
                try:
                    entry = _entry(json.loads(path.read_text()))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                found[entry.mac] = entry
            self._entry_cache = found
        return self._entry_cache

    def _marks(self) -> dict[str, dict[str, Any]]:
        if self._mark_cache is None:
            found: dict[str, dict[str, Any]] = {}
            for path in self.folder.glob("*.served"):
                try:
                    mark = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(mark, dict):
                    found[path.stem.replace("-", ":")] = mark
            self._mark_cache = found
        return self._mark_cache

    def _put_mark(self, mac: str, mark: dict[str, Any], *, sync_folder: bool = True) -> None:
        marks = self._marks()  # read before the write: the cache's first load reads every file
        self._write(self._served_file(mac), mark, sync_folder=sync_folder)
        marks[mac] = mark

    def _drop_mark(self, mac: str) -> None:
        self._served_file(mac).unlink(missing_ok=True)
        self._marks().pop(mac, None)

    def take(self, mac: str, *, source: str = "", now: float | None = None) -> Served:
        """What to serve ``mac``, asked from address ``source``, now (see the module). A one-time
        entry is removed (durably) before it is served; one with a join token takes the node's
        other entries with it, marks every MAC of them served and opens the token's hold."""
        now = time.time() if now is None else now
        with self._lock:
            entry = self.get(mac)
            if entry is None:
                mark = self._served(mac, now)
                if mark is None:
                    return Served(entry=None, again=None)
                hold = self._hold(str(mark.get("tokenSha256") or ""))
                kept = mark.get("entry")
                if hold is not None and hold.state == "open" and source == hold.served_from and kept:
                    # the machine again (its iPXE retried, or it was reset before its ramdisk ran)
                    self._put_hold(replace(hold, last_served_at=now))
                    return Served(entry=_entry(kept), again=None)
                if (
                    hold is not None and hold.state == "clean" and source == hold.served_from
                    and hold.powered_after_close
                ):  # fmt: skip
                    # the machine booting again because this agent powered it on after its entry
                    # closed clean (a power cycle after commission, its wiped disk falling to
                    # PXE): not a second ask. Without that power-on, a late ask from its address
                    # may be the machine whose POST outlasted the quiet period while a thief on
                    # its address took the entry: that one still burns.
                    return Served(entry=None, again=None, local=True)
                if hold is not None and hold.state != "burned":
                    self._put_hold(replace(hold, state="burned"))
                    self._scrub(hold.token_sha256)
                return Served(entry=None, again={k: v for k, v in mark.items() if k != "entry"})
            if entry.one_time:
                taken = [entry]
                if entry.join_token is not None:
                    token = entry.join_token
                    taken += [e for e in self._all() if e.mac != entry.mac and e.join_token == token]
                    digest = hashlib.sha256(entry.join_token.encode()).hexdigest()
                    for e in taken:
                        mark = {
                            "mac": e.mac, "tokenSha256": digest, "servedAt": now, "servedMac": entry.mac,
                            "entry": _doc(e),
                        }  # fmt: skip
                        # the folder is synced once below, before anything is served
                        self._put_mark(e.mac, mark, sync_folder=False)
                    self._put_hold(
                        Hold(
                            token_sha256=digest, node_id=entry.node_id, mac=entry.mac, served_from=source,
                            served_at=now, last_served_at=now,
                        )
                    )  # fmt: skip
                for e in taken:
                    self._file(e.mac).unlink(missing_ok=True)
                    self._entries().pop(e.mac, None)
                self._sync()
            return Served(entry=entry, again=None)

    def powered(self, node_id: str, *, now: float | None = None) -> None:
        """This agent powered ``node_id`` on (or cycled it): an open hold of its entry counts its
        quiet period from now (the machine asks after its POST, not before); a hold closed clean
        remembers it, so that the machine's ask from its address after this power-on is the
        machine booting again (``Served.local``), not a second ask."""
        if not node_id:
            return
        now = time.time() if now is None else now
        with self._lock:
            for hold in [h for h in self._loaded().values() if h.node_id == node_id]:
                if hold.state == "open":
                    self._put_hold(replace(hold, powered_at=max(hold.powered_at, now)))
                elif hold.state == "clean" and not hold.powered_after_close:
                    # once is what counts (``take`` asks whether it was powered on since): each
                    # power command rewrote every clean hold of the node, a file and two fsyncs
                    self._put_hold(replace(hold, powered_after_close=now))

    def closed_clean(self, quiet_seconds: float, *, now: float | None = None) -> list[Hold]:
        """Open holds whose quiet period has passed: each is closed ``clean`` here (its token
        leaves the marks) and returned, for the agent to confirm to bc-pki."""
        now = time.time() if now is None else now
        done: list[Hold] = []
        with self._lock:
            for hold in self._holds():
                if hold.state == "open" and now >= hold.quiet_from() + quiet_seconds:
                    clean = replace(hold, state="clean")
                    self._put_hold(clean)
                    self._scrub(hold.token_sha256)
                    done.append(clean)
                elif now - hold.served_at > SERVED_WINDOW_S and hold.state != "open":
                    self._drop_hold(hold.token_sha256)
            for mac, mark in list(self._marks().items()):
                if now - _served_at(mark) > SERVED_WINDOW_S:
                    self._drop_mark(mac)  # its window is over: as reading it would
        return done

    def _holds(self) -> list[Hold]:
        return [hold for _, hold in sorted(self._loaded().items())]

    def _loaded(self) -> dict[str, Hold]:
        if self._hold_cache is None:
            found = {}
            for path in self.folder.glob("*.hold"):
                hold = self._read_hold(path.stem)
                if hold is not None:
                    found[path.stem] = hold
            self._hold_cache = found
        return self._hold_cache

    def _hold(self, digest: str) -> Hold | None:
        return self._loaded().get(digest)

    def _read_hold(self, digest: str) -> Hold | None:
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        try:
            doc = json.loads(self._hold_file(digest).read_text())
            return Hold(**doc)
        except (OSError, ValueError, TypeError):
            return None

    def _put_hold(self, hold: Hold) -> None:
        holds = self._loaded()  # read before the write: the cache's first load reads every file
        self._write(self._hold_file(hold.token_sha256), asdict(hold))
        holds[hold.token_sha256] = hold

    def _drop_hold(self, digest: str) -> None:
        self._hold_file(digest).unlink(missing_ok=True)
        self._loaded().pop(digest, None)

    def _scrub(self, digest: str) -> None:
        """The token leaves the served marks of ``digest``: nothing serves it again."""
        for mac, mark in list(self._marks().items()):
            if mark.get("tokenSha256") == digest and "entry" in mark:
                self._put_mark(mac, {k: v for k, v in mark.items() if k != "entry"})

    def _sync(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _all(self) -> list[BootEntry]:
        return [entry for _, entry in sorted(self._entries().items())]

    def _served(self, mac: str, now: float) -> dict[str, Any] | None:
        """The served mark of ``mac`` while it is within its window (an older one is removed)."""
        mac = normalize_mac(mac)
        mark = self._marks().get(mac)
        if mark is None:
            return None
        if now - _served_at(mark) > SERVED_WINDOW_S:
            self._drop_mark(mac)
            return None
        return mark

    def clear(self, mac: str) -> bool:
        mac = normalize_mac(mac)
        target = self._file(mac)
        with self._lock:
            existed = target.exists()
            target.unlink(missing_ok=True)
            self._entries().pop(mac, None)
            mark = self._served(mac, time.time())
            hold = self._hold(str(mark.get("tokenSha256") or "")) if mark is not None else None
            if hold is not None and hold.state == "open":
                # withdrawn before it closed clean: whatever joined with it is never confirmed
                self._put_hold(replace(hold, state="withdrawn"))
                self._scrub(hold.token_sha256)
            self._drop_mark(mac)
        return existed


def _served_at(mark: dict[str, Any]) -> float:
    try:
        return float(mark.get("servedAt", 0))
    except (TypeError, ValueError):
        return 0.0


def _doc(entry: BootEntry) -> dict[str, Any]:
    return {
        "mac": entry.mac,
        "kernel": entry.kernel,
        "initrd": entry.initrd,
        "cmdline": entry.cmdline,
        "script": entry.script,
        "oneTime": entry.one_time,
        "commandId": entry.command_id,
        "nodeId": entry.node_id,
        "joinToken": entry.join_token,
    }


def _entry(doc: dict[str, Any]) -> BootEntry:
    return BootEntry(
        mac=doc["mac"],
        kernel=doc.get("kernel"),
        initrd=doc.get("initrd"),
        cmdline=doc.get("cmdline") or "",
        script=doc.get("script"),
        one_time=bool(doc.get("oneTime", True)),
        command_id=doc.get("commandId") or "",
        node_id=doc.get("nodeId") or "",
        join_token=_registered(doc.get("joinToken")),
    )


def _registered(token: str | None) -> str | None:
    if token:
        register_secret(token)  # read back after a restart: still kept out of every log
    return token or None


def _opt(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    return _ipxe_url(str(value), key) if value else None
