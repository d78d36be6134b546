"""Request/reply envelopes: a tagged union decoded once."""

from __future__ import annotations

from typing import Any

import msgspec

from ..core.errors import BcError, ErrorCode, ErrorInfo

__all__ = ["Err", "Ok", "Reply", "decode_reply", "encode_error", "encode_ok", "unwrap"]


class Ok(msgspec.Struct, frozen=True, kw_only=True, tag="ok", tag_field="status"):
    result: Any = None


class Err(msgspec.Struct, frozen=True, kw_only=True, tag="error", tag_field="status"):
    error: ErrorInfo


Reply = Ok | Err

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Reply)


def encode_ok(result: Any) -> bytes:
    return _encoder.encode(Ok(result=result))


def encode_error(err: BcError) -> bytes:
    return _encoder.encode(Err(error=err.to_wire()))


def decode_reply(data: bytes) -> Reply:
    """Decode a reply; a malformed one becomes an ``Err`` with code ``INTERNAL``."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        return Err(
            error=ErrorInfo(
                code=ErrorCode.INTERNAL.value,
                message=f"malformed reply from service: {exc}",
            )
        )


def unwrap(data: bytes) -> Any:
    """The result of a reply, or raise its error as a ``BcError``."""
    match decode_reply(data):
        case Ok(result=result):
            return result
        case Err(error=error):
            raise BcError.from_wire(error)
