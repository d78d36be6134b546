"""``python bench/peers/inventory_emulator.py --config FILE``: the fleet's sushy-emulator
(``better_compute.testing.metal_sim.emulator_main``: sushy-tools' fake driver, the in-memory store,
the simulator's power delays) with an inventory Ironic's out-of-band ``redfish`` inspection can read.

sushy-tools' fake driver serves no ``Processors`` and no ``MemorySummary`` size, and Ironic's
``redfish`` inspect interface fails without them ("The attribute Processors is missing from the
resource"). This launcher gives every fake system 4 CPUs (x86-64) and 16 GiB, read-only, from
the system's own dict when it has ``cpus``/``memory_gib``; everything else is the fleet's.
Our own side inspects in-band (the agent reports the inventory), so it never reads these.
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> int:
    from sushy_tools.emulator.resources.systems import fakedriver

    from better_compute.testing.metal_sim import emulator_main

    def get_total_memory(self: Any, identity: str) -> int:
        return int(self._get(identity).get("memory_gib", 16))

    def get_total_cpus(self: Any, identity: str) -> int:
        return int(self._get(identity).get("cpus", 4))

    def get_processors(self: Any, identity: str) -> list[dict[str, str]]:
        count = get_total_cpus(self, identity)
        return [
            {"id": f"CPU{i}", "socket": f"CPU {i}", "model": "Simulated", "vendor": "Simulated",
             "cores": "1", "threads": "1"}
            for i in range(count)
        ]  # fmt: skip

    fakedriver.FakeDriver.get_total_memory = get_total_memory
    fakedriver.FakeDriver.get_total_cpus = get_total_cpus
    fakedriver.FakeDriver.get_processors = get_processors
    return emulator_main.main()


if __name__ == "__main__":
    sys.exit(main())
