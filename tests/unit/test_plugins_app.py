"""Plugins, the registry, metal's command kinds, app composition, config units, load_app."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from better_compute.app import PLUGIN_ENTRY_POINT_GROUP, better_compute, load_app
from better_compute.app import composition as app_module
from better_compute.app.default import app as default_app_object
from better_compute.app.default import default_app
from better_compute.core import (
    BcError,
    CommandKind,
    ErrorCode,
    define_plugin,
    field,
    manifest,
)
from better_compute.metal import COMMAND_KINDS, metal
from better_compute.metal.signatures import image_signer
from better_compute.provision import (
    BUILTIN_CONFIG_UNITS,
    ConfigUnit,
    Step,
    define_profile,
    define_step,
    profile_from_document,
    provision_module,
    resolve_host_config,
)
from better_compute.provision.userdata import SHIPPED_STEPS

pytestmark = pytest.mark.unit

INVALID_CONFIG = ErrorCode.INVALID_CONFIG
INVALID_INPUT = ErrorCode.INVALID_INPUT
SHIPPED = {step.id: step for step in SHIPPED_STEPS}  # provision ships these in every app


def refusal(fn: Callable[[], object]) -> tuple[ErrorCode, str | None]:
    with pytest.raises(BcError) as info:
        fn()
    return info.value.code, info.value.path


async def run(input: dict[str, Any], ctx: Any) -> dict[str, Any]:
    return {}


def control_plane_step(id: str, **options: Any) -> Step:
    return define_step(id=id, runs_on="control-plane", timeout="1m", input=manifest({}), run=run, **options)


def agent_step(id: str, command: str) -> Step:
    return define_step(id=id, runs_on="site", timeout="1m", input=manifest({}), command=command)


TALOS_READY = control_plane_step("wait.talosReady", relays=["site"], sends=["site.httpProxy"])
TALOS = define_profile(id="talos", version=1, target="metal", role="host", steps=[{"use": "wait.talosReady"}])
RENDER_ISO = control_plane_step("autoinstall.renderIso")
UBUNTU = define_profile(
    id="ubuntu-24.04-autoinstall",
    version=1,
    target="metal",
    role="host",
    steps=[{"use": "autoinstall.renderIso"}, {"use": "power.setPower", "on": "site"}],
)
ACME = define_plugin(id="acme-autoinstall", extensions=[RENDER_ISO], profiles=[UBUNTU])


# --- define_plugin and CommandKind -----------------------------------------------------------


def test_a_plugin_is_frozen_and_lists_its_steps() -> None:
    assert ACME.steps == (RENDER_ISO,)
    assert ACME.profiles == (UBUNTU,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ACME.id = "other"  # type: ignore[misc]


OTHER_RENDER_ISO = control_plane_step("autoinstall.renderIso")
KIND = CommandKind(name="acme.flash", destructive=True, payload=manifest({}))


@pytest.mark.parametrize(
    ("options", "path"),
    [
        ({"id": "Acme"}, "id"),
        ({"id": "acme_autoinstall"}, "id"),
        ({"id": ""}, "id"),
        ({"extensions": RENDER_ISO}, "extensions"),
        ({"extensions": [TALOS]}, "extensions[0]"),
        ({"extensions": [RENDER_ISO, RENDER_ISO]}, "extensions[1]"),
        ({"extensions": [RENDER_ISO, OTHER_RENDER_ISO]}, "extensions[1].id"),
        ({"profiles": [TALOS, TALOS]}, "profiles[1]"),
        ({"profiles": [TALOS, profile_from_document(TALOS.to_document())]}, "profiles[1].version"),
        ({"profiles": [RENDER_ISO]}, "profiles[0]"),
        ({"command_kinds": ["acme.flash"]}, "command_kinds[0]"),
        (
            {
                "command_kinds": [
                    KIND,
                    CommandKind(name="acme.flash", destructive=False, payload=manifest({})),
                ]
            },
            "command_kinds[1].name",
        ),
    ],
)
def test_define_plugin_refusals(options: dict[str, Any], path: str) -> None:
    assert refusal(lambda: define_plugin(**{"id": "acme", **options})) == (INVALID_CONFIG, path)


@pytest.mark.parametrize(
    ("options", "path"),
    [
        ({"name": "flash"}, "name"),
        ({"name": "acme.flash_fw"}, "name"),
        ({"destructive": "yes"}, "destructive"),
        ({"payload": {}}, "payload"),
    ],
)
def test_command_kind_refusals(options: dict[str, Any], path: str) -> None:
    kind: dict[str, Any] = {"name": "acme.flash", "destructive": True, "payload": manifest({})}
    assert refusal(lambda: CommandKind(**{**kind, **options})) == (INVALID_CONFIG, path)


# --- metal -----------------------------------------------------------------------------------


def test_metal_registers_the_pages_command_kinds_with_their_destructive_flags() -> None:
    assert {name: kind.destructive for name, kind in COMMAND_KINDS.items()} == {
        "driver.invoke": True,
        "site.httpProxy": True,
        "power.setPower": False,
        "management.setBootDevice": False,
        "media.insert": False,
        "media.eject": False,
        "node.inventory": False,
        "node.wipe": True,
        "node.imageWrite": True,
        "node.converge": False,
        "management.inventory": False,
        "management.validate": False,
        "netboot.setEntry": False,
        "netboot.clearEntry": False,
    }
    # the shipped steps and lifecycle profiles (issue 11 item 4), the same objects every call
    assert [s.id for s in metal().steps] == [
        "power.setPower", "management.setBootDevice", "media.insert", "media.eject", "power.getPower",
        "management.validate", "enroll.validateBmc", "enroll.readBmc", "metal.ensureRamdisk",
        "wait.agentJoined", "inspect.collect", "disk.wipe", "deploy.deploy",
    ]  # fmt: skip
    assert [p.id for p in metal().profiles] == [
        "metal.inspect", "metal.commission", "metal.deploy", "metal.release", "metal.retire", "metal.adopt",
        "metal.power-on", "metal.power-off", "metal.power-cycle", "metal.boot-pxe", "metal.boot-disk",
        "metal.enroll", "metal.validate",
    ]  # fmt: skip
    assert metal().profiles[2] is metal().profiles[2]


def test_metal_payloads_are_checked() -> None:
    power = COMMAND_KINDS["power.setPower"].payload
    assert power.validate({"action": "cycle"}) == {"action": "cycle"}
    assert refusal(lambda: power.validate({"action": "explode"})) == (INVALID_INPUT, "action")
    wipe = COMMAND_KINDS["node.wipe"].payload
    assert wipe.validate({}) == {"mode": "quick"}
    image = COMMAND_KINDS["node.imageWrite"].payload
    assert refusal(
        lambda: image.validate({"url": "https://x/img", "sha256": "ab" * 32, "userDataRef": "x"})
    ) == (INVALID_INPUT, "userDataRef")


# --- composition -----------------------------------------------------------------------------


def test_steps_given_to_provision_directly_are_resolved() -> None:
    app = better_compute(modules=[metal(), provision_module(steps=[TALOS_READY], profiles=[TALOS])])
    assert dict(app.steps) == {"wait.talosReady": TALOS_READY, **SHIPPED}
    assert app.profiles == (TALOS,)
    assert app.command_kind("site.httpProxy").destructive


def test_a_plugin_listed_in_provision_and_in_plugins_is_registered_once_and_resolved() -> None:
    app = better_compute(
        modules=[metal(), provision_module(modules=[metal(), ACME], steps=[TALOS_READY])],
        plugins=[ACME],
    )
    metal_steps = {step.id for step in metal().steps}
    assert set(app.steps) == {"wait.talosReady", "autoinstall.renderIso", *SHIPPED, *metal_steps}
    assert app.steps["autoinstall.renderIso"] is RENDER_ISO
    assert app.profile("ubuntu-24.04-autoinstall") is UBUNTU


def test_a_registered_plugin_that_provision_does_not_borrow_is_not_resolved() -> None:
    app = better_compute(modules=[metal(), provision_module()], plugins=[ACME])
    assert "autoinstall.renderIso" not in app.steps
    assert app.profiles == ()


def test_a_borrowed_plugin_must_also_be_registered() -> None:
    assert refusal(lambda: better_compute(modules=[metal(), provision_module(modules=[metal(), ACME])])) == (
        INVALID_CONFIG,
        "modules[1].modules[1]",
    )


def test_a_borrowed_plugin_must_lend_the_registered_steps() -> None:
    impostor = define_plugin(id="acme-autoinstall", extensions=[OTHER_RENDER_ISO])
    assert refusal(
        lambda: better_compute(modules=[metal(), provision_module(modules=[impostor])], plugins=[ACME])
    ) == (INVALID_CONFIG, "modules[1].modules[0].extensions[0]")


def test_an_extension_registered_twice_is_refused() -> None:
    # Once as provision's own step, once through the plugin.
    assert refusal(
        lambda: better_compute(modules=[metal(), provision_module(steps=[RENDER_ISO])], plugins=[ACME])
    ) == (INVALID_CONFIG, "plugins[0].extensions[0]")
    # Provision's own and borrowed at once.
    assert refusal(lambda: provision_module(modules=[ACME], steps=[RENDER_ISO])) == (
        INVALID_CONFIG,
        "modules[0].extensions[0]",
    )


def test_a_duplicate_step_id_is_refused() -> None:
    other = define_plugin(id="other", extensions=[OTHER_RENDER_ISO])
    assert refusal(lambda: better_compute(modules=[metal()], plugins=[ACME, other])) == (
        INVALID_CONFIG,
        "plugins[1].extensions[0].id",
    )


def test_duplicate_plugins_and_modules_are_refused() -> None:
    assert refusal(lambda: better_compute(plugins=[ACME, ACME])) == (INVALID_CONFIG, "plugins[1]")
    twin = define_plugin(id="acme-autoinstall")
    assert refusal(lambda: better_compute(plugins=[ACME, twin])) == (
        INVALID_CONFIG,
        "plugins[1].id",
    )
    assert refusal(lambda: better_compute(modules=[metal(), metal()])) == (
        INVALID_CONFIG,
        "modules[1].id",
    )
    assert refusal(lambda: better_compute(modules=[metal(), provision_module(), provision_module()])) == (
        INVALID_CONFIG,
        "modules[2].id",
    )


def test_provision_cannot_borrow_from_provision() -> None:
    assert refusal(lambda: provision_module(modules=[provision_module()])) == (
        INVALID_CONFIG,
        "modules[0]",
    )


def test_an_agent_step_must_send_a_registered_kind() -> None:
    flash = agent_step("acme.flashFirmware", "acme.flash")
    assert refusal(lambda: better_compute(modules=[metal(), provision_module(steps=[flash])])) == (
        INVALID_CONFIG,
        "modules[1].steps[0].command",
    )
    with_kind = define_plugin(id="acme-flash", command_kinds=[KIND])
    app = better_compute(modules=[metal(), provision_module(steps=[flash])], plugins=[with_kind])
    assert app.steps["acme.flashFirmware"] is flash


def test_declared_sends_must_be_registered_kinds() -> None:
    relaying = control_plane_step("acme.poll", relays=["site"], sends=["site.httpProxy", "acme.x"])
    assert refusal(lambda: better_compute(modules=[metal(), provision_module(steps=[relaying])])) == (
        INVALID_CONFIG,
        "modules[1].steps[0].sends[1]",
    )


def test_unknown_command_kind_lookup_is_invalid_config() -> None:
    assert refusal(lambda: default_app_object.command_kind("acme.flash")) == (
        INVALID_CONFIG,
        "kind",
    )


def test_profile_lookup_prefers_the_highest_version() -> None:
    talos_v2 = profile_from_document({**TALOS.to_document(), "version": 2})
    app = better_compute(modules=[provision_module(profiles=[TALOS, talos_v2], steps=[RENDER_ISO])])
    assert app.profile("talos") is talos_v2
    assert app.profile("talos", version=1) is TALOS
    assert refusal(lambda: app.profile("talos", version=3)) == (ErrorCode.NOT_FOUND, "version")
    assert refusal(lambda: app.profile("nope")) == (ErrorCode.NOT_FOUND, "id")


def test_the_default_app_has_metal_and_provision() -> None:
    assert set(default_app_object.command_kinds) == set(COMMAND_KINDS)
    assert default_app_object.provision is not None
    assert dataclasses.is_dataclass(default_app_object)
    with pytest.raises(dataclasses.FrozenInstanceError):
        default_app_object.provision = None  # type: ignore[misc]


# --- discovery and load_app ------------------------------------------------------------------


def fake_entry_point(name: str, loaded: Callable[[], Any]) -> SimpleNamespace:
    return SimpleNamespace(name=name, load=loaded)


def test_discovered_plugins_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    groups: list[str] = []

    def entry_points(group: str) -> list[SimpleNamespace]:
        groups.append(group)
        return [
            fake_entry_point("acme", lambda: ACME),
            fake_entry_point("flash", lambda: lambda: define_plugin(id="flash", command_kinds=[KIND])),
        ]

    monkeypatch.setattr(app_module, "_entry_points", entry_points)
    app = better_compute(modules=[metal()], plugins=[ACME], discover=True)
    assert groups == [PLUGIN_ENTRY_POINT_GROUP] == ["better_compute.plugins"]
    assert "acme.flash" in app.command_kinds
    assert [plugin.id for plugin in app.plugins] == ["acme-autoinstall", "flash"]


def discovering(monkeypatch: pytest.MonkeyPatch, **plugins: Any) -> None:
    """Entry points ``name -> plugin`` as if installed (``dist`` names their package)."""
    dist = SimpleNamespace(name="acme-plugin", version="1.2.0")
    points = [
        SimpleNamespace(name=name, value=f"acme_plugin:{name}", dist=dist, load=lambda p=p: p)
        for name, p in plugins.items()
    ]
    monkeypatch.setattr(app_module, "_entry_points", lambda group: points)


def test_the_default_app_resolves_an_installed_plugins_steps_and_profiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Regression: the default app did not discover, and a discovered plugin was only registered,
    # never lent to provision, so the engine could not resolve its steps (seen failing first).
    discovering(monkeypatch, acme=ACME)
    app = default_app()
    assert app.steps["autoinstall.renderIso"] is RENDER_ISO
    assert app.profile("ubuntu-24.04-autoinstall") is UBUNTU
    assert [p.id for p in app.plugins] == ["acme-autoinstall"]
    source = app.plugin_sources["acme-autoinstall"]
    assert (source.entry_point, source.value, source.distribution, source.version) == (
        "acme", "acme_plugin:acme", "acme-plugin", "1.2.0"
    )  # fmt: skip
    assert "metal.deploy" in {p.id for p in app.profiles}  # metal's are still there


def test_an_app_that_asks_to_discover_lends_the_plugin_to_its_provision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    discovering(monkeypatch, acme=ACME)
    provision = provision_module(modules=[metal()], steps=[TALOS_READY], profiles=[TALOS])
    app = better_compute(modules=[metal(), provision], discover=True)
    assert {"autoinstall.renderIso", "wait.talosReady", "metal.ensureRamdisk"} <= set(app.steps)
    assert app.provision is not None
    assert app.provision.steps == (TALOS_READY,)
    # without discover, nothing installed is looked at
    assert "autoinstall.renderIso" not in better_compute(modules=[metal(), provision]).steps


def test_a_plugins_config_units_and_signers_are_the_apps(monkeypatch: pytest.MonkeyPatch) -> None:
    signer = image_signer("acme-release", base64.b64encode(bytes(range(32))).decode())
    acme = define_plugin(id="acme", config_units=[NIC_FIRMWARE], image_signers=[signer])
    discovering(monkeypatch, acme=acme)
    app = default_app()
    assert app.provision is not None
    assert app.provision.config_units["acme-nic-firmware"] is NIC_FIRMWARE
    assert app.provision.config_units["sysctl"] is BUILTIN_CONFIG_UNITS["sysctl"]
    assert dict(app.image_signers) == {"acme-release": signer}
    # a listed plugin lends its units to the provision module that borrows it
    listed = better_compute(modules=[provision_module(modules=[acme])], plugins=[acme])
    assert listed.provision is not None
    assert "acme-nic-firmware" in listed.provision.config_units


def test_two_plugins_with_one_unit_or_signer_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    signer = image_signer("acme-release", base64.b64encode(bytes(range(32))).decode())
    other = image_signer("acme-release", base64.b64encode(bytes(range(1, 33))).decode())
    discovering(
        monkeypatch,
        a=define_plugin(id="a", config_units=[NIC_FIRMWARE]),
        b=define_plugin(id="b", config_units=[NIC_FIRMWARE]),
    )
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.b.config_units[0].name")
    discovering(
        monkeypatch,
        a=define_plugin(id="a", image_signers=[signer]),
        b=define_plugin(id="b", image_signers=[other]),
    )
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.b.image_signers[0].id")
    assert refusal(lambda: define_plugin(id="c", config_units=[NIC_FIRMWARE, NIC_FIRMWARE])) == (
        INVALID_CONFIG,
        "config_units[1].name",
    )
    assert refusal(lambda: define_plugin(id="a", config_units=[object()])) == (
        INVALID_CONFIG,
        "config_units[0]",
    )
    not_a_unit = define_plugin(id="a", config_units=[SimpleNamespace(name="acme-nic")])
    discovering(monkeypatch, a=not_a_unit)
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.a.config_units[0]")


def test_an_installed_plugin_the_provision_module_already_borrows_is_lent_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    discovering(monkeypatch, acme=ACME)
    app = better_compute(modules=[metal(), provision_module(modules=[metal(), ACME])], discover=True)
    assert app.steps["autoinstall.renderIso"] is RENDER_ISO
    assert app.plugin_sources["acme-autoinstall"].entry_point == "acme"


def test_two_packages_declaring_one_entry_point_name_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    points = [fake_entry_point("acme", lambda: ACME), fake_entry_point("acme", lambda: ACME)]
    monkeypatch.setattr(app_module, "_entry_points", lambda group: points)
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.acme")


def test_a_plugin_clashing_with_metal_names_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    clash = define_plugin(id="clash", extensions=[control_plane_step("metal.ensureRamdisk")])
    discovering(monkeypatch, clash=clash)
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.clash.extensions[0].id")


def test_a_plugin_failing_with_another_code_is_still_invalid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise BcError(ErrorCode.INVALID_INPUT, "bad template", {"path": "template"})

    monkeypatch.setattr(app_module, "_entry_points", lambda group: [fake_entry_point("acme", broken)])
    assert refusal(default_app) == (INVALID_CONFIG, "entry_points.acme")


@pytest.mark.parametrize(
    "loaded",
    [lambda: 42, lambda: (_ for _ in ()).throw(ImportError("no module acme"))],
)
def test_a_broken_entry_point_is_invalid_config(
    monkeypatch: pytest.MonkeyPatch, loaded: Callable[[], Any]
) -> None:
    monkeypatch.setattr(app_module, "_entry_points", lambda group: [fake_entry_point("broken", loaded)])
    assert refusal(lambda: better_compute(discover=True)) == (INVALID_CONFIG, "entry_points.broken")


def test_load_app_loads_the_default_app_and_factories() -> None:
    assert load_app("better_compute.app.default:app") is default_app_object
    assert set(load_app("better_compute.app.default:default_app").command_kinds) == set(COMMAND_KINDS)


@pytest.mark.parametrize(
    "spec",
    [
        "better_compute.app.default",
        "better_compute.app.default:",
        "better_compute.app.default:app:x",
        "better_compute/metal:app",
        "no_such_package_xyz.app:app",
        "better_compute.app.default:nope",
        "better_compute.metal:metal",
        "better_compute.metal:COMMAND_KINDS",
    ],
)
def test_load_app_refuses_bad_specs(spec: str) -> None:
    assert refusal(lambda: load_app(spec)) == (INVALID_CONFIG, "app")


# --- config units ----------------------------------------------------------------------------


def test_the_built_in_units_are_the_pages() -> None:
    assert set(BUILTIN_CONFIG_UNITS) == {
        "kernel-modules",
        "sysctl",
        "hugepages",
        "nvidia-driver",
        "fabric-manager",
        "mig-layout",
        "gpu-sharing",
        "container-toolkit",
        "k8s-join",
    }


NIC_FIRMWARE = ConfigUnit(
    name="acme-nic-firmware",
    description="Pins the NIC firmware branch",
    settings=manifest({"branch": field.string(pattern=r"^[0-9]+\.[0-9]+$")}),
)


def test_a_unit_named_like_a_built_in_replaces_it() -> None:
    sysctl = ConfigUnit(name="sysctl", description="mine", settings=manifest({}))
    units = provision_module(config_units=[NIC_FIRMWARE, sysctl]).config_units
    assert units["sysctl"] is sysctl
    assert units["acme-nic-firmware"] is NIC_FIRMWARE
    assert units["hugepages"] is BUILTIN_CONFIG_UNITS["hugepages"]


def test_a_unit_given_twice_is_refused() -> None:
    assert refusal(lambda: provision_module(config_units=[NIC_FIRMWARE, NIC_FIRMWARE])) == (
        INVALID_CONFIG,
        "config_units[1].name",
    )


@pytest.mark.parametrize(
    ("options", "path"),
    [({"name": "Acme"}, "name"), ({"settings": {}}, "settings"), ({"when": ""}, "when")],
)
def test_config_unit_refusals(options: dict[str, Any], path: str) -> None:
    unit: dict[str, Any] = {"name": "acme", "description": "d", "settings": manifest({})}
    assert refusal(lambda: ConfigUnit(**{**unit, **options})) == (INVALID_CONFIG, path)


def host_config(*units: dict[str, Any]) -> Any:
    return define_profile(
        id="p", version=1, target="metal", role="host", host_config={"units": list(units)}
    ).host_config


def test_resolving_the_host_section_checks_settings_and_fills_defaults() -> None:
    units = provision_module(config_units=[NIC_FIRMWARE]).config_units
    resolved = resolve_host_config(
        host_config(
            {"name": "hugepages", "settings": {"count": 64}, "when": "gpu=true"},
            {"name": "acme-nic-firmware", "settings": {"branch": "22.1"}},
        ),
        units=units,
    )
    assert [(u.name, dict(u.settings), u.when) for u in resolved] == [
        ("hugepages", {"size": "2M", "count": 64}, "gpu=true"),
        ("acme-nic-firmware", {"branch": "22.1"}, None),
    ]


def test_an_unknown_unit_or_bad_settings_is_invalid_input_when_resolved() -> None:
    units = provision_module().config_units
    assert refusal(lambda: resolve_host_config(host_config({"name": "acme-nic-firmware"}), units=units)) == (
        INVALID_INPUT,
        "hostConfig.units[0].name",
    )
    assert refusal(
        lambda: resolve_host_config(
            host_config({"name": "sysctl", "settings": {"values": {}}}, {"name": "hugepages"}),
            units=units,
        )
    ) == (INVALID_INPUT, "hostConfig.units[1].settings.count")


def test_metal_registers_the_site_agents_driver_operations_once() -> None:
    from better_compute.core import DriverOperation, Registry, manifest

    app = better_compute(modules=[metal()])
    assert set(app.driver_operations) == {
        "power.setPower", "management.setBootDevice", "media.insert", "media.eject",
        "management.inventory", "management.validate", "netboot.setEntry", "netboot.clearEntry",
    }  # fmt: skip
    # an operation's input is the payload of the command kind of the same name
    assert app.driver_operations["power.setPower"].input is COMMAND_KINDS["power.setPower"].payload
    with pytest.raises(BcError) as e:
        DriverOperation(name="power.set.power", input=manifest({}))
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "name")
    registry: Registry[Any, Any] = Registry()
    op = DriverOperation(name="acme.reset", input=manifest({}))
    registry.add_driver_operation(op, path="a")
    with pytest.raises(BcError) as e:
        registry.add_driver_operation(DriverOperation(name="acme.reset", input=manifest({})), path="b")
    assert (e.value.code, e.value.path) == (ErrorCode.INVALID_CONFIG, "b.name")


def test_a_plugin_contributes_driver_operations_registered_like_steps() -> None:
    from better_compute.core import DriverOperation

    flash = DriverOperation(
        name="bios.flash", input=manifest({"image": field.string(min_length=1)}), description="Flash"
    )
    plugin = define_plugin(id="acme-bios", driver_operations=[flash])
    assert plugin.driver_operations == (flash,)
    app = better_compute(modules=[metal()], plugins=[plugin])
    assert app.driver_operations["bios.flash"] is flash
    assert "power.setPower" in app.driver_operations
    # a name taken by another module or plugin, twice in one plugin, or not an operation
    taken = DriverOperation(name="power.setPower", input=manifest({}))
    assert refusal(
        lambda: better_compute(
            modules=[metal()], plugins=[define_plugin(id="acme-power", driver_operations=[taken])]
        )
    ) == (INVALID_CONFIG, "plugins[0].driver_operations[0].name")
    again = DriverOperation(name="bios.flash", input=manifest({}))
    assert refusal(lambda: define_plugin(id="acme", driver_operations=[flash, again])) == (
        INVALID_CONFIG,
        "driver_operations[1].name",
    )
    assert refusal(lambda: define_plugin(id="acme", driver_operations=["bios.flash"])) == (
        INVALID_CONFIG,
        "driver_operations[0]",
    )
