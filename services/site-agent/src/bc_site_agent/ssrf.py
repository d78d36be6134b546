"""Where the site agent may connect on someone else's word: ``site.httpProxy`` targets and the
site cache's fill sources (both come in commands).

Never: loopback, link-local (169.254.0.0/16, fe80::/10), unspecified, multicast or reserved
addresses, the big clouds' metadata services (``METADATA``: AWS, GCP, Azure, OpenStack and
DigitalOcean at 169.254.169.254, AWS's IPv6 fd00:ec2::254 and ECS's 169.254.170.2, Azure's
WireServer 168.63.129.16, Alibaba's 100.100.100.200, Oracle's 192.0.0.192), this agent's own
addresses (a service bound to 0.0.0.0 is loopback by another name) and the control plane's. An
IPv6 address that carries an IPv4 one (IPv4-mapped, NAT64, 6to4, Teredo) is judged by both.
``allow`` (the cache's ``allow_source_networks``) lifts the loopback, own-address and
control-plane rules for the networks an operator names; the metadata and link-local rules hold
whatever it says.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from typing import Final

__all__ = ["IP", "METADATA", "AddressGuard", "is_local_address"]

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

METADATA: Final[tuple[Network, ...]] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.169.254/32",  # AWS, GCP, Azure, OpenStack, DigitalOcean, …
        "169.254.170.2/32",  # AWS ECS task metadata
        "fd00:ec2::/48",  # AWS IPv6: IMDS fd00:ec2::254, DNS ::253, NTP ::123
        "168.63.129.16/32",  # Azure WireServer
        "100.100.100.200/32",  # Alibaba Cloud
        "192.0.0.192/32",  # Oracle Cloud
    )
)
"""Cloud metadata services: never a target, whoever lists them."""

_NAT64: Final = ipaddress.ip_network("64:ff9b::/96")


def is_local_address(ip: IP) -> bool:
    """Whether ``ip`` is one of this machine's own addresses (it can be bound here)."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((str(ip), 0))
        return True
    except OSError:
        return False


def _faces(ip: IP) -> list[IP]:
    """``ip`` and the IPv4 address an IPv6 one carries, if any."""
    faces: list[IP] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            faces.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            faces.append(ip.sixtofour)
        if ip.teredo is not None:
            faces += list(ip.teredo)
        if ip in _NAT64:
            faces.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return faces


class AddressGuard:
    """Judges addresses (``why_not``) and resolves names once (``resolve``)."""

    def __init__(
        self,
        *,
        control_plane: Iterable[str] = (),
        allow: Iterable[str] = (),
        is_local: Callable[[IP], bool] = is_local_address,
    ) -> None:
        self.control_plane = {ipaddress.ip_address(a) for a in control_plane}
        self.allow: tuple[Network, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in allow)
        self.is_local = is_local

    def why_not(self, ip: IP) -> str | None:
        """Why the agent must not connect to ``ip``; None when it may."""
        faces = _faces(ip)
        if any(face in net for face in faces for net in METADATA):
            return "a cloud metadata address"
        if any(face.is_link_local for face in faces):
            return "link-local"
        allowed = any(ip in net for net in self.allow)
        if any(face.is_loopback for face in faces) and not allowed:
            return "loopback"
        if any(face.is_unspecified or face.is_multicast for face in faces) or (
            ip.is_reserved and not ip.is_loopback
        ):
            return "not a unicast address"
        if not allowed and ip in self.control_plane:
            return "a control-plane address"
        if not allowed and not ip.is_loopback and self.is_local(ip):
            return "this agent's own address"
        return None

    async def resolve(self, host: str) -> list[IP]:
        """Every address of ``host`` (an IP literal is itself); ``OSError`` when it has none."""
        try:
            return [ipaddress.ip_address(host.strip("[]"))]
        except ValueError:
            pass
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))

    async def checked(self, host: str) -> tuple[IP, str | None]:
        """The one address to connect to for ``host`` and, when any of its addresses is refused,
        why (a name that resolves to a good and a bad address is refused whole: the lookup the
        connection makes could pick either)."""
        resolved = await self.resolve(host)
        if not resolved:
            raise OSError(f"{host} has no address")
        for ip in resolved:
            why = self.why_not(ip)
            if why is not None:
                return ip, why
        return resolved[0], None
