"""BMC drivers in a table by the command's ``bmc.driver``: each opens a ``Driver`` of four
interfaces (power, management, media, inventory; ``interfaces``) for one command."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from better_compute.wire.metal import NodeBmc

from .base import BmcCredentials, driver_error
from .interfaces import Driver

__all__ = ["DRIVERS", "BmcCredentials", "Driver", "make_driver"]


def _sim(target: NodeBmc, credentials: BmcCredentials | None) -> Driver:
    from .sim import open_driver

    return open_driver(target)


def _redfish(target: NodeBmc, credentials: BmcCredentials | None) -> Driver:
    from .redfish import open_driver  # imported late: sushy and requests are heavy

    # A BMC without authentication (a lab's emulator) needs no credentialsRef.
    return open_driver(target, credentials or BmcCredentials(username="", password=""))


def _ipmi(target: NodeBmc, credentials: BmcCredentials | None) -> Driver:
    if credentials is None:
        raise driver_error(f"{target.driver} login", "the command carries no bmc.credentialsRef")
    from .ipmi import open_driver

    return open_driver(target, credentials)


DRIVERS: Final[Mapping[str, Callable[[NodeBmc, BmcCredentials | None], Driver]]] = MappingProxyType(
    {"redfish": _redfish, "ipmi": _ipmi, "sim": _sim}
)
"""The drivers by ``NodeBmc.driver``: each opens the ``Driver`` of one command."""


def make_driver(target: NodeBmc, credentials: BmcCredentials | None) -> Driver:
    """The driver for one command; it holds the credentials only as long as it lives."""
    return DRIVERS[target.driver](target, credentials)
