"""VMs behind sushy-emulator (Redfish): its fake driver holds a system per VM, and its
``external_notifier`` tells us every change, which drives the VM's QEMU process.

sushy-tools' libvirt driver (what Ironic's CI runs) would need the ``libvirt`` Python binding in
this environment and a system libvirtd; the fake driver with the notifier needs neither, and the
Redfish API the site agent talks to is sushy-emulator's either way (docs/vm-lab.md).

What the BMC's state means to the VM: power landing On starts QEMU booting the override
(``Pxe``: the network first; ``Cd``: the inserted virtual medium, which sushy-emulator downloaded,
as a CD-ROM; ``Hdd`` or none: the disk); Off kills it (a pulled plug); a reset or cycle (Off
now, On when it lands) restarts it. The fake driver applies a power change late, on the next
read once it is due: as the metal simulator does, a read is scheduled for that moment, so a
power-on lands even when nobody polls. ``metal_sim.emulator_main`` takes the delay from
``power_delay``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..metal_sim.emulator import FleetEmulator, notifier_server
from .qemu import BootDevice, VirtualMachine

__all__ = ["RedfishVmBmc"]

_BOOT: dict[str, BootDevice] = {"Pxe": "network", "Cd": "cd", "Hdd": "disk"}
# werkzeug's access log line, as sushy-emulator writes it to its output
_ACCESS = re.compile(
    r'"(?:\x1b\[[\d;]*m)*(GET|POST|PATCH|PUT|DELETE) (\S+) HTTP/[\d.]+(?:\x1b\[[\d;]*m)*" (\d{3})'
)


@dataclass(frozen=True)
class _System:
    index: int
    uuid: str
    name: str
    macs: tuple[str, ...]


class RedfishVmBmc:
    """One sushy-emulator for the given VMs (system id = the VM's product UUID)."""

    def __init__(
        self, folder: Path, vms: Sequence[VirtualMachine], *, power_delay: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.folder = folder
        self.vms = {vm.spec.uuid: vm for vm in vms}
        self.power_delay = power_delay
        self.emulator = FleetEmulator(folder)
        self._power: dict[str, str] = {}
        self._pending: dict[str, Any] = {}
        self._seq: dict[str, int] = {}  # the newest state applied, by system (``sim_seq``)
        self._lock = threading.Lock()
        self._server = notifier_server(self._on_state)

    @property
    def url(self) -> str:
        return self.emulator.url

    @property
    def credentials(self) -> dict[str, str]:
        """The BMC credential as the site agent reads it from bc-secrets."""
        return self.emulator.credentials

    def start(self) -> RedfishVmBmc:
        threading.Thread(target=self._server.serve_forever, name="vmlab-notifier", daemon=True).start()
        self.emulator.delays_file.write_text(json.dumps({"default": list(self.power_delay)}))
        systems = [
            _System(index=i, uuid=vm.spec.uuid, name=vm.spec.name, macs=(vm.spec.mac,))
            for i, vm in enumerate(self.vms.values())
        ]
        port = self._server.server_address[1]
        self.emulator.start(systems, notifier=f"http://127.0.0.1:{port}/notify")
        return self

    def close(self) -> None:
        self.emulator.close()
        self._server.shutdown()
        self._server.server_close()

    def requests(self) -> list[str]:
        """``METHOD path status`` of every request the emulator answered, in order (its access log)."""
        return [" ".join(m.groups()) for m in _ACCESS.finditer(self.emulator.output())]

    def _on_state(self, doc: dict[str, Any]) -> None:
        uuid = str(doc.get("uuid"))
        vm = self.vms.get(uuid)
        if vm is None:
            return
        with self._lock:
            seq = doc.get("sim_seq")
            if isinstance(seq, int):  # an older state PUT after a newer one: the BMC moved on
                if seq <= self._seq.get(uuid, 0):
                    return
                self._seq[uuid] = seq
            pending = doc.get("pending_power") or None
            if pending and pending.get("apply_time") != self._pending.get(uuid):
                self._pending[uuid] = pending.get("apply_time")
                vm.event("power.requested", to=pending.get("power_state"))
                wait = max(0.0, float(pending.get("apply_time", 0)) - time.time()) + 0.05
                threading.Timer(wait, self.emulator.read_system, args=(uuid,)).start()
            power = str(doc.get("power_state", "Off"))
            if power == self._power.get(uuid, "Off"):
                return
            self._power[uuid] = power
            if power != "On":
                vm.power_off()
                return
            device = _BOOT.get(str(doc.get("boot_device", "Hdd")), "disk")
            cd = (doc.get("boot_image") or {}).get("Cd")
            cdrom = Path(str(cd[0])) if cd and cd[0] and cd[2] else None
            # an inserted medium is the VM's CD whatever it boots from, as a BMC's virtual CD is
            # (a ramdisk booted from the network reads its token from it: tokenDelivery media)
            vm.power_on(device, cdrom=cdrom)
