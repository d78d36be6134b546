"""BMC drivers behind one protocol (``base.Driver``), chosen by the command's ``bmc.driver``."""

from __future__ import annotations

from .base import BmcCredentials, BmcTarget, Driver, driver_error

__all__ = ["DRIVERS", "BmcCredentials", "BmcTarget", "Driver", "make_driver"]

DRIVERS = ("redfish", "ipmi", "sim")


def make_driver(target: BmcTarget, credentials: BmcCredentials | None) -> Driver:
    """The driver for one command; it holds the credentials only as long as it lives."""
    if target.driver == "sim":
        from .sim import SimDriver

        return SimDriver(target, credentials)
    if target.driver == "redfish":
        from .redfish import RedfishDriver

        # A BMC without authentication (a lab's emulator) needs no credentialsRef.
        return RedfishDriver(target, credentials or BmcCredentials(username="", password=""))
    if credentials is None:
        raise driver_error(f"{target.driver} login", "the command carries no bmc.credentialsRef")
    from .ipmi import IpmiDriver

    return IpmiDriver(target, credentials)
