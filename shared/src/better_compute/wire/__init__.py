"""Messages and subjects on the bus.

Every request/reply answer is a ``Reply``: ``Ok`` with a result, or ``Err`` with an
``ErrorInfo``. Documents and messages are camelCase JSON.
"""

from .envelope import Err, Ok, Reply, decode_reply, encode_error, encode_ok, unwrap
from .subjects import Subjects

__all__ = ["Err", "Ok", "Reply", "Subjects", "decode_reply", "encode_error", "encode_ok", "unwrap"]
