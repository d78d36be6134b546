"""An ISO 9660 image built in memory (Rock Ridge and Joliet names, so a file reads by its long
name on Linux and elsewhere): bcd's config drive (``cidata``) and the site agent's boot medium
(``BCBOOT``) are both one."""

from __future__ import annotations

import io
from collections.abc import Sequence

__all__ = ["iso_image"]


def iso_image(label: str, files: Sequence[tuple[str, str, bytes]]) -> bytes:
    """The image labelled ``label`` holding ``files``, each ``(ISO 9660 name, long name, body)``
    (``("/USERDATA.;1", "user-data", b"…")``), in the root folder. Nothing touches the disk."""
    import pycdlib  # only the two agents build images: no cost at the runtime's import

    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, joliet=3, rock_ridge="1.09", vol_ident=label)
    for short, name, body in files:
        iso.add_fp(io.BytesIO(body), len(body), short, rr_name=name, joliet_path=f"/{name}")
    out = io.BytesIO()
    iso.write_fp(out)
    iso.close()
    return out.getvalue()
