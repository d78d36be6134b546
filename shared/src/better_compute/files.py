"""Writing a file whole or not at all: ``atomic_write``.

Every file Better Compute keeps for itself (a key file, an agent's enrollment, bcx's contexts, a
node's units, a boot entry) is written the same way: into a new temporary file beside it (the
``mode`` given at creation, 0600 unless said otherwise, so a private file is never readable by
others even for a moment), flushed to the disk (``fsync``), then renamed over the target and the
folder synced, so a crash leaves the old file or the new one, never a part. ``exclusive=True``
creates the file only if there is none (a hard link instead of the rename): two processes racing
to create it end with one whole file, and the loser learns it (``FileExistsError``).

This module imports nothing of ``better_compute``: every layer may use it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["atomic_write"]


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    mode: int = 0o600,
    exclusive: bool = False,
    sync_folder: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) in one step, as a file of ``mode``.
    ``sync_folder=False``: the caller syncs the folder itself once after several writes (the
    replacement is durable only then; the data is synced before it takes the name).

    Raises:
        FileExistsError: with ``exclusive``, when ``path`` exists already (it is left as it was).
        OSError: the folder is missing or not writable, the disk is full, … (``path`` unchanged).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    body = data.encode() if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits the caller asked for
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, target)
        else:
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    if sync_folder:
        _sync_folder(target.parent)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (the folder's entry); not every system can open a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
