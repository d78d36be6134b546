"""The manifest / field DSL: validation, normalisation, refusals with paths, JSON Schema."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from better_compute.core import BcError, ErrorCode, field, manifest, parse_duration

pytestmark = pytest.mark.unit

INVALID_INPUT = ErrorCode.INVALID_INPUT
INVALID_CONFIG = ErrorCode.INVALID_CONFIG
SECRET = "sec_01J0000000000000000000000A"


def refusal(fn: Callable[[], object]) -> tuple[ErrorCode, str | None]:
    with pytest.raises(BcError) as info:
        fn()
    return info.value.code, info.value.path


MACHINE = manifest(
    {
        "port": field.int(min=1, max=65535).default(50000),
        "name": field.string(pattern=r"^[a-z]+$", max_length=8),
        "disks": field.list(field.object({"size": field.int(min=1)})).default([]),
        "labels": field.map(field.string()).optional(),
        "ratio": field.number(min=0, max=1).optional(),
        "secure": field.bool().default(False),
        "mode": field.enum(["quick", "full"]).default("quick"),
        "wait": field.duration().default("30s"),
        "token": field.secret_ref().optional(),
    }
)


def test_validate_fills_defaults_and_leaves_out_absent_optionals() -> None:
    assert MACHINE.validate({"name": "web"}) == {
        "port": 50000,
        "name": "web",
        "disks": [],
        "secure": False,
        "mode": "quick",
        "wait": "30s",
    }


def test_a_key_set_to_none_counts_as_absent() -> None:
    assert MACHINE.validate({"name": "web", "port": None, "labels": None})["port"] == 50000


def test_each_result_is_a_fresh_copy_so_defaults_cannot_be_corrupted() -> None:
    first = MACHINE.validate({"name": "web"})
    first["disks"].append({"size": 1})
    assert MACHINE.validate({"name": "web"})["disks"] == []


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"name": "web", "port": 0}, "port"),
        ({"name": "web", "port": 70000}, "port"),
        ({"name": "web", "port": "22"}, "port"),
        ({"name": "web", "port": True}, "port"),
        ({"name": "web", "port": 22.0}, "port"),
        ({}, "name"),
        ({"name": "Web"}, "name"),
        ({"name": "web\n"}, "name"),
        ({"name": "abcdefghi"}, "name"),
        ({"name": "web", "color": "red"}, "color"),
        ({"name": "web", "disks": [{"size": 1}, {"size": 2}, {"size": 0}]}, "disks[2].size"),
        ({"name": "web", "disks": [{"size": 1, "kind": "ssd"}]}, "disks[0].kind"),
        ({"name": "web", "disks": [{}]}, "disks[0].size"),
        ({"name": "web", "disks": "sda"}, "disks"),
        ({"name": "web", "labels": {"gpu": 1}}, "labels.gpu"),
        ({"name": "web", "labels": ["gpu"]}, "labels"),
        ({"name": "web", "ratio": 1.5}, "ratio"),
        ({"name": "web", "ratio": float("nan")}, "ratio"),
        ({"name": "web", "ratio": False}, "ratio"),
        ({"name": "web", "secure": 1}, "secure"),
        ({"name": "web", "secure": "true"}, "secure"),
        ({"name": "web", "mode": "fast"}, "mode"),
        ({"name": "web", "wait": "30"}, "wait"),
        ({"name": "web", "wait": "1h30m"}, "wait"),
        ({"name": "web", "wait": 30}, "wait"),
        ({"name": "web", "token": "tok_01J0000000000000000000000A"}, "token"),
        ({"name": "web", "token": {"secretRef": "nope"}}, "token.secretRef"),
        ({"name": "web", "token": {"secretRef": SECRET, "extra": 1}}, "token.extra"),
        ({1: "web"}, ""),
    ],
)
def test_refusals_name_the_first_bad_field(value: dict[object, object], path: str) -> None:
    assert refusal(lambda: MACHINE.validate(value)) == (INVALID_INPUT, path)


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"name": "web", "port": 0}, "port"),
        ({}, "name"),
        ({"name": "web", "color": "red"}, "color"),
        ({"name": "web", "disks": [{"size": 1}, {"size": 2}, {"size": 0}]}, "disks[2].size"),
        ({"name": "web", "disks": "sda"}, "disks"),
        ({"name": "web", "labels": {"gpu": 1}}, "labels.gpu"),
        ({"name": "web", "token": {"secretRef": SECRET, "extra": 1}}, "token.extra"),
        ({1: "web"}, ""),
    ],
)
def test_problems_finds_what_validate_refuses_and_nothing_when_it_passes(
    value: dict[object, object], path: str
) -> None:
    assert [(p.code, p.path) for p in MACHINE.problems(value)][:1] == [(INVALID_INPUT, path)]
    assert MACHINE.problems({"name": "web", "disks": [{"size": 3}], "labels": {"a": "b"}}) == []


def test_problems_reports_every_bad_field_in_one_pass_with_did_you_mean() -> None:
    value = {"nmae": "web", "port": 0, "mode": "ful", "disks": [{"size": 0}, {"sise": 2}]}
    found = MACHINE.problems(value, path="steps[2].with")
    assert [p.path for p in found] == [
        "steps[2].with.nmae",
        "steps[2].with.port",
        "steps[2].with.name",
        "steps[2].with.disks[0].size",
        "steps[2].with.disks[1].sise",
        "steps[2].with.disks[1].size",
        "steps[2].with.mode",
    ]
    messages = {p.path: p.message for p in found}
    assert messages["steps[2].with.nmae"] == "unknown field; did you mean name?"
    assert messages["steps[2].with.mode"].endswith("did you mean full?")
    assert refusal(lambda: MACHINE.validate(value)) == (INVALID_INPUT, "nmae")


def test_a_non_object_is_refused_at_the_given_path() -> None:
    assert refusal(lambda: MACHINE.validate(["web"], path="steps[2].with")) == (
        INVALID_INPUT,
        "steps[2].with",
    )


def test_path_prefix_nests_field_paths() -> None:
    assert refusal(lambda: MACHINE.validate({"name": "web", "port": 0}, path="steps[2].with")) == (
        INVALID_INPUT,
        "steps[2].with.port",
    )


def test_secret_ref_is_normalised_to_the_id_in_both_forms() -> None:
    assert MACHINE.validate({"name": "a", "token": SECRET})["token"] == SECRET
    assert MACHINE.validate({"name": "a", "token": {"secretRef": SECRET}})["token"] == SECRET


def test_json_field_takes_any_json_but_refuses_other_values() -> None:
    args = manifest({"args": field.json()})
    assert args.validate({"args": {"a": [1, "x", None, 2.5]}}) == {"args": {"a": [1, "x", None, 2.5]}}
    assert refusal(lambda: args.validate({"args": {"a": {1, 2}}})) == (INVALID_INPUT, "args.a")
    assert refusal(lambda: args.validate({"args": [b"raw"]})) == (INVALID_INPUT, "args[0]")


def test_list_bounds() -> None:
    disks = manifest({"disks": field.list(field.string(), min_items=1, max_items=2)})
    assert refusal(lambda: disks.validate({"disks": []})) == (INVALID_INPUT, "disks")
    assert refusal(lambda: disks.validate({"disks": ["a", "b", "c"]})) == (INVALID_INPUT, "disks")
    assert disks.validate({"disks": ("a", "b")}) == {"disks": ["a", "b"]}


def test_string_length_and_enum() -> None:
    name = manifest({"n": field.string(min_length=2, enum=["ab", "abc"])})
    assert refusal(lambda: name.validate({"n": "a"})) == (INVALID_INPUT, "n")
    assert refusal(lambda: name.validate({"n": "abcd"})) == (INVALID_INPUT, "n")
    assert name.validate({"n": "abc"}) == {"n": "abc"}


@pytest.mark.parametrize(
    ("text", "ms"),
    [("500ms", 500), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000), ("1d", 86_400_000)],
)
def test_parse_duration(text: str, ms: int) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text", ["", "5", "5 m", "-5m", "5w", "1.5h", "05m", "5m\n", 5, None])
def test_parse_duration_refuses_with_the_given_code_and_path(text: object) -> None:
    assert refusal(lambda: parse_duration(text, path="timeout")) == (INVALID_INPUT, "timeout")
    assert refusal(lambda: parse_duration(text, path="timeout", code=INVALID_CONFIG)) == (
        INVALID_CONFIG,
        "timeout",
    )


def test_default_and_optional_return_new_fields() -> None:
    port = field.int(min=1)
    with_default = port.default(22)
    assert not port.has_default
    assert with_default.default_value == 22
    assert port.optional().is_optional
    assert not port.is_optional
    with pytest.raises(dataclasses.FrozenInstanceError):
        port.is_optional = True  # type: ignore[misc]


def test_a_mutable_default_is_copied_not_shared() -> None:
    tags = ["a"]
    spec = manifest({"tags": field.list(field.string()).default(tags)})
    tags.append("b")
    assert spec.validate({}) == {"tags": ["a"]}


def test_manifest_is_frozen() -> None:
    spec = manifest({"a": field.bool()})
    with pytest.raises(TypeError):
        spec.fields["b"] = field.bool()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.description = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "path"),
    [
        (lambda: field.int(min=1).default(0), "default"),
        (lambda: field.list(field.int()).default([1, "x"]), "default[1]"),
        (lambda: field.json().default({1, 2}), "default"),
        (lambda: field.string(pattern="("), "pattern"),
        (lambda: field.string(min_length=-1), "min_length"),
        (lambda: field.string(min_length=3, max_length=2), "max_length"),
        (lambda: field.string(enum="ab"), "enum"),
        (lambda: field.int(min=5, max=1), "max"),
        (lambda: field.int(min=True), "min"),
        (lambda: field.number(max=float("inf")), "max"),
        (lambda: field.enum([]), "values"),
        (lambda: field.enum(["a", "a"]), "values[1]"),
        (lambda: field.list("string"), "item"),  # type: ignore[arg-type]
        (lambda: field.list(field.int(), min_items=2, max_items=1), "max_items"),
        (lambda: field.map(str), "value"),  # type: ignore[arg-type]
        (lambda: field.object({"a": 1}), "a"),  # type: ignore[dict-item]
        (lambda: manifest({"bad key": field.bool()}), "bad key"),
        (lambda: manifest({"a": "string"}), "a"),  # type: ignore[dict-item]
        (lambda: manifest(["a"]), "fields"),  # type: ignore[arg-type]
    ],
)
def test_badly_built_fields_are_invalid_config(build: Callable[[], object], path: str) -> None:
    assert refusal(build) == (INVALID_CONFIG, path)


def test_json_schema_is_draft_2020_12() -> None:
    spec = manifest(
        {
            "port": field.int(min=1, max=65535).default(50000),
            "disks": field.list(field.object({"size": field.int(min=1)}), max_items=4),
            "labels": field.map(field.string()).optional(),
            "mode": field.enum(["a", "b"]).describe("how"),
        }
    )
    assert spec.json_schema() == {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "port": {"type": "integer", "minimum": 1, "maximum": 65535, "default": 50000},
            "disks": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {"size": {"type": "integer", "minimum": 1}},
                    "required": ["size"],
                    "additionalProperties": False,
                },
            },
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "mode": {"type": "string", "enum": ["a", "b"], "description": "how"},
        },
        "required": ["disks", "mode"],
        "additionalProperties": False,
    }


def test_json_schema_of_secret_ref_accepts_both_forms() -> None:
    schema = field.secret_ref().json_schema()
    assert [branch["type"] for branch in schema["oneOf"]] == ["string", "object"]
    assert schema["oneOf"][1]["required"] == ["secretRef"]


def test_a_map_may_check_its_keys_at_the_keys_path() -> None:
    values = manifest({"values": field.map(field.string(), keys=field.string(pattern=r"^[a-z.]+$"))})
    assert values.validate({"values": {"vm.swappiness": "10"}}) == {"values": {"vm.swappiness": "10"}}
    assert refusal(lambda: values.validate({"values": {"vm swappiness": "10"}})) == (
        INVALID_INPUT, "values.vm swappiness",
    )  # fmt: skip
    schema = values.json_schema()["properties"]["values"]
    assert schema["propertyNames"] == {"type": "string", "pattern": "^[a-z.]+$"}
    assert refusal(lambda: field.map(field.string(), keys=field.int())) == (INVALID_CONFIG, "keys")  # type: ignore[arg-type]
