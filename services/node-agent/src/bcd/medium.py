"""The ramdisk's join token from its boot medium (``bcd.token_from=media``).

For a node whose BMC has Redfish virtual media, the site agent puts the token on a small ISO
9660 image labelled ``BCBOOT`` that only the BMC fetched, and the BMC shows it to the machine as
a CD (``/dev/sr0`` and on). The kernel line then says ``bcd.token_from=media`` and carries no
token. bcd reads the medium's filesystem from the device itself (no mount): ``token`` and, when
the site agent has a bus CA, ``bus-ca.pem``, whose SHA-256 must be the kernel line's
``bcd.bus_ca_sha256`` (the medium came over the BMC's authenticated session, the kernel line
over the boot network).
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field
from typing import Final

import pycdlib

from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.metal import BOOT_MEDIUM_LABEL

from .system import Machine

__all__ = ["LABEL", "BootMedium", "check_bus_ca", "read_boot_medium"]

LABEL: Final = BOOT_MEDIUM_LABEL
_PVD: Final = 16 * 2048
_MAX: Final = 4 << 20  # the token image is a few dozen KiB
_DEVICES: Final = ("/dev/disk/by-label/BCBOOT", *(f"/dev/sr{i}" for i in range(8)))


@dataclass(frozen=True)
class BootMedium:
    token: str = field(repr=False)
    bus_ca: bytes | None = None


def _file(iso: pycdlib.PyCdlib, name: str) -> bytes | None:
    out = io.BytesIO()
    try:
        iso.get_file_from_iso_fp(out, rr_path=f"/{name}")
    except pycdlib.pycdlibexception.PyCdlibException:
        return None
    return out.getvalue()


def read_boot_medium(machine: Machine) -> BootMedium:
    """The token (and bus CA) of the first device holding a ``BCBOOT`` ISO 9660 filesystem.

    Raises:
        BcError: ``INVALID_INPUT`` at ``bcd.token_from`` when no device holds one with a token.
    """
    for device in _DEVICES:
        path = machine.path(device)
        try:
            with open(path, "rb") as fh:
                pvd = os.pread(fh.fileno(), 48, _PVD)
                if pvd[1:6] != b"CD001" or pvd[40:72].rstrip(b" ") != LABEL.encode():
                    continue
                data = fh.read(_MAX)
        except OSError:
            continue
        iso = pycdlib.PyCdlib()
        try:
            iso.open_fp(io.BytesIO(data))
        except pycdlib.pycdlibexception.PyCdlibException:
            continue
        try:
            token = (_file(iso, "token") or b"").decode("utf-8", "replace").strip()
            bus_ca = _file(iso, "bus-ca.pem")
        finally:
            iso.close()
        if token:
            return BootMedium(token=token, bus_ca=bus_ca)
    raise BcError(
        ErrorCode.INVALID_INPUT,
        f"the kernel line says bcd.token_from=media, but no device holds a {LABEL} medium with a token"
        " (has the BMC inserted it?)",
        {"path": "bcd.token_from"},
    )


def check_bus_ca(medium: BootMedium, cmdline: dict[str, str]) -> None:
    """Refuse a kernel line whose bus CA digest is not the medium's CA (``INVALID_CONFIG`` at
    ``bcd.bus_ca_sha256``): someone on the boot network rewrote the script to point bcd at
    another bus, where the token would be theirs."""
    if medium.bus_ca is None:
        return
    named = cmdline.get("bus_ca_sha256", "").lower()
    got = hashlib.sha256(medium.bus_ca).hexdigest()
    if named != got:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            f"the kernel line names bus CA {named or '(none)'}, the boot medium carries {got}: refused"
            " (the boot script is not the site agent's)",
            {"path": "bcd.bus_ca_sha256"},
        )
