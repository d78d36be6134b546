"""Name patterns shared by profiles, config units and user-data templates."""

from __future__ import annotations

import re
from typing import Final

# `ubuntu-24.04-autoinstall`: lowercase, digits, dots and dashes, starting and ending alnum.
PROFILE_ID_PATTERN: Final = r"^[a-z0-9](?:[a-z0-9.-]{0,126}[a-z0-9])?$"
# `host`, `lifecycle`: a lowercase word, dashes allowed.
ROLE_PATTERN: Final = r"^[a-z][a-z0-9-]{0,62}$"
# `kernel-modules`, `acme-nic-firmware`.
UNIT_NAME_PATTERN: Final = r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$"
# `cloud-init`, `ignition`, `talos`.
USER_DATA_KIND_PATTERN: Final = r"^[a-z][a-z0-9-]{0,62}$"
# `acme-talos.yaml`.
TEMPLATE_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# `ubuntu-24.04@2024.06.1`: an image name and version, resolved in the catalog.
IMAGE_REF_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]{0,127}@[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"


def matches(pattern: str, value: object) -> bool:
    """Whether ``value`` is a string matching ``pattern``."""
    return isinstance(value, str) and re.fullmatch(pattern, value) is not None
