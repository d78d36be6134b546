"""The agent SDK: what a site agent or a node's bcd builds on.

Join once (``enroll``, then ``save_enrollment``), then run an ``Agent`` with a handler per
command kind. The agent announces itself, pulls its commands from its site's stream, claims
each before running it, runs each at most once (its ``Journal`` remembers across restarts),
reports progress and results, and signs everything it sends. A handler awaits ``before_call``
before every try of a call to a machine: it stops there once a cancel reached the agent; it
reports a try that failed and will be tried again with ``call_failed`` (the command's progress
names the failure until ``call_answered``).

An agent process imports nats-py here: without the optional extras it would load along (aiohttp,
rich: ``better_compute._imports``).
"""

from .._imports import defer_optional_imports

defer_optional_imports()

# ruff: noqa: E402  (the imports below come after that call on purpose)
from ..crypto import result_document
from ..wire.agent import CommandDelivery, payload_digest
from .identity import Enrollment, enroll, load_enrollment, save_enrollment
from .journal import Journal, JournalEntry
from .runner import (
    MAX_RESULT_BYTES,
    Agent,
    Command,
    CommandCancelled,
    CommandHandler,
    CommandRejected,
    before_call,
    before_call_blocking,
    call_answered,
    call_failed,
)

__all__ = [
    "MAX_RESULT_BYTES",
    "Agent",
    "Command",
    "CommandCancelled",
    "CommandDelivery",
    "CommandHandler",
    "CommandRejected",
    "Enrollment",
    "Journal",
    "JournalEntry",
    "before_call",
    "before_call_blocking",
    "call_answered",
    "call_failed",
    "enroll",
    "load_enrollment",
    "payload_digest",
    "result_document",
    "save_enrollment",
]
