"""Metal's owner reconcilers and the keys of the commands it sends outside any workflow."""

from __future__ import annotations

from typing import Final

from better_compute.wire.pki import JOIN_EVENTS

__all__ = [
    "DISCOVERY_KEY_PREFIX",
    "DISCOVERY_OWNER",
    "HOST_KEY_PREFIX",
    "HOST_OWNER",
    "JOIN_EVENTS",
    "METAL_OWNER",
    "UNDO_OWNER",
]

METAL_OWNER: Final = "metal"  # a lifecycle verb's workflow: its end moves the node on
HOST_OWNER: Final = "metal-host"  # a node's host section goes to its bcd
UNDO_OWNER: Final = "metal-undo"  # an aborted workflow's boot set-up is undone
DISCOVERY_OWNER: Final = "metal-discovery"  # a discovered node's inventory, its enrolment by rule
HOST_KEY_PREFIX: Final = "host:g"  # the node.converge of generation g: host:g<g>
DISCOVERY_KEY_PREFIX: Final = "discovery:"  # node.inventory of one discovery: discovery:<cert id>
