"""An app whose lifecycle verbs start test profiles answered by simulated agents.

Services load it with ``--app metal_test_app:app`` (tests/support is on PYTHONPATH). The verbs are
mapped onto ``t.<verb>`` with ``metal(profiles=…)``, the operator's override, so the lifecycle runs
without a ramdisk or bcd: BMC steps go to a simulated site agent, and the destructive step is the
``netboot.clearEntry`` driver operation (a ``driver.invoke``, destructive), so the quorum applies.
"""

from __future__ import annotations

from better_compute.app import better_compute
from better_compute.metal import metal
from better_compute.provision import define_profile, provision_module
from better_compute.testing.images import sim_image_verifier
from engine_test_app import fail_unless_flag, noop, power, wait_flag

VERBS = ("inspect", "commission", "deploy", "release", "retire", "adopt")
VERB_PROFILES = {verb: f"t.{verb}" for verb in VERBS}
MAC = "52:54:00:00:00:01"
NOOP = {"use": "test.noop"}
DESTRUCTIVE = {"use": "netboot.clearEntry", "on": "site", "with": {"mac": MAC}}


def _profile(pid: str, steps: list[dict[str, object]], **extra: object) -> object:
    return define_profile(id=pid, version=1, target="metal", role="host", steps=steps, **extra)  # type: ignore[arg-type]


PROFILES = [
    # test.power is an agent step whose input has no bmc: the engine relays the node's
    _profile("t.inspect", [{"use": "test.power", "on": "site", "with": {"action": "on"}}, NOOP]),
    _profile("t.commission", [{"use": "test.power", "on": "site", "with": {"action": "off"}}]),
    _profile(
        "t.deploy",
        [{"use": "test.power", "on": "site", "with": {"action": "cycle"}}, DESTRUCTIVE],
        host_config={
            "units": [
                {"name": "sysctl", "settings": {"values": {"vm.swappiness": "10"}}},
                {"name": "hugepages", "settings": {"count": 64}, "when": "gpu=true"},
            ]
        },
    ),
    _profile("t.release", [DESTRUCTIVE]),
    # metal's own relaying step (control-plane): the power it left is read when the workflow ends
    _profile("t.retire", [{"use": "power.setPower", "on": "site", "with": {"action": "off"}}]),
    _profile("t.adopt", [], adopt=True),
    # adopt a running machine and give it a host section its bcd converges to
    _profile(
        "t.adopt-host",
        [],
        adopt=True,
        host_config={"units": [{"name": "kernel-modules", "settings": {"blacklist": ["floppy"]}}]},
    ),
    # inspect --profile t.failing: fails at its second step until the flag is set
    _profile("t.failing", [NOOP, {"use": "test.failUnlessFlag", "with": {"flag": "go"}}]),
    # holds the node in the verb's …ing state until the flag is set
    _profile(
        "t.hold",
        [{"use": "test.waitFlag", "with": {"flag": "hold", "reason": "the test holds it (flag hold)"}}],
        image="ubuntu@24.04",
    ),
]

provision = provision_module(
    modules=[metal(profiles=VERB_PROFILES)],
    steps=[noop, power, fail_unless_flag, wait_flag],
    profiles=PROFILES,  # type: ignore[arg-type]
    image_verifier=sim_image_verifier,  # a deploy's image must be in the catalog, signed by it
)
app = better_compute(modules=[metal(profiles=VERB_PROFILES), provision])
