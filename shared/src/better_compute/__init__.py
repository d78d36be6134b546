"""Better Compute SDK.

Plugin authors import ``better_compute.core``, ``better_compute.provision`` and
``better_compute.metal``, and compose a deployment with ``better_compute.app``; services import
the rest. Packages import only the layers below them (docs/architecture.md).
"""

__version__ = "0.1.0"
