"""An app whose provision module has its own ``image_verifier`` (tests of the image catalog).

Services load it with ``--app images_test_app:app`` (tests/support is on PYTHONPATH). The
verifier accepts a signature that reads ``ok:<digest>:<url>`` for tenants other than ``blocked``.
"""

from __future__ import annotations

from better_compute.app import better_compute
from better_compute.metal import metal
from better_compute.provision import provision_module


async def verifier(
    *, tenant_id: str, digest: str, signature: bytes, name: str, version: str, url: str, payload: bytes
) -> bool:
    assert f"name: {name}\n" in payload.decode()  # what a real verifier would check a signature over
    return tenant_id != "blocked" and signature == f"ok:{digest}:{url}".encode()


app = better_compute(modules=[metal(), provision_module(modules=[metal()], image_verifier=verifier)])
