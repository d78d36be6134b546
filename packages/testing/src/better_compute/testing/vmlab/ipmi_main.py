"""``python -m better_compute.testing.vmlab.ipmi_main --vm FILE --port P --credentials-file F``:
a VM behind pyghmi's IPMI BMC server, as VirtualBMC puts a libvirt domain behind one.

The process owns the VM's QEMU (it dies with it): chassis power on/off/reset/cycle/soft-off act on
it at once, the power state is whether QEMU runs, and the boot device (``network``, ``hd``,
``optical``; persistent, as sushy-emulator keeps its override) picks what the next power-on boots.
Every request the BMC served is a line of ``--request-log`` (JSON), what a test counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .qemu import BootDevice, VirtualMachine, VmSpec

__all__ = ["main"]

_BOOT: dict[str, BootDevice] = {"network": "network", "hd": "disk", "optical": "cd"}


def _refuse_unknown_cipher_suites() -> None:
    """pyghmi's server always answers cipher suite 3 (HMAC-SHA1) while its own client asks for
    SHA-256 first and falls back only when refused: refuse what it does not do, as a real BMC
    would (the same as ``better_compute.testing.bmcs.IpmiBmc``)."""
    from pyghmi.ipmi.private import serversession

    opened = serversession.ServerSession.create_open_session_response

    def refusing(self: Any, request: bytearray) -> Any:
        if len(request) > 12 and request[12] != 1:
            return bytearray([request[0], 0x11, 0, 0]) + request[4:8] + bytearray(4)
        return opened(self, request)

    serversession.ServerSession.create_open_session_response = refusing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vmlab-ipmi", description=__doc__)
    p.add_argument("--vm", required=True, type=Path, help="the VM's spec (JSON, VmSpec)")
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--credentials-file", required=True, type=Path, help='{"username", "password"}')
    p.add_argument("--request-log", required=True, type=Path)
    p.add_argument("--cdrom", type=Path, help="a medium in the VM's CD-ROM (IPMI has no virtual media)")
    args = p.parse_args(argv)

    import pyghmi.ipmi.bmc as bmc

    _refuse_unknown_cipher_suites()
    creds = json.loads(args.credentials_file.read_text())
    vm = VirtualMachine(VmSpec.from_json(json.loads(args.vm.read_text())))
    lock = threading.Lock()

    class VmBmc(bmc.Bmc):  # type: ignore[misc]  # pyghmi has no type hints
        bootdev = "default"

        def _log(self, call: str, **fields: Any) -> None:
            with lock, open(args.request_log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"t": round(time.time(), 3), "call": call, **fields}) + "\n")

        def _boot(self) -> BootDevice:
            return _BOOT.get(self.bootdev, "disk")

        def get_power_state(self) -> str:
            self._log("get_power_state")
            return "on" if vm.power == "On" else "off"

        def power_on(self) -> None:
            self._log("power_on")
            vm.power_on(self._boot(), cdrom=args.cdrom)

        def power_off(self) -> None:
            self._log("power_off")
            vm.power_off()

        def power_shutdown(self) -> None:
            self._log("power_shutdown")
            vm.power_off("soft-off")  # no ACPI agent to ask: the plug

        def power_reset(self) -> None:
            self._log("power_reset")
            vm.reset(self._boot(), cdrom=args.cdrom)

        def power_cycle(self) -> None:
            self._log("power_cycle")
            vm.reset(self._boot(), cdrom=args.cdrom)

        def get_boot_device(self) -> str:
            self._log("get_boot_device")
            return self.bootdev

        def set_boot_device(self, bootdevice: Any) -> None:
            self._log("set_boot_device", device=str(bootdevice))
            self.bootdev = str(bootdevice)

    try:
        server = VmBmc({str(creds["username"]): str(creds["password"])}, port=args.port, address="127.0.0.1")
        ready = args.request_log.with_name("ready")  # its UDP socket is bound: it answers
        ready.write_text(str(args.port))
        server.listen()
    finally:
        vm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
