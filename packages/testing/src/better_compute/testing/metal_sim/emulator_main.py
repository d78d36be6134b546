"""``python -m better_compute.testing.metal_sim.emulator_main --config FILE``: sushy-emulator
with its fake driver, whose power changes land after a delay the simulator chooses.

sushy-tools' fake driver applies a power change 1-11 s (at random) after the request, which is
what real BMCs do but too slow for some tests and for a fleet benchmark. This launcher reads
``SIM_POWER_DELAYS_FILE`` (JSON ``{"default": [lo, hi], "<uuid>": [lo, hi]}``, re-read on each
change, so a test can slow one machine down while it runs) and otherwise runs sushy-emulator's
own ``main``. The emulator's state lives in its memory: sushy-tools' store is a SQLite file
opened, written and fsynced on every read and change, which at 1,000 systems made it answer 500
("database is locked") under concurrent requests; the simulated BMCs outlive no emulator
restart anyway. The memory store is one per file the SQLite store would use, shared by every
instance: sushy-tools builds its drivers lazily without a lock, so concurrent first requests
can build two (with SQLite they shared the file; with private dicts one machine's power change
was lost). Everything else (the Redfish API, late application on the next read, the
``external_notifier`` PUT on every change) is sushy-tools' code.
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any


def _delay(config: dict[str, Any], uuid: str) -> float:
    lo, hi = 1.0, 11.0  # sushy-tools' own
    path = config.get("SIM_POWER_DELAYS_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
            lo, hi = doc.get(uuid) or doc.get("default") or (lo, hi)
        except (OSError, ValueError, TypeError):
            pass
    return random.uniform(float(lo), float(hi))


LISTEN_BACKLOG = 1024
_STORES: dict[str, dict[Any, Any]] = {}


class _MemoryStore(MutableMapping[Any, Any]):
    """sushy-tools' ``PersistentDict`` in memory: ``make_permanent`` joins the process-wide
    store of that name. Values go in and come out as copies, as through SQLite: the virtual
    media driver gives every system the very same default device dict, so storing it as is
    made one machine's inserted medium every machine's (and an eject cleared them all)."""

    def __init__(self) -> None:
        self._data: dict[Any, Any] = {}

    def make_permanent(self, dbpath: str | None, dbfile: str) -> None:
        self._data = _STORES.setdefault(f"{dbpath}/{dbfile}", self._data)

    def __getitem__(self, key: Any) -> Any:
        return pickle.loads(self._data[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._data[key] = pickle.dumps(value)

    def __delitem__(self, key: Any) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)


def main() -> int:
    from sushy_tools import error
    from sushy_tools.emulator import main as emulator
    from sushy_tools.emulator import memoize
    from sushy_tools.emulator.resources.systems import fakedriver
    from werkzeug import serving

    def set_power_state(self: Any, identity: str, state: str) -> None:
        system = self._get(identity)
        apply_time = time.time() + _delay(self._config, system["uuid"])
        if "On" in state:
            pending_state = "On"
        elif state in ("ForceOff", "GracefulShutdown"):
            pending_state = "Off"
        elif "Restart" in state:
            system["power_state"] = "Off"
            pending_state = state
        else:
            raise error.NotSupportedError(f"Power state {state} is not supported")
        if system["power_state"] != pending_state:
            self._update(system, pending_power={"power_state": pending_state, "apply_time": apply_time})

    stored = threading.Lock()
    changes = itertools.count(1)

    def _update(self: Any, system: Any, **changed: Any) -> None:
        # sushy-tools' own, with each state numbered as it is stored (``sim_seq``): two requests
        # of one system (a Reset, and a read applying a due change) PUT their states from their
        # own threads, and the later state could arrive first (the 10,000-machine deploy: a
        # machine the BMC showed on was booted, then powered off by the Reset's older "off,
        # on pending", and never booted again); the simulator keeps the newest it has seen
        if isinstance(system, str):
            system = self._get(system)
        with stored:
            system.update(changed)
            self._systems[system["uuid"]] = system
            state = {**system, "sim_seq": next(changes)}
        if system.get("external_notifier"):
            self._send_external_notification(state)

    fakedriver.FakeDriver.set_power_state = set_power_state
    fakedriver.FakeDriver._update = _update
    memoize.PersistentDict = _MemoryStore
    # werkzeug listens with a backlog of 128: a thousand systems' power changes read back at
    # once (the simulator's reads, the site agent's) had connections dropped and tried again
    serving.BaseWSGIServer.request_queue_size = LISTEN_BACKLOG
    result: int = emulator.main()
    return result


if __name__ == "__main__":
    sys.exit(main())
