"""``bcd join``: trade a single-use join token and the machine's hardware claims for a node
certificate, with a key made here that never leaves the machine.

A refused join (another machine's claims, a spent or unknown token) stores nothing and keeps
the token file, so the token (unspent on a claims mismatch) can still be used by the right
machine. A join with a ``provisioned`` token for a node that already joined re-keys it: the
installed OS gets a fresh key and certificate under the same node id.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from better_compute.agent import Enrollment, enroll, load_enrollment, save_enrollment
from better_compute.agent.bus import agent_options, joining_options
from better_compute.backoff import Backoff
from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import new_agent_key
from better_compute.logging import get_logger, register_secret
from better_compute.service.client import ApiClient, connect
from better_compute.wire import Subjects
from better_compute.wire.pki import JoinClaims

from .bus import bus_ca, joining_files
from .hardware import claims as read_claims
from .system import Machine

JOIN_WAIT_S: Final = 3600.0
"""How long ``bcd join`` asks again while no bc-pki answers: the user data runs it once, and a
machine that boots while its site is cut off from the hub joins when the link returns."""

__all__ = [
    "DEFAULT_STATE_DIR",
    "SERVICE_UNIT",
    "BcdState",
    "install_service",
    "join",
    "nats_url",
    "read_cmdline",
]

DEFAULT_STATE_DIR: Final = "/var/lib/bcd"
SERVICE_UNIT: Final = "/etc/systemd/system/bcd.service"
_NATS_SCHEMES: Final = frozenset({"nats", "tls", "ws", "wss"})
_WEB: Final = {"http": "ws", "https": "wss"}


def log() -> Any:
    """bcd's logger, as configured when it logs (never bound before ``configure_logging``)."""
    return get_logger(component="bcd")


def joining_nats_options(state: BcdState) -> dict[str, Any]:
    """``connect()`` options of a join: the bus CA (``BC_NATS_CA``, else the one the boot path
    delivered, else the system's CAs), the site's joining certificate (``BC_NATS_JOIN_CERT`` and
    ``_KEY``, else the boot path's), and a connection name and inbox of the join's own
    (docs/security.md, "The bus")."""
    cert, key = joining_files(state.folder)
    return joining_options(cert_file=cert, key_file=key, ca=bus_ca(state.folder), path="BC_NATS_JOIN_CERT")


def agent_nats_options(state: BcdState, enrollment: Enrollment) -> dict[str, Any]:
    """``connect()`` options of the joined machine: its certificate shown to NATS, its own inbox
    prefix, and the bus CA as for a join."""
    return {
        "name": f"bcd:{enrollment.agent_id}",
        **agent_options(enrollment, ca=bus_ca(state.folder), ca_path="BC_NATS_CA"),
    }


def nats_url(control_plane: str) -> str:
    """Where bcd reaches NATS for a control-plane URL.

    ``BC_NATS_URL``, when set, wins (a site whose gateway is a plain NATS leaf node). A
    ``nats://``/``tls://``/``ws(s)://`` URL is used as it is; ``https://gw`` (what user data
    carries) is NATS over WebSocket at the same address (``wss://gw``).
    """
    override = os.environ.get("BC_NATS_URL")
    if override:
        return override
    parts = urlsplit(control_plane)
    if parts.scheme in _NATS_SCHEMES:
        return control_plane
    if parts.scheme in _WEB and parts.netloc:
        return urlunsplit((_WEB[parts.scheme], parts.netloc, parts.path, "", ""))
    raise BcError(
        ErrorCode.INVALID_INPUT,
        "the control plane is an https://, wss:// or nats:// URL",
        {"path": "control-plane"},
    )


def read_cmdline(machine: Machine) -> dict[str, str]:
    """``bcd.*`` settings of the kernel command line (the discovery ramdisk's token and URL)."""
    found: dict[str, str] = {}
    for word in (machine.read("/proc/cmdline") or "").split():
        key, sep, value = word.partition("=")
        if sep and key.startswith("bcd."):
            found[key[4:]] = value
    return found


@dataclass(frozen=True)
class BcdState:
    """bcd's own files on the machine (``/var/lib/bcd`` under the root)."""

    machine: Machine
    state_dir: str = DEFAULT_STATE_DIR

    @property
    def folder(self) -> Path:
        return self.machine.path(self.state_dir)

    @property
    def enrollment_file(self) -> Path:
        return self.folder / "enrollment.json"

    @property
    def certificate_file(self) -> Path:
        return self.folder / "node.crt"

    @property
    def settings_file(self) -> Path:
        return self.folder / "control-plane.json"

    @property
    def journal_file(self) -> Path:
        return self.folder / "journal.db"

    def enrollment(self) -> Enrollment | None:
        return load_enrollment(self.enrollment_file)

    def settings(self) -> dict[str, Any]:
        try:
            loaded = json.loads(self.settings_file.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def save(self, enrollment: Enrollment, *, control_plane: str, subject_root: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        save_enrollment(self.enrollment_file, enrollment)  # the private key, 0600
        self.certificate_file.write_text(enrollment.certificate_pem)
        self.settings_file.write_text(
            json.dumps({"controlPlane": control_plane, "subjectRoot": subject_root}, indent=2) + "\n"
        )


async def join(
    state: BcdState,
    *,
    control_plane: str,
    token: str,
    node_id: str | None = None,
    subject_root: str = "bc",
    claims: JoinClaims | None = None,
    site_id: str | None = None,
    wait_s: float = 0.0,
) -> Enrollment:
    """Join through bc-pki and store the enrollment; returns it.

    Connected to its NATS server (a site's leaf node) but answered by no bc-pki (the leaf's
    link to the hub cut, bc-pki down), it asks again with backoff for up to ``wait_s`` seconds:
    such a request reached nobody, so the token is unspent. So does a request that timed out
    (the bc-pki that took it may have spent the token and died before answering): it is asked
    again with the same key, which bc-pki answers with the certificate already issued to that
    key. A server that cannot be reached at all still fails at once (a wrong ``--control-plane``).

    Raises:
        BcError: bc-pki's refusal (``PERMISSION_DENIED`` with reason ``claims-mismatch`` and the
            claims that differ; ``UNAUTHENTICATED`` for a token that is unknown, spent or
            expired), ``UNAVAILABLE`` when the control plane does not answer, or
            ``INVALID_STATE`` when the token is bound to another node than ``node_id``;
            ``PERMISSION_DENIED`` (``site-mismatch``) for a token of another site than ``site_id``
            (the discovery ramdisk's ``bcd.site=``).
    """
    register_secret(token)
    shown = claims if claims is not None else read_claims(state.machine)
    before = state.enrollment()
    # no certificate yet: on a leaf with an auth callout it joins as the site's joining identity
    nc = await connect(nats_url(control_plane), **joining_nats_options(state))
    try:
        pki = PkiClient(ApiClient(nc, Subjects(root=subject_root)))
        deadline = time.monotonic() + wait_s
        backoff = Backoff(first=1.0, cap=15.0)
        key = new_agent_key()  # one key for every ask: a second ask is the same join
        while True:
            try:
                enrollment = await enroll(pki, token=token, claims=shown, site_id=site_id, key=key)
                break
            except BcError as err:
                left = deadline - time.monotonic()
                if err.code not in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT) or left <= 0:
                    raise
                pause = min(backoff.next(), left)
                log().warning("bcd_join_waiting", said=err.message, retry_in_s=round(pause, 1))
                await asyncio.sleep(pause)
    finally:
        await nc.close()
    if node_id is not None and enrollment.role in ("node", "provisioned") and enrollment.agent_id != node_id:
        raise BcError(
            ErrorCode.INVALID_STATE,
            f"the token belongs to node {enrollment.agent_id}, not {node_id}; nothing was stored",
            {"path": "node", "reason": "other-node"},
        )
    state.save(enrollment, control_plane=control_plane, subject_root=subject_root)
    log().info(
        "bcd_joined",
        node_id=enrollment.agent_id,
        cert_id=enrollment.cert_id,
        role=enrollment.role,
        site_id=enrollment.site_id,
        rekeyed=before is not None and before.agent_id == enrollment.agent_id,
    )
    return enrollment


def install_service(machine: Machine) -> bool:
    """Install ``bcd.service`` (the unit in deploy/systemd) after a join, and start it.

    The unit file goes under the root; ``systemctl`` runs only on the real machine (root
    ``/``), so a test's tree never starts anything. Returns whether systemctl started it.
    """
    unit = resources.files("bcd").joinpath("bcd.service").read_text()
    target = machine.path(SERVICE_UNIT)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(unit)
    if machine.root != Path("/") or not machine.has("systemctl"):
        return False
    for argv in (("systemctl", "daemon-reload"), ("systemctl", "enable", "--now", "bcd.service")):
        done = machine.run(*argv, timeout=60)
        if done.returncode != 0:
            log().warning("bcd_service_not_started", command=" ".join(argv), said=done.stderr.strip()[-200:])
            return False
    return True
