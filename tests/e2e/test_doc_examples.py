"""Every ``bcx …`` example of README.md and docs/*.md, checked against bcx itself, so the docs
cannot drift from what bcx does (issue 26).

* Every example is parsed by bcx's own parser (``parse_line``, no services: milliseconds each).
  A synopsis line (``bcx inspect|commission node_… [--profile P]``) is counted, not parsed.
* Every example not marked ``<!-- doctest: skip (reason) -->`` or ``<!-- doctest: long (reason)
  -->`` on the line before its code block runs against one stack started for this module's one test
  (bc-pki, bc-command-queue with a quorum, bc-engine as processes; bc-secrets only once the rest
  ran, as the examples that show it missing expect: a block handing it a credential,
  ``--bmc-credentials-file``, runs then) and the world the docs name (``_world``): nodes (three at
  eu1, ``lab1-m001``, two at lab2 whose power-on waits for an agent), an enrollment rule, an open
  batch, the image signer ``acme-release`` and the files ``ubuntu.raw``, ``ed25519.pem`` and
  ``release.pem`` (its key), ``ci.pub``, ``idrac.json``, ``.state/ramdisk/{vmlinuz,initrd.img}``. A
  placeholder the docs write (``node_…``, ``rule_…``, ``batch_01J…``, the author's ids of
  docs/engine.md's ``bcx why`` and ``workflows abort``, ``$KEY``) is the id of that thing in the
  world, in the command and in the output shown; ``~/`` is a home of the test's own, and so are the
  author's ``/home/me`` (its ``.config/bcx/config.toml`` is docs/bcx.md's, which ``BCX_CONFIG``
  names for ``bcx context show``) and the site agent's ``/etc/bc-site-agent``. A code block's
  examples run in order, as a reader would paste them, in a folder of the block's own holding the
  files; what one changes that the next needs an operator would do by hand follows it
  (``World.after``: the key ``batches keygen`` made becomes an approver's, in the approvers file the
  command queue reads again).
* A ``$ bcx …`` line of a console block followed by output must print that output's first
  line: an error's ``error: CODE: message`` (the hint, which names the reader's context, aside),
  a table's header, or the sentence shown; any other example must exit 0.
* Each run is its own process, forked from one that imported bcx once (``BcxForks``, two at a
  time), so a run costs its requests, not Python's start.
* A block marked ``long`` needs the simulated fleet or an installed plugin: the long test
  (``make test-long``) runs those with the same machinery against the stack, fleet and plugin
  its first block starts (docs/fleet-demo.md's ``bcx dev up``, ``bcx sim up --enroll``).

A block marked ``synopsis`` is a grammar (``bcx nodes power on|off|cycle N [--wait]``): each line
is parsed in two forms (its [optional] parts left out, then all in; the first of ``a|b``), and
each command it names must be run for real by an example somewhere (here, in the long test, or
by its own test). A block marked ``by tests/…/test_x.py`` is run by that test, which reads the
lines from the doc (its ``doc_examples()``; checked here to be the block's): README's first
machine by test_quickstart (long, a stack of its own), docs/metal.md's confirmation of a pending
rule enrolment by test_metal_enrollment_rules (a discovery boot), docs/plugins.md's acme profile
by test_plugins (a simulated bcd). ``bcx events tail``, which follows the feed, gets the
reader's Ctrl-C once it printed (or after 3 s) and must end with 130 and no traceback.

A ``yaml`` block whose first line is ``# name.yaml: …`` is a file the reader saves: both tests
write it into the examples' folder (docs/plugins.md's ``memory-now.yaml``).

The tests print how many examples ran where: of 101, 59 run in ``make test``, 16 in ``make
test-long``, 10 by their own tests, 14 are synopsis lines; 2 are parsed only, the whole fleet's
deploy rollout (minutes: make demo runs it; test_rollout_watch runs ``bulk … --watch`` and
``nodes watch`` on test profiles). The short test took 32-37 s at a load of 15-20 on the two
cores (18-27 s before at lower load; the events examples wait for their first line, at most
3 s); the long one 172-248 s at a load of 20, the ramdisk cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
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
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.cli.main import parse_line
from better_compute.clients import CommandQueueClient, EngineClient
from better_compute.config import Settings
from better_compute.runtime.ramdisk import default_cache_dir
from better_compute.service import ApiClient
from better_compute.testing import BcxForks, BcxRun, ServiceProcesses, until
from better_compute.testing.approvers import approver_keys, write_approvers
from plugin_install import uv_install

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
# a block's marker: `skip (why it runs nowhere)`, `long (what it needs)`: the simulated fleet's
# test; `synopsis (what)`: a grammar, each form parsed and each command run by another example;
# `by tests/…/test_x.py (why)`: that test runs the block's lines, read from the doc (``doc_examples``)
SKIP = re.compile(
    r"^\s*<!--\s*doctest:\s*(?P<how>skip|long|synopsis|by (?P<test>tests/\S+\.py))"
    r"\s*\((?P<reason>.*)\)\s*-->\s*$"
)
# a bcx command line: `bcx …`, `$ bcx …`, after variables and `uv run [--frozen]`
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:uv run (?:--frozen )?)?bcx(?:\s|$)")
# a synopsis word: [optional], a[:part], one|other (a value in quotes or with = is taken as is)
SYNOPSIS = re.compile(r"^\[|\]$|\w\[|^[\w.-]+(\|[\w.-]+)+$")
ALTERNATIVES = re.compile(r"[\w.-]+(\|[\w.-]+)+")
COMMAND_WORD = re.compile(r"[a-z][a-z-]*(\|[a-z][a-z-]*)*")  # `nodes`, `on|off|cycle`; not `lab1-m001`


@dataclass(frozen=True)
class Example:
    where: str  # file:line
    argv: tuple[str, ...]  # after "bcx"
    shown: str | None  # the first line of output shown under it (console blocks), else None
    skip: str | None  # why it does not run here (the marker's reason)
    block: str = ""  # file:line of its code block (a block's examples run in order)
    long: str | None = None  # what it needs of the simulated fleet (marker `long`): the long test
    grammar: str | None = None  # marker `synopsis`: parsed in each form, its commands run elsewhere
    by: str | None = None  # marker `by tests/…py`: the test that runs it (read from the doc)

    @property
    def here(self) -> bool:
        """Whether it runs in ``make test``'s test (no marker)."""
        return self.skip is None and self.long is None and self.grammar is None and self.by is None

    @property
    def runs(self) -> bool:
        """Whether some test runs it for real (here, in the long test, or its own)."""
        return self.here or self.long is not None or self.by is not None

    @property
    def synopsis(self) -> bool:
        return self.grammar is not None or any(SYNOPSIS.search(word) for word in self.argv)

    def forms(self) -> list[tuple[str, ...]]:
        """A synopsis line as command lines: its [optional] parts left out, then all in; the first
        of alternatives (``a|b``)."""
        text = "\x00".join(self.argv)
        found = []
        for form in (re.sub(r"\[[^\[\]]*\]", "", text), text.replace("[", "").replace("]", "")):
            words = [w for w in form.split("\x00") if w]
            words = [w.split("|")[0] if ALTERNATIVES.fullmatch(w) else w for w in words]
            found.append(tuple("1" if w == "N" else w for w in words))  # N: a number
        return found

    def commands(self) -> list[tuple[str, ...]]:
        """The commands a synopsis line names (``inspect|commission node_…``: both), each the words
        before its first argument or flag."""
        head: list[list[str]] = [[]]
        for word in self.argv:
            if word.startswith("-") or not COMMAND_WORD.fullmatch(word):
                break
            head = [[*h, alt] for h in head for alt in word.split("|")]
        return [tuple(h) for h in head]


def _argv(line: str) -> tuple[str, ...]:
    words = shlex.split(line.strip().removeprefix("$ "), comments=True)
    words = words[words.index("bcx") + 1 :]
    for stop in ("|", ">", ">>", "&&", ";"):  # the shell's part of the line
        if stop in words:
            words = words[: words.index(stop)]
    return tuple(words)


def _block(lines: list[str], start: int, name: str, marker: dict[str, str | None]) -> list[Example]:
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
        out.append(Example(where, _argv(line), shown, block=f"{name}:{start}", **marker))  # type: ignore[arg-type]
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
                found += _block(lines, i + 1, name, _marker(before))
                i = next(j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])) + 1
            else:
                i += 1
    return found


def _marker(line: str) -> dict[str, str | None]:
    """What the marker line before a block says: Example's ``skip``, ``long``, ``grammar``, ``by``."""
    marker = SKIP.match(line)
    how, reason = (marker["how"], marker["reason"]) if marker else (None, None)
    return {
        "skip": reason if how == "skip" else None,
        "long": reason if how == "long" else None,
        "grammar": reason if how == "synopsis" else None,
        "by": marker["test"] if marker and marker["test"] else None,
    }


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
    assert all(e.long.strip() for e in found if e.long is not None)


def test_every_example_is_a_command_line_bcx_takes() -> None:
    """Command and flag names as the docs show them exist, with the values they take; a
    synopsis's in each of its forms (its options left out, then all in)."""
    found = examples()
    assert all(e.grammar is not None for e in found if e.synopsis), [
        e.where for e in found if e.synopsis and e.grammar is None
    ]  # a line with [optional] parts or a|b sits in a block marked synopsis
    bad = [f"{e.where}: bcx {shlex.join(argv)}: {err}" for e in found
           for argv in (e.forms() if e.synopsis else [e.argv])
           if (err := _parse_error(argv)) is not None]  # fmt: skip
    assert bad == []


def test_every_command_of_a_synopsis_runs_in_an_example() -> None:
    """A synopsis is a grammar, not a command: each command it names (``bcx nodes power
    on|off|cycle …``: all three) is run for real by an example of README or docs/ (make test,
    make test-long, or the test that runs its block), so none is only ever parsed."""
    found = examples()
    ran = [e.argv for e in found if e.runs]
    missing = [
        f"{e.where}: bcx {' '.join(command)}"
        for e in found
        if e.grammar is not None
        for command in e.commands()
        if not any(argv[: len(command)] == command for argv in ran)
    ]
    assert missing == []


def test_a_block_run_by_its_own_test_is_what_that_test_runs() -> None:
    """A block marked ``by tests/…/test_x.py`` is run by that test, which reads it from the doc
    (its ``doc_examples()``): the lines it runs are the block's."""
    found = examples()
    by: dict[str, list[Example]] = {}
    for e in found:
        if e.by is not None:
            by.setdefault(e.by, []).append(e)
    assert by, "no block is run by its own test"
    for test, todo in by.items():
        spec = importlib.util.spec_from_file_location(Path(test).stem, ROOT / test)
        assert spec is not None, test
        assert spec.loader is not None, test
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        runs = [_argv(line) for line in module.doc_examples() if COMMAND.match(line)]
        assert runs == [e.argv for e in todo], (
            f"{test} runs {runs}; the doc's block has {[e.argv for e in todo]}"
        )


async def test_every_runnable_example_does_what_its_doc_shows(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> None:
    world = await _world(bc_settings, bc_api, bc_processes, tmp_path)
    found = examples()
    blocks: dict[str, list[Example]] = {}
    late: dict[str, list[Example]] = {}  # a block handing a credential to bc-secrets
    for e in found:
        if e.here:
            blocks.setdefault(e.block, []).append(e)
    for block in [b for b, todo in blocks.items() if any(_needs_secrets(e) for e in todo)]:
        late[block] = blocks.pop(block)
    forks = [BcxForks(bc_settings, env={"HOME": str(world.home)}) for _ in range(2)]
    try:
        failures = await _run_blocks(world, blocks, forks, tmp_path / "blocks")
        # bc-secrets only now: the examples that show it missing have run
        bc_processes.start("bc-secrets")
        await bc_processes.wait_ready()
        failures += await _run_blocks(world, late, forks, tmp_path / "blocks")
    finally:
        for fork in forks:
            fork.close()
    _summary(found)
    assert failures == [], "\n".join(failures)


async def _run_blocks(
    world: World, blocks: dict[str, list[Example]], forks: list[BcxForks], root: Path
) -> list[str]:
    """Each block's examples in order, in a folder of its own holding the files the docs name,
    the blocks side by side, one a fork; how each run differs from its doc."""
    lanes = asyncio.Queue[BcxForks]()
    for fork in forks:
        lanes.put_nowait(fork)

    async def run_block(block: str, todo: list[Example]) -> list[str]:
        cwd = root / re.sub(r"[^\w.-]", "_", block)
        shutil.copytree(world.files, cwd, dirs_exist_ok=True)
        fork = await lanes.get()
        failures = []
        try:
            for e in todo:
                argv = world.fill_argv(e.argv)
                # one that follows until interrupted gets the reader's Ctrl-C once it printed
                interrupt = world.interrupt.get(e.argv[:2]) if "--no-follow" not in e.argv else None
                run = await fork.bcx(
                    *argv, cwd=str(cwd), env=world.env.get(e.argv[:2]), timeout=world.timeout,
                    interrupt=interrupt,
                )  # fmt: skip
                if interrupt is not None and run.returncode == 130 and "Traceback" not in run.stderr:
                    run = run._replace(returncode=0)  # ended by Ctrl-C as a shell's reader ends it
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

    done = await asyncio.gather(*(run_block(b, todo) for b, todo in blocks.items()))
    return [f for block in done for f in block]


def _summary(found: list[Example]) -> None:
    """How many examples run where, and why the rest do not."""
    reasons = Counter(e.skip for e in found if e.skip is not None)
    by = Counter(e.by for e in found if e.by is not None)
    print(
        f"\ndoc examples: {len(found)}; ran {sum(e.here for e in found)} in make test, "
        f"{sum(e.long is not None for e in found)} in make test-long (the simulated fleet), "
        f"{sum(by.values())} by their own tests ({', '.join(f'{t}: {n}' for t, n in by.items())}), "
        f"{sum(e.grammar is not None for e in found)} synopsis lines (each form parsed, each command "
        f"run by another example), parsed only {sum(e.skip is not None for e in found)}; skipped by reason:"
    )
    for reason, n in reasons.most_common():
        print(f"  {n:3}  {reason}")


ACME = ROOT / "examples" / "acme-plugin"
TEARDOWN = {("sim", "down"), ("dev", "down")}  # run after every other block of the long test


@pytest.mark.long
@pytest.mark.timeout(1200)
async def test_the_fleet_examples_run_on_a_simulated_fleet(tmp_path: Path) -> None:
    """The blocks marked ``long``, with the same machinery, against the stack and simulated fleet
    their first block starts (docs/fleet-demo.md's ``bcx dev up`` and ``bcx sim up --enroll``, the
    default app, examples/acme-plugin installed on the services' path, as an operator's ``uv pip
    install`` would): that block first, then the others in order, then its ``sim
    down`` and ``dev down``. ``node_…`` is lab1-m001's node, as ``sim up`` prints it."""
    found = examples()
    long = [e for e in found if e.long is not None]
    assert any(e.argv[:2] == ("dev", "up") for e in long), "no long block starts the stack"
    home, files, state = tmp_path / "home", tmp_path / "files", tmp_path / "state"
    for folder in (home, files, state):
        folder.mkdir(parents=True)
    _doc_files(files)
    site = tmp_path / "site-packages"
    uv_install(ACME, site)
    # the default app (it lends an installed plugin to provision), as README's first machine; the
    # ramdisk built as `make ramdisk` would (from the user's build cache: seconds)
    env = {"HOME": str(home), "BC_STATE_DIR": str(state), "PYTHONPATH": str(site),
           "BC_RAMDISK_CACHE": str(default_cache_dir()), "BC_RAMDISK_DIR": str(state / "ramdisk"),
           "BC_CMDQ_HEARTBEAT": "200ms", "BC_CMDQ_SWEEP": "100ms",
           "BC_CMDQ_REDELIVER_AFTER": "1s"}  # fmt: skip
    world = World(home=home, files=files, ids={}, timeout=300)

    async def machines(run: BcxRun) -> None:
        """After ``sim up``: ``node_…`` is lab1-m001's node (the single-node verbs')."""
        assert run.returncode == 0, run.stderr
        rows = {line.split()[0]: line.split()[-1] for line in run.stdout.splitlines() if line.strip()}
        world.ids["node_…"] = rows["lab1-m001"]

    world.after[("sim", "up")] = machines
    blocks: dict[str, list[Example]] = {}
    for e in long:
        if e.argv[:2] not in TEARDOWN:
            blocks.setdefault(e.block, []).append(e)
    first = next(b for b, todo in blocks.items() if any(e.argv[:2] == ("dev", "up") for e in todo))
    fork = BcxForks(None, env=env)
    # none of the suite's deployment: the fleet is found through BC_STATE_DIR alone
    fork.env = {k: v for k, v in fork.env.items() if not k.startswith("BC_") or k in env}
    root = tmp_path / "blocks"
    failures: list[str] = []
    try:
        built = await fork.bcx(
            "ramdisk", "build", "--out", env["BC_RAMDISK_DIR"], cwd=str(tmp_path), timeout=900
        )
        assert built.returncode == 0, built.stderr
        failures += await _run_blocks(world, {first: blocks.pop(first)}, [fork], root)
        if not failures:
            for block, todo in blocks.items():
                failures += await _run_blocks(world, {block: todo}, [fork], root)
        if "node_…" in world.ids:
            # the single-node lines power-cycled lab1-m001 right after its commission: a healthy
            # node booting again, never a quarantine (it once was, boot-entry-fetched-twice)
            shown = await fork.bcx("nodes", "get", world.ids["node_…"], "--json", cwd=str(tmp_path))
            assert shown.returncode == 0, shown.stderr
            assert msgspec.json.decode(shown.stdout).get("quarantine") is None, shown.stdout
        teardown = [e for e in long if e.argv[:2] in TEARDOWN]
        failures += await _run_blocks(world, {"teardown": teardown}, [fork], root)
    finally:
        fork.run("dev", "down", cwd=str(tmp_path), timeout=120)  # whatever failed, nothing is left running
        fork.close()
    _summary(found)
    assert failures == [], "\n".join(failures)


def _doc_files(folder: Path) -> None:
    """The files the docs write out (a ``yaml`` block whose first line is ``# name.yaml: …``),
    into ``folder``, as a reader would save them before the examples that name them."""
    for path in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S):
            named = re.match(r"# ([\w.-]+\.ya?ml)\b", block)
            if named:
                (folder / named[1]).write_text(block)


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
    # a command that follows until interrupted: Ctrl-C once it printed, or after these seconds
    interrupt: dict[tuple[str, ...], float] = field(default_factory=dict)
    timeout: float = 60.0  # a run's, in seconds

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
    _doc_files(files)
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
             "wf_01M950WK8GWNWJD5X0J54N7YRN": aborting["workflowId"], "wf_01…": powering["workflowId"],
             # a machine's paths and the shell's variables, as the test's own
             "/home/me": str(home), "/etc/bc-site-agent": str(etc), "$KEY": "5f3c0a9e1b7d4c2a"},
        after={("batches", "keygen"): approver_added},
        env={("context", "show"): {"BCX_CONFIG": str(contexts)}},
        interrupt={("events", "tail"): 3.0},
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
        if e.argv[:2] == ("events", "tail"):  # a JSON document a line
            for line in stdout.splitlines():
                msgspec.json.decode(line)
        else:
            msgspec.json.decode(stdout)  # JSON as promised
    return None
