"""The site cache: content-addressed by sha256, filled once from a source URL, verified before
it is served, bounded in size with LRU eviction of unpinned entries. An object is pinned while
something holds it: a boot entry (until it is consumed or cleared), a BMC's virtual medium
(until it is ejected); ``ensure(..., holder=…)`` takes a hold, ``release`` lets go.

Objects live in ``<dir>/objects/<sha256>``; what is known about them (size, source, last use)
in ``<dir>/index.db`` (SQLite). A fill streams the source into a temporary file while hashing
it and renames it into place only when the digest matches, so a partial or wrong download is
never served. Concurrent fills of one digest share one download. Each object is hashed again
before its first serving in a process life (a file changed on disk is dropped, not served).
HTTP serving (with ranges) is ``http.py``'s, from ``path()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

import aiohttp

from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger

from .ssrf import AddressGuard

__all__ = ["SiteCache"]

_SHA_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_CHUNK: Final = 1 << 20
_MAX_REDIRECTS: Final = 3


class _SourceRefused(Exception):  # noqa: N818 - a reason for the log, not an error anyone catches
    """Why one fill failed: for the agent's log only."""


def _check_sha(sha256: str, path: str = "sha256") -> str:
    if not _SHA_RE.match(sha256):
        raise BcError(ErrorCode.INVALID_INPUT, "expected a lowercase hex sha256", {"path": path})
    return sha256


class SiteCache:
    def __init__(self, folder: Path, *, max_bytes: int, guard: AddressGuard | None = None) -> None:
        self.folder = folder
        self.guard = guard if guard is not None else AddressGuard()
        """Where a fill may connect (``ssrf``): the same rules as ``site.httpProxy``."""
        self.objects = folder / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._db = sqlite3.connect(folder / "index.db", isolation_level=None, check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS objects (sha256 TEXT PRIMARY KEY, size INTEGER NOT NULL,"
            " source TEXT NOT NULL, last_used REAL NOT NULL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS holds (holder TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")
        self._fills: dict[str, asyncio.Task[Path]] = {}
        self._verified: set[str] = set()
        self._serving: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self.fills = 0
        """Downloads from a source in this process life (tests count them)."""
        self.log = get_logger(component="cache")
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        known = {row[0] for row in self._db.execute("SELECT sha256 FROM objects")}
        for file in self.objects.iterdir():
            if file.name not in known:
                file.unlink(missing_ok=True)
        for sha in known:
            if not (self.objects / sha).exists():
                self._db.execute("DELETE FROM objects WHERE sha256 = ?", (sha,))

    # -- what is there ---------------------------------------------------------------------

    def used_bytes(self) -> int:
        row = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()
        return int(row[0])

    def stats(self) -> dict[str, Any]:
        count = self._db.execute("SELECT COUNT(*) FROM objects").fetchone()[0]
        pinned = self._db.execute("SELECT COUNT(DISTINCT sha256) FROM holds").fetchone()[0]
        return {
            "usedBytes": self.used_bytes(),
            "maxBytes": self.max_bytes,
            "objects": int(count),
            "pinned": int(pinned),
        }

    def has(self, sha256: str) -> bool:
        row = self._db.execute("SELECT 1 FROM objects WHERE sha256 = ?", (sha256,)).fetchone()
        return row is not None

    def hold(self, holder: str, sha256: str) -> None:
        """``holder`` (one boot entry's kernel, one BMC's CD drive) now pins ``sha256`` (and no
        longer what it held before)."""
        self._db.execute("INSERT OR REPLACE INTO holds (holder, sha256) VALUES (?, ?)", (holder, sha256))

    def release(self, holder: str, *, prefix: bool = False) -> None:
        """``holder`` (or every holder starting with it) pins nothing any more."""
        if prefix:
            escaped = holder.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            self._db.execute("DELETE FROM holds WHERE holder LIKE ? ESCAPE '\\'", (escaped + "%",))
        else:
            self._db.execute("DELETE FROM holds WHERE holder = ?", (holder,))

    # -- filling ---------------------------------------------------------------------------

    async def ensure(self, sha256: str, source: str, *, holder: str | None = None) -> Path:
        """The object's file, downloaded from ``source`` first when it is not here yet."""
        _check_sha(sha256)
        if self.has(sha256):
            self._touch(sha256)
            if holder is not None:
                self.hold(holder, sha256)
            return self.objects / sha256
        task = self._fills.get(sha256)
        if task is None:
            task = asyncio.create_task(self._fill(sha256, source))
            self._fills[sha256] = task
            task.add_done_callback(lambda _t: self._fills.pop(sha256, None))
        path = await asyncio.shield(task)
        if holder is not None:
            self.hold(holder, sha256)
        return path

    async def _fill(self, sha256: str, source: str) -> Path:
        tmp = self.objects / f".{sha256}.{os.getpid()}.part"
        digest = hashlib.sha256()
        size = 0
        self.fills += 1
        try:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                resp = await self._open_source(http, source)
                try:
                    with open(tmp, "wb") as out:  # noqa: ASYNC230 - local disk, chunk by chunk
                        async for chunk in resp.content.iter_chunked(_CHUNK):
                            size += len(chunk)
                            if size > self.max_bytes:
                                raise _SourceRefused("larger than the whole cache")
                            digest.update(chunk)
                            out.write(chunk)
                        out.flush()
                        os.fsync(out.fileno())
                finally:
                    resp.release()
            if digest.hexdigest() != sha256:
                raise _SourceRefused("its content does not match its sha256")
        except (_SourceRefused, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            # One answer for every way a source fails, so a fill is no port scanner (refused
            # address, closed port, timeout, 401, 200 with other bytes); the agent's log says which.
            why = str(exc) if isinstance(exc, _SourceRefused) else type(exc).__name__
            self.log.warning("cache_fill_failed", sha256=sha256, why=why)
            raise BcError(
                ErrorCode.DRIVER_ERROR,
                "cache fill: the source did not give an object of that sha256"
                " (the site agent's log says why)",
                {"reason": "cache-source-error", "path": "url"},
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        async with self._lock:
            self._make_room(size)
            target = self.objects / sha256
            tmp.replace(target)
            self._db.execute(
                "INSERT OR REPLACE INTO objects (sha256, size, source, last_used) VALUES (?, ?, ?, ?)",
                (sha256, size, source, time.time()),
            )
            self._verified.add(sha256)
        self.log.info("cache_filled", sha256=sha256, bytes=size)
        return target

    async def _open_source(self, http: aiohttp.ClientSession, source: str) -> aiohttp.ClientResponse:
        """The source's 200 answer, its redirects followed (each checked like the source), every
        connection made to the address that was checked (no second lookup)."""
        current = source
        for _hop in range(_MAX_REDIRECTS + 1):
            parts = urlsplit(current)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _SourceRefused("not an http(s) URL with a host")
            if parts.username or parts.password:
                raise _SourceRefused("credentials in the URL")
            try:
                ip, why = await self.guard.checked(parts.hostname)
            except OSError:
                raise _SourceRefused(f"cannot resolve {parts.hostname}") from None
            if why is not None:
                raise _SourceRefused(f"{parts.hostname} is {why}")
            host_ip = f"[{ip}]" if ip.version == 6 else str(ip)
            direct = parts._replace(netloc=f"{host_ip}:{parts.port}" if parts.port else host_ip).geturl()
            resp = await http.get(
                direct,
                headers={"Host": parts.netloc},
                allow_redirects=False,
                server_hostname=parts.hostname if parts.scheme == "https" else None,
            )
            if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                current = urljoin(current, resp.headers["Location"])
                resp.release()
                continue
            if resp.status != 200:
                resp.release()
                raise _SourceRefused(f"HTTP {resp.status}")
            return resp
        raise _SourceRefused("too many redirects")

    def _make_room(self, size: int) -> None:
        used = self.used_bytes()
        if used + size <= self.max_bytes:
            return
        rows = self._db.execute(
            "SELECT sha256, size FROM objects WHERE sha256 NOT IN (SELECT sha256 FROM holds)"
            " ORDER BY last_used ASC"
        ).fetchall()
        for sha, obj_size in rows:
            if used + size <= self.max_bytes:
                break
            if self._serving.get(sha):
                continue
            self._remove(sha)
            used -= obj_size
            self.log.info("cache_evicted", sha256=sha, bytes=obj_size)
        if used + size > self.max_bytes:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "the site cache is full of pinned or busy objects",
                {"reason": "cache-full"},
            )

    def _remove(self, sha256: str) -> None:
        self._db.execute("DELETE FROM objects WHERE sha256 = ?", (sha256,))
        (self.objects / sha256).unlink(missing_ok=True)
        self._verified.discard(sha256)

    def _touch(self, sha256: str) -> None:
        self._db.execute("UPDATE objects SET last_used = ? WHERE sha256 = ?", (time.time(), sha256))

    # -- serving ---------------------------------------------------------------------------

    async def open_for_serving(self, sha256: str) -> Path | None:
        """The file to serve, verified; None when it is not here (or failed its check)."""
        if not _SHA_RE.match(sha256) or not self.has(sha256):
            return None
        path = self.objects / sha256
        if sha256 not in self._verified:
            actual = await asyncio.to_thread(_hash_file, path)
            if actual != sha256:
                self.log.warning("cache_object_corrupt", sha256=sha256)
                self._remove(sha256)
                return None
            self._verified.add(sha256)
        self._touch(sha256)
        return path

    def serving(self, sha256: str, delta: int) -> None:
        self._serving[sha256] = self._serving.get(sha256, 0) + delta

    def close(self) -> None:
        self._db.close()


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return ""
    return digest.hexdigest()
