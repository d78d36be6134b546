"""``bc-site-agent`` as an OS process for tests: its config, state folder and logs in one folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..files import atomic_write
from ..runtime.embedded import free_port
from ..service.client import ApiClient
from .guard import watch
from .processes import spawn_forked
from .waiting import until
from .zygote import ZygoteProc

__all__ = ["SiteAgentProcess"]


@dataclass
class SiteAgentProcess:
    folder: Path
    nats_url: str
    subject_root: str
    site_id: str
    discovery: bool = False
    extra_config: str = ""
    public_url: str | None = None
    """How machines reach the agent's HTTP (``http://10.0.2.2:<port>`` from a QEMU guest)."""
    media_url: str | None = None
    """How the BMCs reach it, for the ramdisk's token media (``media_url``; the BMC emulators
    run on this machine's loopback even when the machines are QEMU guests)."""
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    quiet_seconds: float = 0.5
    """How long a served node entry must see no other ask before it closes clean (the agent's
    ``netboot.quiet_seconds``; production's is 120 s). The simulated machines ask as they power
    on, so the honest path waits for nothing; a test that plays a thief gives more."""
    proc: subprocess.Popen[bytes] | ZygoteProc | None = None
    logs: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """More environment for the process (``BC_KILL_AT``…), from its next start."""
    log_level: str = "debug"
    """The tests read its debug lines; a benchmark runs it at a deployment's ``info``."""

    @property
    def state_dir(self) -> Path:
        return self.folder / "state"

    @property
    def config_file(self) -> Path:
        return self.folder / "site-agent.toml"

    @property
    def token_file(self) -> Path:
        return self.folder / "join-token"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def write_config(self, token: str | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if token is not None:
            atomic_write(self.token_file, token + "\n")
        self.config_file.write_text(
            f'site_id = "{self.site_id}"\n'
            f'nats_url = "{self.nats_url}"\n'
            f'subject_root = "{self.subject_root}"\n'
            f'state_dir = "{self.state_dir}"\n'
            f'join_token_file = "{self.token_file}"\n'
            f'http_listen = "127.0.0.1:{self.port}"\n'
            f'metrics_listen = "127.0.0.1:{self.metrics_port}"\n'
            + (f'public_url = "{self.public_url}"\n' if self.public_url else "")
            + (f'media_url = "{self.media_url}"\n' if self.media_url else "")
            # the test bed's image and kernel servers listen on loopback
            + '[cache]\nallow_source_networks = ["127.0.0.0/8", "::1/128"]\n'
            + f"[netboot]\ndiscovery = {'true' if self.discovery else 'false'}\n"
            + f"quiet_seconds = {self.quiet_seconds}\n"
            + self.extra_config
        )

    def start(self) -> None:
        log = self.folder / f"agent-{len(self.logs)}.log"
        self.logs.append(log)
        argv = ["bc_site_agent", "--config", str(self.config_file), "--log-level", self.log_level]
        env = {**os.environ, "BC_LOG_JSON": "1", **self.env}
        with open(log, "wb") as out:
            # forked from the test process's service fork server where it can be (processes.py)
            self.proc = spawn_forked(argv, env=env, log=log) or subprocess.Popen(
                [sys.executable, "-m", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        watch(self.proc.pid)  # stopped with the test run, even a SIGKILLed one

    async def join(self, api: ApiClient, *, tenant_id: str = "root", timeout: float = 180) -> None:
        """Give it a site join token, start it and wait until the command queue shows it
        connected; fails at once, with its log, if the process exits first."""
        from ..clients import CommandQueueClient, PkiClient

        token = await PkiClient(api).issue_join_token(
            tenant_id=tenant_id, role="site", site_id=self.site_id, ttl_seconds=600
        )
        self.write_config(token.token)
        self.start()
        cq = CommandQueueClient(api)

        async def connected() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"the site agent exited ({self.proc.returncode}) before it connected:\n"
                    + self.output()[-4000:]
                )
            return any(a.role == "site" for a in await cq.agents(site_id=self.site_id, connected=True))

        try:
            up: bool = await until(connected, timeout=timeout, what="the site agent connected")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the site agent's log ---\n{self.output()[-4000:]}") from None
        assert up

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def files(self) -> list[Path]:
        """Every file the agent wrote (state folder, logs)."""
        return [p for p in self.folder.rglob("*") if p.is_file()]
