"""``site.httpProxy``: one HTTP request from the site agent to a node's own address.

SSRF checks, in order: the URL is http(s) with a host; the host is resolved once; every
resolved address that ``ssrf.AddressGuard`` refuses (loopback, link-local, a cloud metadata
address, unspecified, multicast or reserved, one of this agent's own addresses or a
control-plane address) is refused, whatever ``nodeAddresses`` lists; of the rest, only the node's recorded
addresses (``nodeAddresses`` in the payload, filled by the control plane from the node record)
are kept; the request connects to that IP (no second lookup; TLS still checks the name). A
redirect is followed only to the same scheme, host and port; anywhere else is refused. The
response body is bounded (``MAX_BODY``) and so is the time (the command's deadline, at most
``MAX_SECONDS`` per attempt).

``poll``: the machine's API may not be up yet, so connection failures and 5xx answers are
tried again with a jittered backoff until the command's deadline; the first other answer is
the result.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable, Iterable
from typing import Any, Final
from urllib.parse import urljoin, urlsplit

import aiohttp

from better_compute.agent import CommandRejected
from better_compute.backoff import Backoff
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.commands import HttpProxy

from .ssrf import IP, AddressGuard, is_local_address

__all__ = ["MAX_BODY", "HttpRelay", "is_local_address"]

MAX_BODY: Final = 256 * 1024
MAX_SECONDS: Final = 30.0
_MAX_REDIRECTS: Final = 3
_LOOPBACK: Final = ("127.0.0.0/8", "::1/128")
_HOP_BY_HOP: Final = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def _refused(reason: str) -> CommandRejected:
    return CommandRejected(f"ssrf-refused: {reason}")


class HttpRelay:
    def __init__(
        self,
        *,
        control_plane: Iterable[str] = (),
        is_local: Callable[[IP], bool] = is_local_address,
        allow_loopback: bool = False,
    ) -> None:
        # allow_loopback: tests only, the node under test listens on loopback; never set by the process
        self.guard = AddressGuard(
            control_plane=control_plane, allow=_LOOPBACK if allow_loopback else (), is_local=is_local
        )

    async def _resolve(self, host: str) -> list[IP]:
        try:
            return await self.guard.resolve(host)
        except OSError:
            raise _refused(f"cannot resolve {host}") from None

    async def target(self, url: str, node_addresses: list[str]) -> tuple[Any, IP]:
        """The parsed URL and the one IP to connect to, or ``CommandRejected``."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BcError(ErrorCode.INVALID_INPUT, "expected an http(s) URL with a host", {"path": "url"})
        if parts.username or parts.password:
            raise BcError(ErrorCode.INVALID_INPUT, "no credentials in the URL", {"path": "url"})
        resolved = await self._resolve(parts.hostname)
        for ip in resolved:
            why = self.guard.why_not(ip)
            if why is not None:
                raise _refused(f"{parts.hostname} is {why}")
        recorded: set[IP] = set()
        for address in node_addresses:
            recorded.update(await self._resolve(address))
        allowed = [ip for ip in resolved if ip in recorded]
        if not allowed:
            raise _refused(f"{parts.hostname} is not one of the node's recorded addresses")
        return parts, allowed[0]

    async def request(self, payload: HttpProxy, *, deadline: float) -> dict[str, Any]:
        if not payload.node_addresses:
            raise _refused("the command carries no nodeAddresses to check the target against")
        url = payload.url
        parts, ip = await self.target(url, payload.node_addresses)
        method = payload.method
        headers = {k: v for k, v in payload.headers.items() if k.lower() not in _HOP_BY_HOP}
        body, poll, ssl = payload.body, payload.poll, not payload.insecure
        backoff = Backoff(first=0.2, cap=3.0)
        while True:
            try:
                return await self._once(parts, ip, url, method, headers, body, ssl, deadline)
            except _Retry as exc:
                delay = backoff.next()
                if not poll or time.time() + delay >= deadline:
                    raise BcError(
                        ErrorCode.DRIVER_ERROR,
                        f"site.httpProxy: {exc}",
                        {"reason": str(exc)},
                    ) from None
            await asyncio.sleep(delay)

    async def _once(
        self,
        parts: Any,
        ip: IP,
        url: str,
        method: str,
        headers: dict[str, str],
        body: str | None,
        ssl: bool,
        deadline: float,
    ) -> dict[str, Any]:
        origin = (parts.scheme, parts.hostname, parts.port)
        seconds = max(0.5, min(MAX_SECONDS, deadline - time.time()))
        timeout = aiohttp.ClientTimeout(total=seconds)
        current = url
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for _hop in range(_MAX_REDIRECTS + 1):
                cur = urlsplit(current)
                host_ip = f"[{ip}]" if ip.version == 6 else str(ip)
                netloc = f"{host_ip}:{cur.port}" if cur.port else host_ip
                direct = cur._replace(netloc=netloc).geturl()
                host_header = cur.netloc.rsplit("@", 1)[-1]
                try:
                    async with http.request(
                        method,
                        direct,
                        headers={**headers, "Host": host_header},
                        data=body.encode() if body is not None else None,
                        allow_redirects=False,
                        ssl=ssl,
                        server_hostname=cur.hostname if cur.scheme == "https" else None,
                    ) as resp:
                        if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                            nxt = urlsplit(urljoin(current, resp.headers["Location"]))
                            if (nxt.scheme, nxt.hostname, nxt.port) != origin:
                                raise _refused(f"a redirect to {nxt.hostname or '?'} (elsewhere)")
                            current = nxt.geturl()
                            if resp.status == 303:
                                method, body = "GET", None
                            continue
                        if resp.status >= 500:
                            raise _Retry(f"HTTP {resp.status} from the node")
                        # read() gives what arrived so far, not n bytes: read to the bound
                        data = b""
                        while len(data) <= MAX_BODY:
                            chunk = await resp.content.read(MAX_BODY + 1 - len(data))
                            if not chunk:
                                break
                            data += chunk
                        if len(data) > MAX_BODY:
                            raise BcError(
                                ErrorCode.DRIVER_ERROR,
                                f"site.httpProxy: the response is larger than {MAX_BODY} bytes",
                                {"reason": "response-too-large"},
                            )
                        return _result(resp, data)
                except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                    raise _Retry(f"cannot reach the node ({type(exc).__name__})") from None
            raise _refused("too many redirects")


class _Retry(Exception):  # noqa: N818 - control flow inside this module
    pass


def _result(resp: aiohttp.ClientResponse, data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {
        "status": resp.status,
        "headers": {k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "content-length")},
    }
    try:
        out["body"] = data.decode()
    except UnicodeDecodeError:
        out["bodyBase64"] = base64.b64encode(data).decode()
    return out
