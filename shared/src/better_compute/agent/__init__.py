"""The agent SDK: what a site agent or a node's bcd builds on.

Join once (``enroll``, then ``save_enrollment``), then run an ``Agent`` with a handler per
command kind. The agent announces itself, pulls its commands from its site's stream, claims
each before running it, runs each at most once (its ``Journal`` remembers across restarts),
reports progress and results, and signs everything it sends.
"""

from ..crypto import result_document
from ..wire.agent import CommandDelivery, payload_digest
from .identity import Enrollment, enroll, load_enrollment, save_enrollment
from .journal import Journal, JournalEntry
from .runner import MAX_RESULT_BYTES, Agent, Command, CommandHandler, CommandRejected

__all__ = [
    "MAX_RESULT_BYTES",
    "Agent",
    "Command",
    "CommandDelivery",
    "CommandHandler",
    "CommandRejected",
    "Enrollment",
    "Journal",
    "JournalEntry",
    "enroll",
    "load_enrollment",
    "payload_digest",
    "result_document",
    "save_enrollment",
]
