"""bcx for people: contexts and their precedence, --output yaml, hints on errors, completion."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from better_compute.cli import contexts
from better_compute.cli.completion import SHELLS, script
from better_compute.cli.hints import HintContext, hint_for, site_of
from better_compute.cli.main import build_parser, main, resolve_output, settings_for
from better_compute.cli.output import json_line, use_format
from better_compute.config import Settings, env_var, setting_paths
from better_compute.core.errors import BcError, ErrorCode

LAB = "nats://127.0.0.1:4001"
EU = "nats://eu-1.example:4222"


@pytest.fixture(autouse=True)
def config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for path in setting_paths():
        monkeypatch.delenv(env_var(path), raising=False)
    for name in ("BC_CONFIG", "BC_TENANT", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "bcx" / "config.toml"
    monkeypatch.setenv("BCX_CONFIG", str(config))
    monkeypatch.chdir(tmp_path)
    yield config
    use_format("json")


def bcx(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``bcx *argv`` in this process: exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


@pytest.fixture
def two(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Path:
    """Contexts lab (current: the first one added) and eu-1 (credentials, tenant acme)."""
    creds = tmp_path / "eu-1.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert bcx(capsys, "context", "add", "lab", "--nats-url", LAB)[0] == 0
    code, _, err = bcx(
        capsys, "context", "add", "eu-1", "--nats-url", EU, "--creds", str(creds), "--tenant", "acme"
    )
    assert code == 0, err
    return creds


def resolved(*argv: str) -> tuple[Settings, str]:
    args = build_parser().parse_args(list(argv))
    selection = contexts.select(args.context)
    return settings_for(args, selection), contexts.tenant_for(args, selection)


def test_contexts_are_added_listed_used_and_removed(
    capsys: pytest.CaptureFixture[str], two: Path, config_file: Path
) -> None:
    out = bcx(capsys, "context", "list")[1]
    lines = out.splitlines()
    assert lines[0].split() == ["CURRENT", "NAME", "NATS", "URL", "TENANT", "CREDENTIALS"]
    assert lines[1].split()[:2] == ["*", "lab"]
    assert lines[2].split() == ["eu-1", EU, "acme", str(two)]
    assert bcx(capsys, "context", "use", "eu-1")[1] == "current context: eu-1\n"
    doc = json.loads(bcx(capsys, "context", "list", "--json")[1])
    assert (doc["current"], [c["name"] for c in doc["contexts"]]) == ("eu-1", ["lab", "eu-1"])
    assert oct(config_file.stat().st_mode & 0o777) == "0o600"  # it names credential files
    assert bcx(capsys, "context", "remove", "eu-1")[0] == 0
    doc = json.loads(bcx(capsys, "context", "list", "--json")[1])
    assert (doc["current"], [c["name"] for c in doc["contexts"]]) == (None, ["lab"])


def test_the_config_file_honours_xdg_config_home(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("BCX_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert bcx(capsys, "context", "add", "lab", "--nats-url", LAB)[0] == 0
    assert (tmp_path / "xdg" / "bcx" / "config.toml").is_file()


def test_precedence_flag_then_env_then_current_context_then_defaults(
    two: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, tenant = resolved("status")  # current: lab
    assert (settings.nats_url, settings.nats_creds, tenant) == (LAB, None, "root")
    monkeypatch.setenv("BC_NATS_URL", "nats://from-env:1")
    monkeypatch.setenv("BC_TENANT", "envco")
    settings, tenant = resolved("status")
    assert (settings.nats_url, tenant) == ("nats://from-env:1", "envco")  # env beats the current context
    settings, tenant = resolved("--context", "eu-1", "status")
    assert (settings.nats_url, settings.nats_creds, tenant) == (EU, str(two), "acme")  # a flag beats env
    settings, tenant = resolved("--context", "eu-1", "--nats-url", "nats://flag:2", "nodes", "create",
                                "--site", "s", "--tenant", "t")  # fmt: skip
    assert (settings.nats_url, settings.nats_creds, tenant) == ("nats://flag:2", str(two), "t")
    monkeypatch.delenv("BC_NATS_URL")
    monkeypatch.delenv("BC_TENANT")
    monkeypatch.setenv("BCX_CONFIG", str(two.parent / "none.toml"))
    settings, tenant = resolved("status")
    assert (settings.nats_url, settings.nats_creds, tenant) == (None, None, "root")  # the defaults


def test_context_show_says_where_each_setting_comes_from(
    capsys: pytest.CaptureFixture[str], two: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BC_NATS_URL", "nats://user:secret@from-env:1")
    out = bcx(capsys, "context", "show", "--json")[1]
    where = {s["setting"]: (s["value"], s["from"]) for s in json.loads(out)["settings"]}
    assert where["nats_url"] == ("nats://from-env:1", "$BC_NATS_URL")  # never the password
    assert where["tenant"] == ("root", "default")
    out = bcx(capsys, "--context", "eu-1", "context", "show", "--json")[1]
    where = {s["setting"]: (s["value"], s["from"]) for s in json.loads(out)["settings"]}
    assert where["nats_creds"] == (str(two), "context eu-1")
    assert where["tenant"] == ("acme", "context eu-1")
    assert "JWT" not in out


def test_a_context_keeps_the_bus_ca_for_its_tls_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "bus-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    code, _, err = bcx(capsys, "context", "add", "tls-1", "--nats-url", "tls://nats-1:4222", "--ca", str(ca))
    assert code == 0, err
    settings, _ = resolved("status")
    assert (settings.nats_url, settings.nats_ca) == ("tls://nats-1:4222", str(ca))
    where = {
        s["setting"]: (s["value"], s["from"])
        for s in json.loads(bcx(capsys, "context", "show", "--json")[1])["settings"]
    }
    assert where["nats_ca"] == (str(ca), "context tls-1")
    monkeypatch.setenv("BC_NATS_CA", "/etc/other-ca.pem")  # the environment wins over the current context
    assert resolved("status")[0].nats_ca == "/etc/other-ca.pem"
    code, out, _ = bcx(
        capsys, "context", "add", "tls-2", "--nats-url", "tls://n:1", "--ca", "/nope.pem", "--json"
    )
    assert code != 0
    assert '"ca"' in out


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("current = [", ""),  # not TOML
        ('current = "nope"\n', "current"),
        ("[contexts.eu-1]\n", "contexts.eu-1.nats_url"),
        ('[contexts.eu-1]\nnats_url = "http://x"\n', "contexts.eu-1.nats_url"),
        ("[contexts.eu-1]\nnats_url = 4222\n", "contexts.eu-1.nats_url"),
        ('[contexts.eu-1]\nnats_url = "nats://x:1"\ncredentials = "/c"\n', "contexts.eu-1.credentials"),
        ('[contexts.eu-1]\nnats_url = "nats://x:1"\ntenant = ""\n', "contexts.eu-1.tenant"),
        ('[contexts."eu 1"]\nnats_url = "nats://x:1"\n', "contexts.eu 1"),
        ('contexts = "x"\n', "contexts"),
        ('colour = "x"\n', "colour"),
    ],
)
def test_a_bad_config_file_is_invalid_config_naming_the_file_and_key(
    capsys: pytest.CaptureFixture[str], config_file: Path, text: str, path: str
) -> None:
    config_file.parent.mkdir(parents=True)
    config_file.write_text(text)
    with pytest.raises(BcError) as info:
        contexts.load_config()
    err = info.value
    assert (err.code, err.path, err.details["file"]) == (ErrorCode.INVALID_CONFIG, path, str(config_file))
    assert str(config_file) in err.message
    code, out, _ = bcx(capsys, "status", "--json")  # every command stops on it, before connecting
    assert code == 1
    assert json.loads(out)["error"]["details"]["path"] == path


def test_an_unknown_context_or_name_is_refused(capsys: pytest.CaptureFixture[str], two: Path) -> None:
    code, _, err = bcx(capsys, "--context", "eu-2", "status")
    assert code == 1
    assert err == f"error: NOT_FOUND: no context eu-2 in {two.parent / 'bcx' / 'config.toml'} (at context)" \
        " (hint: bcx context list)\n"  # fmt: skip
    code, out, _ = bcx(capsys, "context", "add", "eu/2", "--nats-url", EU, "--json")
    assert (code, json.loads(out)["error"]["details"]["path"]) == (1, "name")
    code, _, err = bcx(capsys, "context", "add", "lab", "--nats-url", EU)
    assert code == 1
    assert err.startswith("error: CONFLICT: context lab exists")


def test_output_yaml_is_the_json_document(capsys: pytest.CaptureFixture[str], two: Path) -> None:
    as_json = json.loads(bcx(capsys, "context", "list", "--json")[1])
    assert yaml.safe_load(bcx(capsys, "context", "list", "--output", "yaml")[1]) == as_json
    assert yaml.safe_load(bcx(capsys, "-o", "yaml", "context", "list")[1]) == as_json
    assert json.loads(bcx(capsys, "context", "list", "-o", "json")[1]) == as_json
    assert bcx(capsys, "context", "list", "-o", "table")[1].startswith("CURRENT")
    # a stream (watch, events tail) is a stream of YAML documents
    use_format("yaml")
    stream = "\n".join(json_line({"node": n, "at": 1796106600}) for n in ("a", "b")) + "\n"
    assert list(yaml.safe_load_all(stream)) == [
        {"node": "a", "at": "2026-12-01T06:30:00Z"},
        {"node": "b", "at": "2026-12-01T06:30:00Z"},
    ]


def test_json_is_an_alias_of_output_json_and_output_wins() -> None:
    for argv, want in [
        (["status"], ("table", False)),
        (["status", "--json"], ("json", True)),
        (["--json", "status", "-o", "yaml"], ("yaml", True)),
        (["status", "--output", "table"], ("table", False)),
    ]:
        args = build_parser().parse_args(argv)
        resolve_output(args)
        assert (args.output, args.json) == want, argv


def test_errors_in_yaml_carry_the_hint(capsys: pytest.CaptureFixture[str], two: Path) -> None:
    code, out, _ = bcx(capsys, "--context", "nope", "-o", "yaml", "status")
    assert code == 1
    assert yaml.safe_load(out)["error"]["hint"] == "bcx context list"


@pytest.mark.parametrize(
    ("err", "ctx", "hint"),
    [
        (BcError("NOT_FOUND", "no node n9", {"path": "id"}),
         HintContext(command=("nodes", "show"), site="lab1"), "bcx nodes list --site lab1"),
        (BcError("NOT_FOUND", "no workflow wf_1", {"path": "id"}), HintContext(command=("why",)),
         "bcx workflows list"),
        (BcError("NOT_FOUND", "no node n9", {"path": "nodeId"}), HintContext(command=("workflows", "start")),
         "bcx nodes list"),
        (BcError("NOT_FOUND", "no such batch", {"path": "id"}), HintContext(command=("batches", "get")),
         "bcx batches list"),
        (BcError("NOT_FOUND", "gone", {}), HintContext(command=("images", "get")), "bcx images list"),
        (BcError("UNAVAILABLE", "no bc-engine instance is running", {"service": "bc-engine"}),
         HintContext(command=("nodes", "list"), context="eu-1"),
         "bcx status --context eu-1 shows what answers on context eu-1"),
        (BcError("UNAVAILABLE", "cannot reach NATS at nats://x:1", {"url": "nats://x:1"}),
         HintContext(context="eu-1", nats_from="context eu-1"),
         "is NATS up there? check the NATS URL of context eu-1 (bcx context show eu-1)"),
        (BcError("UNAVAILABLE", "cannot reach NATS at nats://x:1", {"url": "nats://x:1"}),
         HintContext(nats_from="$BC_NATS_URL"), "is NATS up there? check the NATS URL from $BC_NATS_URL"),
        (BcError("UNAUTHENTICATED", "refused", {"url": "nats://x:1"}),
         HintContext(context="eu-1", creds="/c/eu-1.creds"),
         "check the credentials of context eu-1 (/c/eu-1.creds): bcx context show eu-1"),
        (BcError("PERMISSION_DENIED", "not yours", {}), HintContext(),
         "give NATS credentials: --creds FILE, $BC_NATS_CREDS, or a context (bcx context add)"),
        (BcError("INVALID_INPUT", "labels are key=value", {"path": "label"}),
         HintContext(command=("nodes", "create")), "fix label; bcx nodes create --help"),
        (BcError("INVALID_CONFIG", "bad", {"path": "contexts.eu-1.nats_url", "file": "/h/config.toml"}),
         HintContext(), "fix contexts.eu-1.nats_url in /h/config.toml"),
        (BcError("TIMEOUT", "bc.api.engine.nodes.list did not answer within 10.0s", {}),
         HintContext(command=("nodes", "list")), "bcx status shows what answers"),
        (BcError("CONFLICT", "exists", {}), HintContext(command=("nodes", "create")), None),
    ],
)  # fmt: skip
def test_errors_name_the_fix(err: BcError, ctx: HintContext, hint: str | None) -> None:
    assert hint_for(err, ctx) == hint


def test_completion_knows_every_command_group_in_every_shell() -> None:
    parser = build_parser()
    groups = [a for a in parser._subparsers._group_actions[0].choices]  # type: ignore[union-attr]
    assert {"context", "completion", "version", "nodes", "workflows"} <= set(groups)
    assert SHELLS == ("bash", "zsh", "fish")
    for shell in SHELLS:
        text = script(shell, parser)
        assert all(g in text for g in groups), shell


def _complete_in_bash(completion: str, *words: str) -> list[str]:
    """What ``bcx <words><TAB>`` offers in bash with the script loaded (COMP_WORDS as bash sets them)."""
    program = (  # as bash calls the function `complete -F` names: command, word, previous word
        'eval "$BCX_COMPLETION"; COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); '
        'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}; '
        "function=$(complete -p bcx); function=${function#*-F }; function=${function%% *}; "
        '"$function" bcx "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"; '
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(
        ["bash", "-c", program, "bash", "bcx", *words],
        capture_output=True, text=True, check=True, timeout=30,
        env={"PATH": os.environ.get("PATH", ""), "BCX_COMPLETION": completion},
    )  # fmt: skip
    return done.stdout.split()


def test_bash_completes_commands_subcommands_flags_and_choices() -> None:
    parser = build_parser()
    completion = script("bash", parser)
    assert _complete_in_bash(completion, "no") == ["nodes"]
    assert sorted(_complete_in_bash(completion, "nodes", "l")) == ["label", "list"]
    assert _complete_in_bash(completion, "--nats-url", "nats://x:1", "work") == ["workflows"]
    assert _complete_in_bash(completion, "nodes", "list", "--si") == ["--site"]
    assert set(_complete_in_bash(completion, "context", "")) == {"list", "show", "use", "add", "remove"}
    assert _complete_in_bash(completion, "-o", "y") == ["yaml"]
    assert sorted(_complete_in_bash(completion, "completion", "")) == ["bash", "fish", "zsh"]
    groups = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(_complete_in_bash(completion, "")) == set(groups)


def test_a_selector_site_is_the_hint_site() -> None:
    assert site_of(None, "site=lab1,rack=r12") == "lab1"
    assert site_of(None, "rack=r12, site = lab2") == "lab2"
    assert site_of("lab3", "site=lab1") == "lab3"
    assert site_of(None, "rack=r12") is None
    assert site_of(None, "campsite=x") is None
