"""define_profile / profile_from_document: refusals with paths, deep freezing, documents."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from better_compute.core import BcError, ErrorCode
from better_compute.provision import define_profile, profile_from_document

pytestmark = pytest.mark.unit

INVALID_CONFIG = ErrorCode.INVALID_CONFIG


def refusal(fn: Callable[[], object]) -> tuple[ErrorCode, str | None]:
    with pytest.raises(BcError) as info:
        fn()
    return info.value.code, info.value.path


def ubuntu() -> dict[str, Any]:
    """The reference page's ubuntuAutoinstall profile, as a document."""
    return {
        "id": "ubuntu-24.04-autoinstall",
        "version": 1,
        "target": "metal",
        "role": "host",
        "userData": {"kind": "cloud-init", "template": "acme.yaml", "tokenTtlSeconds": 3600},
        "hostConfig": {"units": [{"name": "hugepages", "settings": {"count": 64}}]},
        "steps": [
            {"use": "autoinstall.renderIso"},
            {"use": "media.insert", "on": "site", "with": {"fromStep": "autoinstall.renderIso"}},
            {"use": "management.setBootDevice", "on": "site", "with": {"device": "cd"}},
            {"use": "power.setPower", "on": "site", "with": {"action": "cycle"}},
            {"use": "wait.agentJoined", "with": {"role": "node"}},
            {
                "use": "bmc.clearSel",
                "on": "site",
                "timeout": "2m",
                "fallback": {"use": "media.eject", "on": "site"},
            },
        ],
    }


def test_the_page_profile_is_accepted_and_frozen() -> None:
    profile = profile_from_document(ubuntu())
    assert profile.extension == "profile"
    assert profile.key == ("ubuntu-24.04-autoinstall", 1)
    assert [step.use for step in profile.steps][:2] == ["autoinstall.renderIso", "media.insert"]
    assert profile.steps[1].on == "site"
    assert profile.steps[5].fallback is not None
    assert profile.steps[5].fallback.use == "media.eject"
    assert profile.steps[5].timeout_ms == 120_000
    assert profile.user_data is not None
    assert profile.user_data.token_ttl_seconds == 3600
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.version = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.steps[1].with_["fromStep"] = "x"  # type: ignore[index]
    assert isinstance(profile.steps, tuple)


def test_the_profile_is_a_copy_the_caller_cannot_change() -> None:
    doc = ubuntu()
    doc["steps"][3]["with"]["action"] = ["cycle"]
    profile = profile_from_document(doc)
    doc["steps"][3]["with"]["action"].append("off")
    doc["steps"].clear()
    assert profile.steps[3].with_["action"] == ("cycle",)
    assert len(profile.steps) == 6


def test_documents_round_trip() -> None:
    profile = profile_from_document(ubuntu())
    assert profile.to_document() == ubuntu()
    assert profile_from_document(profile.to_document()) == profile


def test_define_profile_takes_keywords_and_gives_the_same_profile() -> None:
    doc = ubuntu()
    profile = define_profile(
        id=doc["id"],
        version=doc["version"],
        target=doc["target"],
        role=doc["role"],
        steps=doc["steps"],
        user_data=doc["userData"],
        host_config=doc["hostConfig"],
    )
    assert profile == profile_from_document(ubuntu())


def test_define_profile_accepts_steps_of_another_profile() -> None:
    source = profile_from_document(ubuntu())
    copied = define_profile(id="copy", version=1, target="metal", role="host", steps=source.steps)
    assert copied.steps == source.steps


def test_null_counts_as_absent() -> None:
    doc = ubuntu()
    doc["image"] = None
    doc["steps"][0]["with"] = None
    profile = profile_from_document(doc)
    assert profile.image is None
    assert dict(profile.steps[0].with_) == {}


def test_an_adopt_profile_may_carry_host_config_and_no_steps() -> None:
    profile = define_profile(
        id="adopt-gpu",
        version=3,
        target="metal",
        role="host",
        adopt=True,
        steps=[],
        host_config={"units": [{"name": "nvidia-driver", "settings": {"version": "550"}}]},
    )
    assert profile.adopt
    assert profile.to_document()["adopt"] is True


def test_an_instance_profile_takes_image_and_user_data() -> None:
    profile = define_profile(
        id="vm-ubuntu",
        version=1,
        target="instance",
        role="host",
        image="ubuntu-24.04@2024.06.1",
        user_data={"kind": "cloud-init"},
    )
    assert profile.image == "ubuntu-24.04@2024.06.1"


def with_(doc: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    out.update(changes)
    return out


def without(key: str) -> dict[str, Any]:
    doc = ubuntu()
    del doc[key]
    return doc


def step0(**step: Any) -> dict[str, Any]:
    """A profile whose only step is ``step``."""
    return with_(ubuntu(), steps=[step])


def with0(**with_values: Any) -> dict[str, Any]:
    """A profile whose only step has ``with: with_values``."""
    return step0(use="a.b", **{"with": with_values})


def fallback0(**fallback: Any) -> dict[str, Any]:
    """A profile whose only step has ``fallback: fallback``."""
    return step0(use="a.b", fallback=fallback)


def user_data(**section: Any) -> dict[str, Any]:
    return with_(ubuntu(), userData=section)


def units(*entries: Any) -> dict[str, Any]:
    return with_(ubuntu(), hostConfig={"units": list(entries)})


ADOPT = with_(without("userData"), adopt=True, steps=[])

# Every refusal rule of defineProfile: the document and the details.path it is refused at.
REFUSALS: list[tuple[str, Any, str]] = [
    # unknown fields
    ("unknown top-level field", with_(ubuntu(), owner="acme"), "owner"),
    ("snake_case field name", with_(ubuntu(), user_data={"kind": "x"}), "user_data"),
    ("unknown step field", step0(use="a.b", run="x"), "steps[0].run"),
    ("unknown fallback field", fallback0(use="c.d", x=1), "steps[0].fallback.x"),
    (
        "nested fallback",
        fallback0(use="c.d", fallback={"use": "e.f"}),
        "steps[0].fallback.fallback",
    ),
    ("unknown userData field", user_data(kind="talos", body="x"), "userData.body"),
    ("unknown hostConfig field", with_(ubuntu(), hostConfig={"files": []}), "hostConfig.files"),
    ("unknown unit field", units({"name": "sysctl", "x": 1}), "hostConfig.units[0].x"),
    # ids and versions
    ("missing id", without("id"), "id"),
    ("uppercase id", with_(ubuntu(), id="Ubuntu"), "id"),
    ("id with a space", with_(ubuntu(), id="ubuntu 24"), "id"),
    ("id ending in a dash", with_(ubuntu(), id="ubuntu-"), "id"),
    ("numeric id", with_(ubuntu(), id=24), "id"),
    ("missing version", without("version"), "version"),
    ("zero version", with_(ubuntu(), version=0), "version"),
    ("negative version", with_(ubuntu(), version=-1), "version"),
    ("string version", with_(ubuntu(), version="1"), "version"),
    ("float version", with_(ubuntu(), version=1.0), "version"),
    ("bool version", with_(ubuntu(), version=True), "version"),
    ("missing target", without("target"), "target"),
    ("unknown target", with_(ubuntu(), target="vm"), "target"),
    ("target as a list", with_(ubuntu(), target=["metal"]), "target"),
    ("on as a list", step0(use="a.b", on=["site"]), "steps[0].on"),
    ("missing role", without("role"), "role"),
    ("bad role", with_(ubuntu(), role="Host"), "role"),
    ("description not a string", with_(ubuntu(), description=["x"]), "description"),
    ("adopt not a bool", with_(ubuntu(), adopt="yes"), "adopt"),
    ("bad image reference", with_(ubuntu(), image="ubuntu"), "image"),
    # malformed steps
    ("steps not a list", with_(ubuntu(), steps={"use": "a.b"}), "steps"),
    ("step not an object", with_(ubuntu(), steps=[{"use": "a.b"}, "a.b"]), "steps[1]"),
    ("step without use", step0(on="site"), "steps[0].use"),
    ("use with one segment", step0(use="power"), "steps[0].use"),
    ("use with a dash", step0(use="power.set-power"), "steps[0].use"),
    ("unknown on", step0(use="a.b", on="bmc"), "steps[0].on"),
    ("with not an object", step0(use="a.b", **{"with": ["cycle"]}), "steps[0].with"),
    ("fallback not an object", step0(use="a.b", fallback="c.d"), "steps[0].fallback"),
    ("fallback with a bad use", fallback0(use="C"), "steps[0].fallback.use"),
    ("fallback with a bad on", fallback0(use="c.d", on="x"), "steps[0].fallback.on"),
    ("too many steps", with_(ubuntu(), steps=[{"use": "a.b"}] * 513), "steps"),
    # durations
    ("timeout without unit", step0(use="a.b", timeout="30"), "steps[0].timeout"),
    ("zero timeout", step0(use="a.b", timeout="0s"), "steps[0].timeout"),
    ("numeric timeout", step0(use="a.b", timeout=30), "steps[0].timeout"),
    ("fallback timeout", fallback0(use="c.d", timeout="1 h"), "steps[0].fallback.timeout"),
    # non-JSON values
    ("a set in with", with0(disks={"sda"}), "steps[0].with.disks"),
    ("bytes in with", with0(data=[b"x"]), "steps[0].with.data[0]"),
    ("nan in with", with0(ratio=float("nan")), "steps[0].with.ratio"),
    ("infinity in with", with0(a={"b": float("inf")}), "steps[0].with.a.b"),
    ("non-string key in with", with0(a={1: "x"}), "steps[0].with.a"),
    ("an object in with", with0(at=object()), "steps[0].with.at"),
    (
        "a set in unit settings",
        units({"name": "sysctl", "settings": {"values": {1}}}),
        "hostConfig.units[0].settings.values",
    ),
    ("a non-string top-level key", {**ubuntu(), 1: "x"}, ""),
    ("not an object", ["ubuntu"], ""),
    # userData and hostConfig shapes
    ("userData not an object", with_(ubuntu(), userData="cloud-init"), "userData"),
    ("userData without kind", user_data(template="a.yaml"), "userData.kind"),
    ("userData bad kind", user_data(kind="Cloud Init"), "userData.kind"),
    ("userData bad template name", user_data(kind="talos", template="../x"), "userData.template"),
    ("zero token TTL", user_data(kind="talos", tokenTtlSeconds=0), "userData.tokenTtlSeconds"),
    (
        "token TTL as text",
        user_data(kind="talos", tokenTtlSeconds="2h"),
        "userData.tokenTtlSeconds",
    ),
    ("units not a list", with_(ubuntu(), hostConfig={"units": {}}), "hostConfig.units"),
    ("unit without name", units({"settings": {}}), "hostConfig.units[0].name"),
    ("unit bad name", units({"name": "Sysctl"}), "hostConfig.units[0].name"),
    (
        "unit settings not an object",
        units({"name": "a", "settings": [1]}),
        "hostConfig.units[0].settings",
    ),
    ("unit empty when", units({"name": "sysctl", "when": " "}), "hostConfig.units[0].when"),
    # fields of the other target
    ("hostConfig on an instance profile", with_(ubuntu(), target="instance"), "hostConfig"),
    # adopt profiles
    ("image on an adopt profile", with_(ADOPT, image="u@1"), "image"),
    ("user data on an adopt profile", with_(ADOPT, userData={"kind": "talos"}), "userData"),
    ("steps on an adopt profile", with_(ADOPT, steps=[{"use": "a.b"}]), "steps"),
]


@pytest.mark.parametrize(
    ("document", "path"), [(doc, path) for _, doc, path in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_refusals(document: Any, path: str) -> None:
    assert refusal(lambda: profile_from_document(document)) == (INVALID_CONFIG, path)


def test_define_profile_reports_document_paths() -> None:
    assert refusal(
        lambda: define_profile(id="p", version=1, target="metal", role="host", user_data={"kind": "Bad Kind"})
    ) == (INVALID_CONFIG, "userData.kind")
    assert refusal(
        lambda: define_profile(
            id="p",
            version=1,
            target="metal",
            role="host",
            steps=[{"use": "a.b"}, {"use": "c.d"}, {"use": "e.f", "with": {"x": {1, 2}}}],
        )
    ) == (INVALID_CONFIG, "steps[2].with.x")
