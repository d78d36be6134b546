"""``site-agent.toml``: what an operator writes once per site agent.

.. code-block:: toml

    site_id = "site-a"                      # required: the site this agent serves
    nats_url = "nats://127.0.0.1:4222"      # or BC_NATS_URL
    nats_ca = "/etc/better-compute/nats/tls/ca.pem"   # or BC_NATS_CA: the bus CA (deploy/nats)
    join_cert_file = "/etc/bc-site-agent/bc-join-site-a.pem"   # the site's joining certificate,
    join_key_file = "/etc/bc-site-agent/bc-join-site-a-key.pem"  # for the first join (bcx bus callout)
    subject_root = "bc"                     # or BC_SUBJECT_ROOT
    state_dir = "/var/lib/bc-site-agent"    # enrollment (key + certificate, 0600), journal
    join_token_file = "/etc/bc-site-agent/join-token"   # read once, on the first start only
    http_listen = "0.0.0.0:8081"            # network boot, the site cache, /healthz
    public_url = "http://10.0.0.5:8081"     # how machines reach http_listen (default: from it)
    media_url = "http://10.1.0.5:8081"      # how BMCs reach it, for token media (default: public_url)
    metrics_listen = "127.0.0.1:9181"       # /metrics (never on http_listen); "" turns it off

    [cache]
    dir = "/var/cache/bc-site-agent"        # default: <state_dir>/cache
    max_bytes = 50_000_000_000
    allow_source_networks = []              # fill sources allowed although loopback, this host's
                                            # or the control plane's (never cloud metadata)

    control_plane_addresses = ["10.0.0.2"]  # never relayed to (nor the NATS server's address)

    [netboot]
    discovery = false                       # unknown MACs: discovery ramdisk, else local boot
    discovery_kernel = "http://…/vmlinuz"
    discovery_initrd = "http://…/initrd"
    discovery_cmdline = "console=ttyS0"
    discovery_token_file = "/etc/bc-site-agent/discovery-token"   # the site's discovery token
    discovery_control_plane = "https://gw.example.com"            # what the ramdisk's bcd joins
    quiet_seconds = 120                     # a served node entry closes clean this long after
                                            # its last serve (or the node's power-on, if later)
                                            # with no ask from another address: more than a
                                            # machine's power-on-to-iPXE time (its POST)

Every problem is ``INVALID_CONFIG`` with ``details.path`` naming the key.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from better_compute.core.errors import BcError, ErrorCode

from .netboot import DEFAULT_QUIET_SECONDS, IPXE_UNSAFE

__all__ = ["SiteAgentConfig", "load_config"]

_SITE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


@dataclass(frozen=True, kw_only=True)
class SiteAgentConfig:
    site_id: str
    nats_url: str
    subject_root: str
    state_dir: Path
    join_token_file: Path | None
    http_host: str
    http_port: int
    public_url: str
    cache_dir: Path
    cache_max_bytes: int
    discovery: bool
    discovery_kernel: str | None
    discovery_initrd: str | None
    discovery_cmdline: str
    discovery_token_file: Path | None = None
    discovery_control_plane: str | None = None
    control_plane_addresses: tuple[str, ...] = ()
    cache_allow_source_networks: tuple[str, ...] = ()
    quiet_seconds: float = DEFAULT_QUIET_SECONDS
    metrics_host: str | None = "127.0.0.1"
    """Where ``/metrics`` listens (``metrics_listen``); None: nowhere."""
    metrics_port: int = 9181
    nats_ca: str | None = None
    """The bus CA that checks the NATS server (deploy/nats); the system's CAs without it."""
    join_cert_file: Path | None = None
    """The site's joining certificate and key: what the agent shows a leaf node with an auth
    callout before it has a certificate of its own (its first join)."""
    join_key_file: Path | None = None
    bmc_credentials_keep_s: float = 300.0
    """How long a BMC credential fetched through the secrets gate is kept in memory for the
    node's next commands (``[bmc] credentials_keep_seconds``; 0: fetched for each command)."""
    media_url: str = ""
    """How the BMCs reach ``http_listen`` (the management network), for the ramdisk's token
    media (``/media/<capability>``); empty: ``public_url``."""

    @property
    def enrollment_file(self) -> Path:
        return self.state_dir / "enrollment.json"

    @property
    def journal_file(self) -> Path:
        return self.state_dir / "journal.db"

    @property
    def netboot_dir(self) -> Path:
        return self.state_dir / "netboot"


def _bad(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


def _str(doc: dict[str, Any], key: str, path: str, default: str | None = None) -> str | None:
    value = doc.get(key, default)
    if value is not None and not isinstance(value, str):
        raise _bad(path, "expected a string")
    return value


def load_config(file: str | Path, env: dict[str, str] | None = None) -> SiteAgentConfig:
    env = dict(os.environ) if env is None else env
    path = Path(file)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise _bad(str(path), f"cannot read the config file: {type(exc).__name__}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise _bad(str(path), f"not TOML: {exc}") from exc
    site_id = _str(doc, "site_id", "site_id")
    if not site_id or not _SITE_RE.match(site_id):
        raise _bad("site_id", "a site id (lowercase letters, digits, dashes) is required")
    nats_url = _str(doc, "nats_url", "nats_url") or env.get("BC_NATS_URL")
    if not nats_url:
        raise _bad("nats_url", "give nats_url (or BC_NATS_URL)")
    subject_root = _str(doc, "subject_root", "subject_root") or env.get("BC_SUBJECT_ROOT", "bc")
    state_dir = _str(doc, "state_dir", "state_dir")
    if not state_dir:
        raise _bad("state_dir", "a state folder is required")
    token_file = _str(doc, "join_token_file", "join_token_file")
    host, port = _listen(_str(doc, "http_listen", "http_listen", "127.0.0.1:8081") or "", "http_listen")
    metrics_listen = _str(doc, "metrics_listen", "metrics_listen", "127.0.0.1:9181")
    metrics_host, metrics_port = _listen(metrics_listen, "metrics_listen") if metrics_listen else (None, 0)
    if metrics_host is not None and (metrics_host, metrics_port) == (host, port):
        raise _bad("metrics_listen", "not the boot network's listener: give another address or port")
    public_url = _str(doc, "public_url", "public_url") or ""
    media_url = _str(doc, "media_url", "media_url") or ""
    if media_url and not media_url.startswith(("http://", "https://")):
        raise _bad("media_url", "expected an http(s) URL")
    cache = doc.get("cache", {})
    if not isinstance(cache, dict):
        raise _bad("cache", "expected a table")
    max_bytes = cache.get("max_bytes", 10 * 1024**3)
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise _bad("cache.max_bytes", "expected a positive integer")
    cache_dir = _str(cache, "dir", "cache.dir") or str(Path(state_dir) / "cache")
    allow_sources = cache.get("allow_source_networks", [])
    if not isinstance(allow_sources, list) or not all(isinstance(n, str) for n in allow_sources):
        raise _bad("cache.allow_source_networks", "expected a list of networks (10.0.0.0/8, ::1/128)")
    for i, net in enumerate(allow_sources):
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise _bad(f"cache.allow_source_networks[{i}]", "expected a network like 10.0.0.0/8") from None
    netboot = doc.get("netboot", {})
    if not isinstance(netboot, dict):
        raise _bad("netboot", "expected a table")
    discovery = netboot.get("discovery", False)
    if not isinstance(discovery, bool):
        raise _bad("netboot.discovery", "expected true or false")
    for key in ("discovery_kernel", "discovery_initrd", "discovery_cmdline", "discovery_control_plane"):
        value = netboot.get(key)
        if isinstance(value, str) and IPXE_UNSAFE.search(value):
            raise _bad(f"netboot.{key}", "iPXE would act on it: no control characters, '${', '||', '&&',"
                       " or a word starting with ';' or '#'")  # fmt: skip
    quiet = netboot.get("quiet_seconds", DEFAULT_QUIET_SECONDS)
    if not isinstance(quiet, int | float) or isinstance(quiet, bool) or not 0 < quiet <= 3600:
        raise _bad("netboot.quiet_seconds", "expected seconds, more than 0 and at most 3600")
    control_plane = doc.get("control_plane_addresses", [])
    if not isinstance(control_plane, list) or not all(isinstance(a, str) for a in control_plane):
        raise _bad("control_plane_addresses", "expected a list of IP addresses")
    for i, address in enumerate(control_plane):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise _bad(f"control_plane_addresses[{i}]", "expected an IP address") from None
    bmc = doc.get("bmc", {})
    if not isinstance(bmc, dict):
        raise _bad("bmc", "expected a table")
    keep = bmc.get("credentials_keep_seconds", 300)
    if not isinstance(keep, int | float) or isinstance(keep, bool) or not 0 <= keep <= 3600:
        raise _bad("bmc.credentials_keep_seconds", "expected seconds, 0 (fetch for each command) to 3600")
    join_cert = _path(doc, "join_cert_file", "join_cert_file")
    join_key = _path(doc, "join_key_file", "join_key_file")
    if (join_cert is None) != (join_key is None):
        raise _bad(
            "join_key_file" if join_key is None else "join_cert_file",
            "give both join_cert_file and join_key_file",
        )
    return SiteAgentConfig(
        site_id=site_id,
        nats_url=nats_url,
        subject_root=subject_root,
        state_dir=Path(state_dir),
        join_token_file=Path(token_file) if token_file else None,
        http_host=host,
        http_port=port,
        public_url=public_url.rstrip("/"),
        media_url=media_url.rstrip("/"),
        cache_dir=Path(cache_dir),
        cache_max_bytes=max_bytes,
        discovery=discovery,
        discovery_kernel=_str(netboot, "discovery_kernel", "netboot.discovery_kernel"),
        discovery_initrd=_str(netboot, "discovery_initrd", "netboot.discovery_initrd"),
        discovery_cmdline=_str(netboot, "discovery_cmdline", "netboot.discovery_cmdline", "") or "",
        discovery_token_file=_path(netboot, "discovery_token_file", "netboot.discovery_token_file"),
        discovery_control_plane=_str(netboot, "discovery_control_plane", "netboot.discovery_control_plane"),
        control_plane_addresses=tuple(control_plane),
        cache_allow_source_networks=tuple(allow_sources),
        quiet_seconds=float(quiet),
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        nats_ca=_str(doc, "nats_ca", "nats_ca") or env.get("BC_NATS_CA") or None,
        join_cert_file=join_cert,
        join_key_file=join_key,
        bmc_credentials_keep_s=float(keep),
    )


def _listen(text: str, path: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise _bad(path, "expected host:port")
    return host.strip("[]") or "0.0.0.0", int(port_text)


def _path(doc: dict[str, Any], key: str, path: str) -> Path | None:
    text = _str(doc, key, path)
    return Path(text) if text else None
