"""Better Compute SDK.

Plugin authors import ``better_compute.core``, ``better_compute.provision`` and
``better_compute.metal``; services import the rest.
"""

__version__ = "0.1.0"
