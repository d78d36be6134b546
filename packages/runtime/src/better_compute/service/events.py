"""The durable event feed: JetStream stream ``BC_EVENTS`` over ``bc.events.>`` (docs/events.md).

Services publish events as plain NATS messages on ``bc.events.<kind>.<id>`` (a wake-up for the
other services, which never trust more than that); the stream keeps them, bounded in age and
bytes (``[events]`` settings), for consumers outside the control plane and for ``bcx events
tail``. bc-command-queue creates the stream at start (it holds the JetStream rights in the
deployment's NATS accounts) and sets its bounds again when the settings changed.
"""

from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as Nats
from nats.js import api

from ..config import EventsSettings
from ..wire.subjects import Subjects

__all__ = ["ensure_events_stream", "events_stream_config"]

_STREAM_IN_USE = 10058


def events_stream_config(subjects: Subjects, settings: EventsSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=subjects.events_stream(),
        description="Better Compute event feed (docs/events.md)",
        subjects=[subjects.events_feed()],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        num_replicas=settings.replicas,
        max_age=settings.max_age.seconds,
        max_bytes=settings.max_bytes,
        discard=api.DiscardPolicy.OLD,
        # readers outside the control plane (bcx events tail) read by direct get, which creates
        # nothing on the server: operators may create no consumer here (deploy/nats)
        allow_direct=True,
    )


async def ensure_events_stream(nc: Nats, subjects: Subjects, settings: EventsSettings, log: Any) -> None:
    """Create the stream, or bring its bounds to the settings; idempotent, safe in several
    instances at once. A fault of NATS or JetStream is raised (the caller's start retries)."""
    js = nc.jetstream(timeout=5.0)
    config = events_stream_config(subjects, settings)
    try:
        await js.add_stream(config)
        return
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != _STREAM_IN_USE:
            raise
    info = await js.stream_info(subjects.events_stream())
    have = info.config
    if (have.max_age, have.max_bytes, have.num_replicas, bool(have.allow_direct)) != (
        config.max_age,
        config.max_bytes,
        config.num_replicas,
        True,
    ):
        await js.update_stream(config)
        log.info(
            "events_stream_updated",
            stream=config.name,
            max_age_s=config.max_age,
            max_bytes=config.max_bytes,
            replicas=config.num_replicas,
        )
