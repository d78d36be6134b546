"""Metal as a plug-in of the engine: enrolling, the lifecycle verbs, discovery, enrollment rules,
the image catalog, BMC relaying, quarantine, and the node events."""
