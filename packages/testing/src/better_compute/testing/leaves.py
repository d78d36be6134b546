"""``SiteLeaves``: a hub nats-server and one leaf nats-server per site, each leaf's link to the hub
through a ``TcpGate`` a test can cut.

The shape of deploy/nats without its TLS and accounts: the services and operators connect to the
hub, which runs JetStream (every site's command stream, as in deploy/, where the streams live on
the hub cluster); a site's agents (its site agent, every bcd) connect to their site's leaf, which
runs no JetStream and passes their pull requests, acks and requests up its link. Cutting a site's
gate is what a lost WAN link looks like: the leaf and everything at the site keep running, and
nothing crosses until the gate heals (the leaf dials the hub again by itself).

The default stacks (the session's one nats-server) are untouched: a test asks for this one.

>>> leaves = SiteLeaves(tmp_path / "nats", ["lab1", "lab2"]).start()
>>> leaves.hub_url, leaves.url("lab2")          # services, then lab2's agents
>>> leaves.gate("lab2").cut(3600); ...; leaves.gate("lab2").heal()
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.embedded import free_port, nats_server_binary, spawn_detached, stop_pid, wait_port
from .guard import unwatch, watch
from .metal_sim.gate import TcpGate

__all__ = ["SiteLeaves"]

_WAIT = 20.0


@dataclass
class _Server:
    name: str
    port: int
    monitor: int
    pid: int | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def varz(self, path: str) -> dict[str, object]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}{path}", timeout=2) as resp:
            body: dict[str, object] = json.loads(resp.read())
            return body


@dataclass
class SiteLeaves:
    """The hub (``hub_url``) and each site's leaf (``url(site)``), its link cut with ``gate(site)``."""

    folder: Path
    sites: list[str]
    domains: bool = False
    """Each leaf runs JetStream in a domain of its own, named after its site (deploy/nats's
    leaf-domain mode): the site's streams live on its leaf (``cmdq.site_domain = "{site}"``)."""
    hub: _Server = field(init=False)
    leaves: dict[str, _Server] = field(init=False, default_factory=dict)
    gates: dict[str, TcpGate] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.hub = _Server("bc-hub", free_port(), free_port())

    @property
    def hub_url(self) -> str:
        return self.hub.url

    def url(self, site: str) -> str:
        return self.leaves[site].url

    def gate(self, site: str) -> TcpGate:
        return self.gates[site]

    def _spawn(self, server: _Server, conf: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{server.name}.conf"
        path.write_text(conf)
        server.pid = spawn_detached(
            [str(nats_server_binary()), "-c", str(path)], self.folder / f"{server.name}.log"
        )
        watch(server.pid)
        wait_port(server.port, timeout=_WAIT, pid=server.pid)

    def start(self) -> SiteLeaves:
        """Start the hub, then each site's gate and leaf; wait until every leaf is linked. On a
        failure, what started is stopped again."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        leaf_port = free_port()
        self._spawn(
            self.hub,
            f'server_name: "{self.hub.name}"\nlisten: "127.0.0.1:{self.hub.port}"\n'
            f'http: "127.0.0.1:{self.hub.monitor}"\nmax_payload: 8MB\n'
            f'jetstream {{\n  store_dir: "{self.folder / "hub-js"}"\n  max_file_store: 1T\n'
            "  domain: hub\n}\n"
            # no_advertise: a leaf would otherwise learn the hub's own leaf port and dial it
            # past the gate (deploy/nats/hub.conf has it too)
            f'leafnodes {{\n  listen: "127.0.0.1:{leaf_port}"\n  no_advertise: true\n}}\n',
        )
        for site in self.sites:
            gate = self.gates[site] = TcpGate(f"nats-leaf://127.0.0.1:{leaf_port}").start()
            leaf = self.leaves[site] = _Server(f"bc-leaf-{site}", free_port(), free_port())
            # nats-server passes no plain $JS.API over a leaf link: without a JetStream of its
            # own the leaf sends its agents' JetStream calls to the hub's domain, as
            # deploy/nats/leaf-site.conf does; with one (``domains``) they stay on the leaf,
            # and the hub reaches it as $JS.<site>.API. reconnect: how soon the leaf dials the
            # hub again once its link is back
            js = (
                f'jetstream {{\n  store_dir: "{self.folder / f"leaf-{site}-js"}"\n'
                f"  max_file_store: 1T\n  domain: {site}\n}}\n"
                if self.domains
                else 'mappings: { "$JS.API.>": "$JS.hub.API.>" }\n'
            )
            self._spawn(
                leaf,
                f'server_name: "{leaf.name}"\nlisten: "127.0.0.1:{leaf.port}"\n'
                f'http: "127.0.0.1:{leaf.monitor}"\nmax_payload: 8MB\n{js}'
                f'leafnodes {{\n  reconnect: "1s"\n  remotes: [ {{ url: "{gate.url}" }} ]\n}}\n',
            )
        self.wait_linked(*self.sites)

    def linked(self, site: str) -> bool:
        """Whether the site's leaf has its link to the hub up (its /leafz lists it)."""
        try:
            body = self.leaves[site].varz("/leafz")
        except OSError:
            return False
        return bool(body.get("leafnodes"))

    def wait_linked(self, *sites: str, timeout: float = _WAIT) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.linked(s) for s in sites):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"leaf links not up after {timeout}s: {[s for s in sites if not self.linked(s)]}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        for gate in self.gates.values():
            gate.close()
        for server in [*self.leaves.values(), self.hub]:
            if server.pid is not None:
                stop_pid(server.pid, grace=5.0)
                unwatch(server.pid)
                server.pid = None

    def __enter__(self) -> SiteLeaves:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
