"""The ``manifest`` / ``field`` schema DSL for step inputs, command payloads and unit settings.

>>> ports = manifest({"port": field.int(min=1, max=65535).default(50000)})
>>> ports.validate({})
{'port': 50000}

``Manifest.validate`` returns fresh, normalised JSON data (defaults filled, ``{"secretRef": …}``
reduced to its id) and refuses unknown keys. A key whose value is ``None`` counts as absent.
Every refusal is ``INVALID_INPUT`` with ``details.path`` (``port``, ``disks[2].size``,
``labels.gpu``); a badly built field is ``INVALID_CONFIG`` when it is built. Fields and manifests
are frozen: ``.default()``, ``.optional()`` and ``.describe()`` return new fields.
``Manifest.problems`` finds every refusal at once (profile validation), with did-you-mean for
unknown fields and enum values.

Longer than the house's ~400 lines: each field kind is a small class whose check and JSON Schema
belong together, and splitting the kinds over modules would only scatter one grammar.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Self

from ._json import freeze_json, thaw_json
from .errors import BcError, ErrorCode, join_path

__all__ = [
    "DURATION_PATTERN",
    "SECRET_REF_PATTERN",
    "Field",
    "Manifest",
    "field",
    "manifest",
    "parse_duration",
]

JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

# One whole number and one unit; "1h30m" is spelled "90m".
DURATION_PATTERN: Final = r"^(0|[1-9][0-9]{0,11})(ms|s|m|h|d)$"
_DURATION_RE: Final = re.compile(DURATION_PATTERN)
_DURATION_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}

SECRET_REF_PATTERN: Final = r"^sec_[0-9A-HJKMNP-TV-Z]{26}$"
_SECRET_REF_RE: Final = re.compile(SECRET_REF_PATTERN)

_KEY_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


_MISSING: Final = _Missing()


def _invalid(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def _bad_config(path: str, message: str) -> BcError:
    return BcError(ErrorCode.INVALID_CONFIG, message, {"path": path})


def _did_you_mean(word: str, names: Sequence[str]) -> str:
    """``"; did you mean x?"`` with the names close to ``word``, or nothing."""
    close = difflib.get_close_matches(word, names, n=2, cutoff=0.7)
    return "; did you mean " + " or ".join(close) + "?" if close else ""


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def parse_duration(value: object, *, path: str = "", code: ErrorCode = ErrorCode.INVALID_INPUT) -> int:
    """Milliseconds in a duration string: ``"500ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"``.

    Raises:
        BcError: ``code`` with ``details.path`` = ``path`` when ``value`` is not a duration.
    """
    match = _DURATION_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise BcError(
            code,
            f"expected a duration like '30s', '5m' or '2h', got {value!r}",
            {"path": path},
        )
    return int(match.group(1)) * _DURATION_MS[match.group(2)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Field:
    """One field of a manifest. Build fields with ``field.*``, never directly."""

    description: str = ""
    is_optional: bool = False
    _default: Any = _MISSING

    def default(self, value: object) -> Self:
        """The same field, filled with ``value`` when absent. The default must fit the field."""
        checked = freeze_json(value, path="default", code=ErrorCode.INVALID_CONFIG)
        try:
            normalised = self._check(thaw_json(checked), "default")
        except BcError as exc:
            raise _bad_config(exc.path or "default", f"default does not fit: {exc.message}") from exc
        frozen = freeze_json(normalised, path="default", code=ErrorCode.INVALID_CONFIG)
        return dataclasses.replace(self, _default=frozen)

    def optional(self) -> Self:
        """The same field, allowed to be absent (and then left out of the result)."""
        return dataclasses.replace(self, is_optional=True)

    def describe(self, text: str) -> Self:
        """The same field with a description for its JSON Schema."""
        if not isinstance(text, str):
            raise _bad_config("description", "description must be a string")
        return dataclasses.replace(self, description=text)

    @property
    def has_default(self) -> bool:
        """Whether ``.default()`` was given."""
        return self._default is not _MISSING

    @property
    def default_value(self) -> Any:
        """A fresh copy of the default (``None`` when there is none)."""
        return None if self._default is _MISSING else thaw_json(self._default)

    @property
    def required(self) -> bool:
        """Whether a value must be given: neither optional nor defaulted."""
        return not self.is_optional and not self.has_default

    def validate(self, value: object, *, path: str = "") -> Any:
        """The normalised ``value``, or ``INVALID_INPUT`` at ``path``."""
        return self._check(value, path)

    def json_schema(self) -> dict[str, Any]:
        """This field as a JSON Schema (draft 2020-12) fragment."""
        schema = self._schema()
        if self.description:
            schema["description"] = self.description
        if self.has_default:
            schema["default"] = thaw_json(self._default)
        return schema

    def _check(self, value: object, path: str) -> Any:
        raise NotImplementedError

    def _schema(self) -> dict[str, Any]:
        raise NotImplementedError


def _python_pattern(pattern: str) -> str:
    # JSON Schema patterns are ECMA-262, where a final `$` means end of string; in Python it
    # also matches before a trailing newline, which would let "1.2\n" through `^[0-9.]+$`.
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StringField(Field):
    """A string, optionally matching ``pattern`` (searched, so anchor it), length and enum."""

    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    enum: tuple[str, ...] | None = None

    def _check(self, value: object, path: str) -> Any:
        if not isinstance(value, str):
            raise _invalid(path, f"expected a string, got {_type_name(value)}")
        if self.min_length is not None and len(value) < self.min_length:
            raise _invalid(path, f"must be at least {self.min_length} characters")
        if self.max_length is not None and len(value) > self.max_length:
            raise _invalid(path, f"must be at most {self.max_length} characters")
        if self.pattern is not None and re.search(_python_pattern(self.pattern), value) is None:
            raise _invalid(path, f"must match {self.pattern}")
        if self.enum is not None and value not in self.enum:
            raise _invalid(path, f"must be one of {', '.join(self.enum)}")
        return value

    def _schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string"}
        if self.pattern is not None:
            schema["pattern"] = self.pattern
        if self.min_length is not None:
            schema["minLength"] = self.min_length
        if self.max_length is not None:
            schema["maxLength"] = self.max_length
        if self.enum is not None:
            schema["enum"] = list(self.enum)
        return schema


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IntField(Field):
    """An integer (never a bool, never a float such as ``5.0``) within bounds."""

    minimum: int | None = None
    maximum: int | None = None

    def _check(self, value: object, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(path, f"expected an integer, got {_type_name(value)}")
        _check_bounds(value, self.minimum, self.maximum, path)
        return value

    def _schema(self) -> dict[str, Any]:
        return _bounds_schema({"type": "integer"}, self.minimum, self.maximum)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NumberField(Field):
    """A finite number (int or float, never a bool) within bounds."""

    minimum: float | None = None
    maximum: float | None = None

    def _check(self, value: object, path: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid(path, f"expected a number, got {_type_name(value)}")
        if not math.isfinite(value):
            raise _invalid(path, "must be a finite number")
        _check_bounds(value, self.minimum, self.maximum, path)
        return value

    def _schema(self) -> dict[str, Any]:
        return _bounds_schema({"type": "number"}, self.minimum, self.maximum)


def _check_bounds(value: float, minimum: float | None, maximum: float | None, path: str) -> None:
    if minimum is not None and value < minimum:
        raise _invalid(path, f"must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise _invalid(path, f"must be at most {maximum}")


def _bounds_schema(schema: dict[str, Any], minimum: float | None, maximum: float | None) -> dict[str, Any]:
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BoolField(Field):
    """``True`` or ``False``; ``0``, ``1`` and ``"true"`` are refused."""

    def _check(self, value: object, path: str) -> Any:
        if not isinstance(value, bool):
            raise _invalid(path, f"expected a boolean, got {_type_name(value)}")
        return value

    def _schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EnumField(Field):
    """One of a fixed set of strings."""

    values: tuple[str, ...] = ()

    def _check(self, value: object, path: str) -> Any:
        if not isinstance(value, str) or value not in self.values:
            near = _did_you_mean(value, self.values) if isinstance(value, str) else ""
            raise _invalid(path, f"must be one of {', '.join(self.values)}, got {value!r}{near}")
        return value

    def _schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.values)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ListField(Field):
    """A list (or tuple) whose items all fit ``item``."""

    item: Field
    min_items: int | None = None
    max_items: int | None = None

    def _check(self, value: object, path: str) -> Any:
        # A string is a sequence too; refusing it catches `disks: "sda"` for `disks: ["sda"]`.
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise _invalid(path, f"expected a list, got {_type_name(value)}")
        if self.min_items is not None and len(value) < self.min_items:
            raise _invalid(path, f"must hold at least {self.min_items} items")
        if self.max_items is not None and len(value) > self.max_items:
            raise _invalid(path, f"must hold at most {self.max_items} items")
        return [self.item._check(item, f"{path}[{i}]") for i, item in enumerate(value)]

    def _schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "items": self.item.json_schema()}
        if self.min_items is not None:
            schema["minItems"] = self.min_items
        if self.max_items is not None:
            schema["maxItems"] = self.max_items
        return schema


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ObjectField(Field):
    """A nested object described by its own manifest."""

    manifest: Manifest

    def _check(self, value: object, path: str) -> Any:
        return self.manifest.validate(value, path=path)

    def _schema(self) -> dict[str, Any]:
        return self.manifest._schema()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MapField(Field):
    """An object with free string keys whose values all fit ``value`` (and keys ``keys``)."""

    value: Field
    keys: StringField | None = None

    def _check(self, value: object, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise _invalid(path, f"expected an object, got {_type_name(value)}")
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _invalid(path, f"keys must be strings, got {_type_name(key)}")
            if self.keys is not None:
                self.keys._check(key, join_path(path, key))
            out[key] = self.value._check(item, join_path(path, key))
        return out

    def _schema(self) -> dict[str, Any]:
        schema = {"type": "object", "additionalProperties": self.value.json_schema()}
        if self.keys is not None:
            schema["propertyNames"] = self.keys._schema()
        return schema


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DurationField(Field):
    """A duration string (``"30s"``); kept as written, read it with ``parse_duration``."""

    def _check(self, value: object, path: str) -> Any:
        parse_duration(value, path=path)
        return value

    def _schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": DURATION_PATTERN}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SecretRefField(Field):
    """A SecretRef: ``"sec_…"`` or ``{"secretRef": "sec_…"}``, normalised to the ``sec_…`` id."""

    def _check(self, value: object, path: str) -> Any:
        ref_path = path
        if isinstance(value, Mapping):
            extra = sorted(str(key) for key in value if key != "secretRef")
            if extra:
                raise _invalid(join_path(path, extra[0]), "unknown field")
            ref_path = join_path(path, "secretRef")
            value = value.get("secretRef")
        if not isinstance(value, str) or _SECRET_REF_RE.fullmatch(value) is None:
            raise _invalid(ref_path, "expected a secret reference sec_…")
        return value

    def _schema(self) -> dict[str, Any]:
        ref = {"type": "string", "pattern": SECRET_REF_PATTERN}
        return {
            "oneOf": [
                ref,
                {
                    "type": "object",
                    "properties": {"secretRef": ref},
                    "required": ["secretRef"],
                    "additionalProperties": False,
                },
            ]
        }


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JsonField(Field):
    """Any JSON value (for pass-through data such as a driver operation's arguments)."""

    def _check(self, value: object, path: str) -> Any:
        return thaw_json(freeze_json(value, path=path, code=ErrorCode.INVALID_INPUT))

    def _schema(self) -> dict[str, Any]:
        return {}


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """An object schema: named fields, no other keys. Build it with ``manifest()``."""

    fields: Mapping[str, Field]
    description: str = ""

    def validate(self, value: object, *, path: str = "") -> dict[str, Any]:
        """The normalised object, or ``INVALID_INPUT`` at the first bad field's path.

        Args:
            value: the object to check (any mapping).
            path: where ``value`` sits in a larger document; prefixes every error path.
        """
        if not isinstance(value, Mapping):
            raise _invalid(path, f"expected an object, got {_type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise _invalid(path, f"keys must be strings, got {_type_name(key)}")
            if key not in self.fields:
                raise self._unknown(path, key)
        out: dict[str, Any] = {}
        for name, spec in self.fields.items():
            item_path = join_path(path, name)
            item = value.get(name)
            if item is not None:
                out[name] = spec._check(item, item_path)
            elif spec.has_default:
                out[name] = spec.default_value
            elif not spec.is_optional:
                raise _invalid(item_path, "is required")
        return out

    def problems(self, value: object, *, path: str = "") -> list[BcError]:
        """Every problem of ``value``, each an ``INVALID_INPUT`` with its path, in nested objects,
        list items and map values too (``validate`` stops at the first); empty when it validates.
        Unknown fields come first, then the fields in their declared order."""
        if not isinstance(value, Mapping):
            return [_invalid(path, f"expected an object, got {_type_name(value)}")]
        found: list[BcError] = []
        for key in value:
            if not isinstance(key, str):
                found.append(_invalid(path, f"keys must be strings, got {_type_name(key)}"))
            elif key not in self.fields:
                found.append(self._unknown(path, key))
        for name, spec in self.fields.items():
            item_path = join_path(path, name)
            item = value.get(name)
            if item is not None:
                found += _field_problems(spec, item, item_path)
            elif spec.required:
                found.append(_invalid(item_path, "is required"))
        return found

    def _unknown(self, path: str, key: str) -> BcError:
        return _invalid(join_path(path, key), "unknown field" + _did_you_mean(key, list(self.fields)))

    def json_schema(self) -> dict[str, Any]:
        """This manifest as a JSON Schema document (draft 2020-12)."""
        return {"$schema": JSON_SCHEMA_DIALECT, **self._schema()}

    def _schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {name: spec.json_schema() for name, spec in self.fields.items()},
            "additionalProperties": False,
        }
        required = [name for name, spec in self.fields.items() if spec.required]
        if required:
            schema["required"] = required
        if self.description:
            schema["description"] = self.description
        return schema


def _field_problems(spec: Field, value: object, path: str) -> list[BcError]:
    """Every problem of one field's value: containers look into each item, the rest is its
    ``_check``."""
    if isinstance(spec, ObjectField) and isinstance(value, Mapping):
        return spec.manifest.problems(value, path=path)
    if (
        isinstance(spec, ListField)
        and isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and (spec.min_items is None or len(value) >= spec.min_items)
        and (spec.max_items is None or len(value) <= spec.max_items)
    ):
        return [p for i, item in enumerate(value) for p in _field_problems(spec.item, item, f"{path}[{i}]")]
    if isinstance(spec, MapField) and isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return [p for k, item in value.items() for p in _field_problems(spec.value, item, join_path(path, k))]
    try:
        spec._check(value, path)
    except BcError as err:
        return [err]
    return []


def manifest(fields: Mapping[str, Field], /, *, description: str = "") -> Manifest:
    """A frozen manifest of ``fields`` (keys are JSON names such as ``tokenTtlSeconds``).

    Raises:
        BcError: ``INVALID_CONFIG`` with the offending key as ``details.path``.
    """
    if not isinstance(fields, Mapping):
        raise _bad_config("fields", "a manifest takes a mapping of name to field")
    frozen: dict[str, Field] = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or _KEY_RE.fullmatch(name) is None:
            raise _bad_config(str(name), "field names are identifiers such as tokenTtlSeconds")
        if not isinstance(spec, Field):
            raise _bad_config(name, f"expected a field.* value, got {_type_name(spec)}")
        frozen[name] = spec
    if not isinstance(description, str):
        raise _bad_config("description", "description must be a string")
    return Manifest(MappingProxyType(frozen), description)


def _count(value: object, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad_config(path, "must be a non-negative integer")
    return value


def _ordered(low: int | None, high: int | None, path: str) -> None:
    if low is not None and high is not None and low > high:
        raise _bad_config(path, "upper bound is below the lower bound")


def _string_set(values: object, path: str) -> tuple[str, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise _bad_config(path, "expected a non-empty list of strings")
    seen: list[str] = []
    for i, value in enumerate(values):
        if not isinstance(value, str) or value in seen:
            raise _bad_config(f"{path}[{i}]", "values are distinct strings")
        seen.append(value)
    return tuple(seen)


def _string(
    *,
    pattern: str | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
    enum: Sequence[str] | None = None,
) -> StringField:
    """A string field."""
    if pattern is not None:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise _bad_config("pattern", f"not a regular expression: {exc}") from exc
    low, high = _count(min_length, "min_length"), _count(max_length, "max_length")
    _ordered(low, high, "max_length")
    values = None if enum is None else _string_set(enum, "enum")
    return StringField(pattern=pattern, min_length=low, max_length=high, enum=values)


def _int(*, min: int | None = None, max: int | None = None) -> IntField:
    """An integer field."""
    for name, bound in (("min", min), ("max", max)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise _bad_config(name, "must be an integer")
    _ordered(min, max, "max")
    return IntField(minimum=min, maximum=max)


def _number(*, min: float | None = None, max: float | None = None) -> NumberField:
    """A number field."""
    for name, bound in (("min", min), ("max", max)):
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound)
        ):
            raise _bad_config(name, "must be a finite number")
    if min is not None and max is not None and min > max:
        raise _bad_config("max", "upper bound is below the lower bound")
    return NumberField(minimum=min, maximum=max)


def _bool() -> BoolField:
    """A boolean field."""
    return BoolField()


def _enum(values: Sequence[str], /) -> EnumField:
    """A field holding one of ``values``."""
    return EnumField(values=_string_set(values, "values"))


def _list(item: Field, /, *, min_items: int | None = None, max_items: int | None = None) -> ListField:
    """A list field whose items fit ``item``."""
    if not isinstance(item, Field):
        raise _bad_config("item", "expected a field.* value")
    low, high = _count(min_items, "min_items"), _count(max_items, "max_items")
    _ordered(low, high, "max_items")
    return ListField(item=item, min_items=low, max_items=high)


def _object(fields: Manifest | Mapping[str, Field], /) -> ObjectField:
    """A nested object field, from a manifest or a mapping of fields."""
    nested = fields if isinstance(fields, Manifest) else manifest(fields)
    return ObjectField(manifest=nested)


def _map(value: Field, /, *, keys: StringField | None = None) -> MapField:
    """An object with free string keys whose values fit ``value``; ``keys``, a
    ``field.string(...)``, checks each key (at the key's path)."""
    if not isinstance(value, Field):
        raise _bad_config("value", "expected a field.* value")
    if keys is not None and not isinstance(keys, StringField):
        raise _bad_config("keys", "expected a field.string(...)")
    return MapField(value=value, keys=keys)


def _duration() -> DurationField:
    """A duration string field (``"500ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"``)."""
    return DurationField()


def _secret_ref() -> SecretRefField:
    """A SecretRef field: ``"sec_…"`` or ``{"secretRef": "sec_…"}``, normalised to the id."""
    return SecretRefField()


def _json() -> JsonField:
    """A field taking any JSON value."""
    return JsonField()


class _FieldFactory:
    """The ``field`` namespace: ``field.int(min=1)``, ``field.list(field.string())``, …"""

    __slots__ = ()

    # Assigned last: names like `int` and `list` would shadow the builtins in this class body.
    string = staticmethod(_string)
    int = staticmethod(_int)
    number = staticmethod(_number)
    bool = staticmethod(_bool)
    enum = staticmethod(_enum)
    list = staticmethod(_list)
    object = staticmethod(_object)
    map = staticmethod(_map)
    duration = staticmethod(_duration)
    secret_ref = staticmethod(_secret_ref)
    json = staticmethod(_json)


field: Final = _FieldFactory()
