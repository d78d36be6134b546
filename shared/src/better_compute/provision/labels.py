"""Label expressions: ``when:`` of a config unit, evaluated against a node's labels.

The grammar is Kubernetes' label selectors, with ``and`` as well as ``,`` between requirements::

    expression  := requirement (("and" | ",") requirement)*
    requirement := key ("=" | "==") value        the label is there and equals value
                 | key "!=" value                 the label is absent or differs
                 | key "in" "(" values ")"        the label is there and is one of values
                 | key "notin" "(" values ")"     the label is absent or none of values
                 | key "exists" | key             the label is there (any value)
                 | "!" key                        the label is absent
                 | key (">" | ">=" | "<" | "<=") number
                                                  the label is there, is a number, and compares so
    values      := value ("," value)*
    key         := letters, digits and ._/- (a label key: ``nvidia.com/gpu.product``)
    value       := letters, digits and ._/:+- , or a "double-quoted" string (``\\"`` inside)

``gpu.vendor=nvidia and rack in (r1, r2) and !maintenance``; ``inventory.memory_gib>=512``
(a number: digits with an optional sign and decimal point). An empty expression is refused; so is
anything else, with the character where it went wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

from better_compute.core.errors import BcError, ErrorCode

__all__ = ["MAX_EXPRESSION", "LabelExpression", "Requirement", "parse_label_expression"]

MAX_EXPRESSION: Final = 4096
Operator = Literal["=", "!=", "in", "notin", "exists", "!exists", ">", ">=", "<", "<="]
_COMPARISONS: Final = (">=", "<=", ">", "<")
_NUMBER: Final = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")

_TOKEN: Final = re.compile(
    r"""\s*(?:
      (?P<op>==|!=|>=|<=|=|>|<|\(|\)|,|!)
    | "(?P<quoted>(?:[^"\\]|\\.)*)"
    | (?P<word>[A-Za-z0-9._/:+-]+)
    )""",
    re.VERBOSE,
)
_KEY: Final = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement on one label."""

    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        match self.operator:
            case "exists":
                return value is not None
            case "!exists":
                return value is None
            case "=" | "in":
                return value is not None and value in self.values
            case "!=" | "notin":
                return value is None or value not in self.values
            case ">" | ">=" | "<" | "<=":
                if value is None or not _NUMBER.match(value.strip()):
                    return False
                have, want = float(value), float(self.values[0])
                match self.operator:
                    case ">":
                        return have > want
                    case ">=":
                        return have >= want
                    case "<":
                        return have < want
                    case _:
                        return have <= want

    def __str__(self) -> str:
        vals = [_show(v) for v in self.values]
        match self.operator:
            case "exists":
                return f"{self.key} exists"
            case "!exists":
                return f"!{self.key}"
            case "=" | "!=" | ">" | ">=" | "<" | "<=":
                return f"{self.key}{self.operator}{vals[0]}"
            case _:
                return f"{self.key} {self.operator} ({', '.join(vals)})"


def _show(value: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9._/:+-]+", value) and value not in _KEYWORDS:
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


_KEYWORDS: Final = frozenset({"and", "in", "notin", "exists"})


@dataclass(frozen=True, slots=True)
class LabelExpression:
    """A parsed expression: every requirement must hold (``and``)."""

    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` is selected."""
        return all(r.matches(labels) for r in self.requirements)

    def __str__(self) -> str:
        return " and ".join(str(r) for r in self.requirements)


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: Literal["op", "quoted", "word", "end"]
    text: str
    at: int


def _tokens(text: str, fail: _Fail) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            fail(len(text) - len(text[pos:].lstrip()), "unexpected character")
        if (op := m.group("op")) is not None:
            out.append(_Tok("op", op, m.start("op")))
        elif (word := m.group("word")) is not None:
            out.append(_Tok("word", word, m.start("word")))
        else:
            quoted = re.sub(r"\\(.)", r"\1", m.group("quoted"))
            out.append(_Tok("quoted", quoted, m.start("quoted") - 1))
        pos = m.end()
    out.append(_Tok("end", "", len(text)))
    return out


class _Fail:
    def __init__(self, text: str, path: str, code: ErrorCode) -> None:
        self.text, self.path, self.code = text, path, code

    def __call__(self, at: int, what: str) -> NoReturn:
        raise BcError(
            self.code,
            f"bad label expression at character {at + 1}: {what}"
            " (like: gpu=nvidia and rack in (r1, r2) and !maintenance)",
            {"path": self.path, "at": at},
        )


class _Parser:
    def __init__(self, tokens: list[_Tok], fail: _Fail) -> None:
        self.toks, self.i, self.fail = tokens, 0, fail

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect_op(self, op: str) -> None:
        tok = self.take()
        if tok.kind != "op" or tok.text != op:
            self.fail(tok.at, f"expected {op!r}")

    def key(self) -> str:
        tok = self.take()
        if tok.kind != "word" or not _KEY.match(tok.text) or tok.text in _KEYWORDS:
            self.fail(tok.at, "expected a label key (letters, digits and ._/-)")
        return tok.text

    def value(self) -> str:
        tok = self.take()
        if tok.kind == "quoted" or (tok.kind == "word" and tok.text not in _KEYWORDS):
            return tok.text
        self.fail(tok.at, "expected a value")

    def values(self) -> tuple[str, ...]:
        self.expect_op("(")
        out = [self.value()]
        while self.peek().kind == "op" and self.peek().text == ",":
            self.take()
            out.append(self.value())
        self.expect_op(")")
        return tuple(out)

    def requirement(self) -> Requirement:
        if self.peek().kind == "op" and self.peek().text == "!":
            self.take()
            return Requirement(self.key(), "!exists")
        key = self.key()
        tok = self.peek()
        if tok.kind == "op" and tok.text in _COMPARISONS:
            self.take()
            at = self.peek().at
            number = self.value()
            if not _NUMBER.match(number):
                self.fail(at, f"expected a number after {tok.text}")
            return Requirement(key, tok.text, (number,))  # type: ignore[arg-type]
        if tok.kind == "op" and tok.text in ("=", "==", "!="):
            self.take()
            return Requirement(key, "!=" if tok.text == "!=" else "=", (self.value(),))
        if tok.kind == "word" and tok.text in ("in", "notin"):
            self.take()
            return Requirement(key, "in" if tok.text == "in" else "notin", self.values())
        if tok.kind == "word" and tok.text == "exists":
            self.take()
        return Requirement(key, "exists")

    def expression(self) -> LabelExpression:
        reqs = [self.requirement()]
        while True:
            tok = self.take()
            if tok.kind == "end":
                return LabelExpression(tuple(reqs))
            if not ((tok.kind == "word" and tok.text == "and") or (tok.kind == "op" and tok.text == ",")):
                self.fail(tok.at, "expected 'and', ',' or the end")
            reqs.append(self.requirement())


def parse_label_expression(
    text: object, *, path: str = "when", code: ErrorCode = ErrorCode.INVALID_INPUT
) -> LabelExpression:
    """Parse a label expression (grammar in this module's docstring).

    Args:
        text: the expression.
        path: ``details.path`` of a refusal (``hostConfig.units[0].when``).
        code: the refusal's code: ``INVALID_INPUT`` for requests, ``INVALID_CONFIG`` for code.

    Raises:
        BcError: ``code`` at ``path``, the message naming the character where it went wrong.
    """
    if not isinstance(text, str) or not text.strip():
        raise BcError(code, "a label expression is a non-empty string", {"path": path})
    if len(text) > MAX_EXPRESSION:
        raise BcError(code, f"a label expression is at most {MAX_EXPRESSION} characters", {"path": path})
    fail = _Fail(text, path, code)
    return _Parser(_tokens(text, fail), fail).expression()
