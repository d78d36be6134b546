"""Every ``bcx …`` example of README.md and docs/*.md, checked against bcx itself, so the docs
cannot drift from what bcx does (issue 26).

* Every example is parsed by bcx's own parser (``parse_line``, no services: milliseconds each).
  A synopsis line (``bcx inspect|commission node_… [--profile P]``) is counted, not parsed.
* Every example not marked ``<!-- doctest: skip (reason) -->`` on the line before its code block
  runs against one stack started for this module's one test (bc-pki, bc-command-queue with a
  quorum, bc-engine as processes; bc-secrets only once the rest ran, as the examples that show
  it missing expect: a block handing it a credential, ``--bmc-credentials-file``, runs then)
  and the world the docs name (``_world``): nodes (three at eu1, ``lab1-m001``, two at lab2
  whose power-on waits for an agent), an enrollment rule, an open batch, the image signer
  ``acme-release`` and the files ``ubuntu.raw``, ``ed25519.pem`` and ``release.pem`` (its key),
  ``ci.pub``, ``idrac.json``, ``.state/ramdisk/{vmlinuz,initrd.img}``. A placeholder the docs
  write (``node_…``, ``rule_…``, ``batch_01J…``, the author's ids of docs/engine.md's ``bcx
  why`` and ``workflows abort``, ``$KEY``) is the id of that thing in the world, in the command
  and in the output shown; ``~/`` is a home of the test's own, and so are the author's
  ``/home/me`` (its ``.config/bcx/config.toml`` is docs/bcx.md's, which ``BCX_CONFIG`` names for
  ``bcx context show``) and the site agent's ``/etc/bc-site-agent``. A code block's examples
  run in order, as a reader would paste them, in a folder of the block's own holding the
  files; what one changes that the next
  needs an operator would do by hand follows it (``World.after``: the key ``batches keygen``
  made becomes an approver's, in the approvers file the command queue reads again).
* A ``$ bcx …`` line of a console block followed by output must print that output's first
  line: an error's ``error: CODE: message`` (the hint, which names the reader's context, aside),
  a table's header, or the sentence shown; any other example must exit 0.
* Each run is its own process, forked from one that imported bcx once (``BcxForks``, two at a
  time), so a run costs its requests, not Python's start.

The test prints how many examples ran, were parsed only and were skipped, with each reason: 49
of 88 run, the rest need the simulated fleet, a plugin installed, a feed followed until
interrupted, or are synopsis lines. It takes about 27 s on the loaded two-core machine (24 s
with 41 runs and no bc-secrets before: bc-secrets' start and the late block cost 2-3 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shlex
import shutil
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.cli.main import parse_line
from better_compute.clients import CommandQueueClient, EngineClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import BcxForks, BcxRun, ServiceProcesses, until
from better_compute.testing.approvers import approver_keys, write_approvers

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
SKIP = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>.*)\)\s*-->\s*$")
# a bcx command line: `bcx …`, `$ bcx …`, after variables and `uv run [--frozen]`
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:uv run (?:--frozen )?)?bcx(?:\s|$)")
# a synopsis word: [optional], a[:part], one|other (a value in quotes or with = is taken as is)
SYNOPSIS = re.compile(r"^\[|\]$|\w\[|^[\w.-]+(\|[\w.-]+)+$")


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    argv: tuple[str, ...]  # after "bcx"
    shown: str | None  # the first line of output shown under it (console blocks), else None
    skip: str | None  # why it does not run here (the marker's reason)
    block: str = ""  # file:line of its code block (a block's examples run in order)

    @property
    def synopsis(self) -> bool:
        return any(SYNOPSIS.search(word) for word in self.argv)


def _argv(line: str) -> tuple[str, ...]:
    words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    words = words[words.index("bcx") + 1 :]
    for stop in ("|", ">", ">>", "&&", ";"):  # the shell's part of the line
        if stop in words:
            words = words[: words.index(stop)]
    return tuple(words)


def _block(lines: list[str], start: int, name: str, skip: str | None) -> list[Example]:
    """The examples of the code block whose first line (after the fence) is ``lines[start]``."""
    end = next(i for i in range(start, len(lines)) if FENCE.match(lines[i]))
    body = lines[start:end]
    console = any(line.lstrip().startswith("$ ") for line in body)
    out: list[Example] = []
    i = 0
    while i < len(body):
        line = body[i]
        i += 1
        if console and not line.lstrip().startswith("$ "):
            continue
        if not COMMAND.match(line):
            continue
        where = f"{name}:{start + i}"
        while line.rstrip().endswith("\\") and i < len(body):  # a continued line
            line = line.rstrip()[:-1] + " " + body[i].strip()
            i += 1
        shown = None
        if console and i < len(body) and not body[i].lstrip().startswith("$ "):
            shown = body[i].rstrip() or None
        out.append(Example(where, _argv(line), shown, skip, block=f"{name}:{start}"))
    return out


def examples() -> list[Example]:
    found: list[Example] = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        name = str(path.relative_to(ROOT))
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                before = lines[i - 1] if i else ""
                marker = SKIP.match(before)
                found += _block(lines, i + 1, name, marker["reason"] if marker else None)
                i = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])) + 1
            else:
                i += 1
    return found


def _parse_error(argv: tuple[str, ...]) -> str | None:
    """What bcx's parser says against ``argv``, or None when it takes it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser, _args, unknown = parse_line(list(argv))
    except SystemExit as exit_:
        if exit_.code == 0:  # --help
            return None
        return (err.getvalue().strip().splitlines() or [f"exit {exit_.code}"])[-1]
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def test_the_docs_have_bcx_examples_and_every_skip_says_why() -> None:
    found = examples()
    assert len(found) > 50, "the extraction found too few examples: the pattern broke"
    assert all(e.skip.strip() for e in found if e.skip is not None)


def test_every_example_is_a_command_line_bcx_takes() -> None:
    """Command and flag names as the docs show them exist, with the values they take."""
    bad = [f"{e.where}: bcx {shlex.join(e.argv)}: {err}" for e in examples()
           if not e.synopsis and (err := _parse_error(e.argv)) is not None]  # fmt: skip
    assert bad == []


async def test_every_runnable_example_does_what_its_doc_shows(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    world = await _world(bc_settings, bc_api, bc_processes, tmp_path)
    found = examples()
    runnable = [e for e in found if e.skip is None]
    blocks: dict[str, list[Example]] = {}
    late: dict[str, list[Example]] = {}  # a block handing a credential to bc-secrets
    for e in runnable:
        blocks.setdefault(e.block, []).append(e)
    for block in [b for b, todo in blocks.items() if any(_needs_secrets(e) for e in todo)]:
        late[block] = blocks.pop(block)
    lanes = asyncio.Queue[BcxForks]()
    forks = [BcxForks(bc_settings, env={"HOME": str(world.home)}) for _ in range(2)]
    for fork in forks:
        lanes.put_nowait(fork)

    async def run_block(block: str, todo: list[Example]) -> list[str]:
        """A block's examples in order, in a folder of its own holding the files the docs name."""
        cwd = tmp_path / "blocks" / re.sub(r"[^\w.-]", "_", block)
        shutil.copytree(world.files, cwd)
        fork = await lanes.get()
        failures = []
        try:
            for e in todo:
                argv = world.fill_argv(e.argv)
                run = await fork.bcx(*argv, cwd=str(cwd), env=world.env.get(e.argv[:2]), timeout=60)
                shown = world.fill(e.shown) if e.shown is not None else None
                failure = _differs(replace(e, shown=shown), run.returncode, run.stdout, run.stderr)
                if failure is not None:
                    failures.append(f"{e.where}: bcx {shlex.join(argv)}: {failure}")
                after = world.after.get(e.argv[:2])
                if after is not None:
                    await after(run)
        finally:
            lanes.put_nowait(fork)
        return failures

    try:
        done = await asyncio.gather(*(run_block(b, todo) for b, todo in blocks.items()))
        # bc-secrets only now: the examples that show it missing have run
        bc_processes.start("bc-secrets")
        await bc_processes.wait_ready()
        done += await asyncio.gather(*(run_block(b, todo) for b, todo in late.items()))
    finally:
        for fork in forks:
            fork.close()
    failures = [f for block in done for f in block]
    reasons = Counter(e.skip for e in found if e.skip is not None)
    print(
        f"\ndoc examples: {len(found)}; ran {len(runnable)}, parsed only {len(found) - len(runnable)}"
        f" ({sum(e.synopsis for e in found)} synopsis lines not parsed); skipped by reason:"
    )
    for reason, n in reasons.most_common():
        print(f"  {n:3}  {reason}")
    assert failures == [], "\n".join(failures)


def _needs_secrets(e: Example) -> bool:
    """Whether ``e`` stores a credential through bc-secrets (the stack starts it last)."""
    return "--bmc-credentials-file" in e.argv


@dataclass
class World:
    """What the examples run against besides the stack: the files they name (each block gets a
    copy), the ids their placeholders stand for, and what follows an example (``after``)."""

    home: Path
    files: Path
    ids: dict[str, str]
    after: dict[tuple[str, ...], Callable[[BcxRun], Awaitable[None]]] = field(default_factory=dict)
    env: dict[tuple[str, ...], dict[str, str]] = field(default_factory=dict)  # a command's environment

    def fill(self, text: str) -> str:
        """``text`` with each placeholder (``node_…``) as the id it stands for."""
        for placeholder in sorted(self.ids, key=len, reverse=True):
            text = text.replace(placeholder, self.ids[placeholder])
        return text

    def fill_argv(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        """The argv a shell would run: placeholders filled, a leading ``~/`` made ``$HOME/``."""
        return tuple(str(self.home / w[2:]) if w.startswith("~/") else self.fill(w) for w in argv)


async def _world(settings: Settings, api: ApiClient, processes: ServiceProcesses, tmp_path: Path) -> World:
    """The stack (bc-pki, bc-command-queue with a quorum of one approver, bc-engine; no
    bc-secrets, as the examples that show it missing expect) and what the examples name:
    three enrolled nodes at eu1 (the lists page through them), ``lab1-m001`` in rack r12 of lab1,
    an enrollment rule, an open batch, the image signer ``acme-release``, and the files
    ``ubuntu.raw``, ``ed25519.pem`` (acme-release's key) and ``ci.pub``."""
    home, files = tmp_path / "home", tmp_path / "files"
    (home / ".bc").mkdir(parents=True)
    files.mkdir()
    carol = approver_keys(["carol"])
    approvers = write_approvers(tmp_path / "approvers.toml", carol, threshold=1)
    processes.extra_env.update(BC_CMDQ_QUORUM_FILE=str(approvers), BC_CMDQ_SWEEP="200ms")
    for name in ("bc-pki", "bc-command-queue", "bc-engine"):
        processes.start(name)
    await processes.wait_ready()
    nodes = []
    for i in range(3):  # what the lists' examples page through
        node = await api.call("engine", "metal.enroll", {"siteId": "eu1", "labels": {"rack": f"r{i}"}})
        nodes.append(node["id"])
    await api.call(
        "engine", "metal.enroll", {"siteId": "lab1", "labels": {"rack": "r12"}, "name": "lab1-m001"}
    )
    engine, cq = EngineClient(api), CommandQueueClient(api)
    # a workflow waiting for its site's agent (lab2 has none): what `bcx why` explains
    waiting = await api.call(
        "engine", "metal.enroll", {"siteId": "lab2", "bmc": {"driver": "sim", "address": "bmc-lab2"}}
    )
    powering = await api.call("engine", "metal.power", {"nodeId": waiting["id"], "action": "on"})
    # another, for docs/engine.md's `bcx workflows abort` (the why example's stays running)
    stuck = await api.call(
        "engine", "metal.enroll", {"siteId": "lab2", "bmc": {"driver": "sim", "address": "bmc-lab2-2"}}
    )
    aborting = await api.call("engine", "metal.power", {"nodeId": stuck["id"], "action": "on"})
    rule = await engine.create_enrollment_rule(
        name="docs", selector="inventory.cpu_cores>=512", site_id="lab1"
    )
    batch = await cq.create_batch(
        kinds=["node.wipe"], nodes=nodes[:1], ttl_seconds=3600, note="the docs' batch"
    )
    signer = ed25519.Ed25519PrivateKey.generate()
    (files / "ed25519.pem").write_bytes(
        signer.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    public = signer.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    await engine.add_image_signer(id="acme-release", public_key=public.decode())
    ci = ed25519.Ed25519PrivateKey.generate().public_key()
    (files / "ci.pub").write_bytes(
        ci.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (files / "ubuntu.raw").write_bytes(b"\x00" * 4096 + b"ubuntu 24.04")
    (files / "release.pem").write_bytes((files / "ed25519.pem").read_bytes())  # acme-release's too
    ramdisk = files / ".state" / "ramdisk"  # what `bcx ramdisk build` writes, for the signing
    ramdisk.mkdir(parents=True)
    (ramdisk / "vmlinuz").write_bytes(b"MZ" + b"\x00" * 4094)
    (ramdisk / "initrd.img").write_bytes(b"070701" + b"\x00" * 4090)
    (files / "idrac.json").write_text('{"username": "root", "password": "calvin"}')
    etc = tmp_path / "etc" / "bc-site-agent"  # the site agent's folder of docs/metal.md
    etc.mkdir(parents=True)
    # docs/bcx.md's context file, as it shows it, in the test's home (BCX_CONFIG names it)
    contexts = home / ".config" / "bcx" / "config.toml"
    contexts.parent.mkdir(parents=True)
    toml = (ROOT / "docs" / "bcx.md").read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    contexts.write_text(toml.replace("/home/me", str(home)))

    async def approver_added(run: BcxRun) -> None:
        """After ``bcx batches keygen``: its key is alice's, in the approvers file (read again
        while the command queue runs), as an operator would send it to be configured."""
        assert run.returncode == 0, run.stderr
        alice = serialization.load_pem_private_key((home / ".bc/approver.pem").read_bytes(), password=None)
        assert isinstance(alice, ed25519.Ed25519PrivateKey)
        staged = write_approvers(tmp_path / "approvers.next", {**carol, "alice": alice}, threshold=1)
        os.replace(staged, approvers)

        async def in_force() -> bool:
            return "alice" in [a.id for a in (await cq.quorum()).approvers]

        await until(in_force, timeout=30, what="alice an approver")

    return World(
        home=home,
        files=files,
        ids={"node_…": nodes[0], "node_01…": nodes[0], "node_01J…": nodes[0], "rule_…": rule.id,
             "batch_01J…": batch.id,
             # the author's ids in docs/engine.md's `bcx why` (its output is the author's)
             "node_01M8RSW0Q1DY63NMWG4W8Z57YX": waiting["id"],
             "wf_01M8RSW0T4G53QNA7BJ6ZAK3Z4": powering["workflowId"],
             "wf_01M950WK8GWNWJD5X0J54N7YRN": aborting["workflowId"],
             # a machine's paths and the shell's variables, as the test's own
             "/home/me": str(home), "/etc/bc-site-agent": str(etc), "$KEY": "5f3c0a9e1b7d4c2a"},
        after={("batches", "keygen"): approver_added},
        env={("context", "show"): {"BCX_CONFIG": str(contexts)}},
    )  # fmt: skip


def _differs(e: Example, code: int, stdout: str, stderr: str) -> str | None:
    """How the run differs from what the doc shows, or None."""
    if e.shown is not None and e.shown.startswith("error: "):
        want = e.shown.split(" (hint: ")[0]
        got = (stderr.splitlines() or [""])[0].split(" (hint: ")[0]
        return None if (code, got) == (1, want) else f"exit {code}, {got!r}; the doc shows {want!r}"
    if e.shown is not None and e.shown.split()[0].isupper():  # a table's header
        got_header = (stdout.splitlines() or [""])[0].split()
        if got_header == e.shown.split():
            return None
        return f"header {got_header}; the doc shows {e.shown.split()} (exit {code}: {stderr.strip()[-200:]})"
    if code != 0:
        return f"exit {code}: {(stderr or stdout).strip()[-300:]}"
    first = (stdout.splitlines() or [""])[0].rstrip()
    if e.shown is not None and not e.shown.startswith("{") and first != e.shown:  # a sentence
        return f"prints {first!r}; the doc shows {e.shown!r}"
    if "--json" in e.argv:
        msgspec.json.decode(stdout)  # JSON as promised
    return None
