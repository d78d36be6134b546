"""BMC drivers in a table by the command's ``bmc.driver``: each opens a ``Driver`` of four
interfaces (power, management, media, inventory; ``interfaces``) for one command. ``fresh``: read
everything from the BMC and keep nothing for later commands (the Redfish driver keeps what it
learnt of a BMC otherwise; ``management.validate`` checks the BMC from the start)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Protocol

from better_compute.wire.metal import NodeBmc

from .base import BmcCredentials, driver_error
from .interfaces import Driver

__all__ = ["DRIVERS", "BmcCredentials", "Driver", "make_driver"]


def _sim(target: NodeBmc, credentials: BmcCredentials | None, *, fresh: bool) -> Driver:
    from .sim import open_driver

    return open_driver(target)


def _redfish(target: NodeBmc, credentials: BmcCredentials | None, *, fresh: bool) -> Driver:
    from .redfish import LINKS, open_driver  # imported late: sushy and requests are heavy

    # A BMC without authentication (a lab's emulator) needs no credentialsRef.
    login = credentials or BmcCredentials(username="", password="")
    return open_driver(target, login, links=None if fresh else LINKS)


def _ipmi(target: NodeBmc, credentials: BmcCredentials | None, *, fresh: bool) -> Driver:
    if credentials is None:
        raise driver_error(f"{target.driver} login", "the command carries no bmc.credentialsRef")
    from .ipmi import open_driver

    return open_driver(target, credentials)


class OpenDriver(Protocol):
    def __call__(self, target: NodeBmc, credentials: BmcCredentials | None, *, fresh: bool) -> Driver: ...


DRIVERS: Final[Mapping[str, OpenDriver]] = MappingProxyType({"redfish": _redfish, "ipmi": _ipmi, "sim": _sim})
"""The drivers by ``NodeBmc.driver``: each opens the ``Driver`` of one command."""


def make_driver(target: NodeBmc, credentials: BmcCredentials | None, *, fresh: bool = False) -> Driver:
    """The driver for one command; it holds the credentials only as long as it lives."""
    return DRIVERS[target.driver](target, credentials, fresh=fresh)
