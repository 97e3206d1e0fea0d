"""Reading a repository's files: regular files only, and small ones where they are settings.

A model folder is written by people and tools; a FIFO or a link to ``/dev/zero`` in place of a model
file or ``config.json`` must not hang a load (holding the model's lock, keeping readiness false and
the server from stopping) or read without end until the kernel kills the server.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InvalidInput


def read_regular(path: Path, what: str, fix: str, limit: int | None = None) -> bytes:
    """The bytes of ``path`` (links followed), refused with InvalidInput unless it is a regular file of at most
    ``limit`` bytes; ``what`` names it in the message, ``fix`` says what to do."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode)
                    else "a device or socket")
            raise InvalidInput(f"{what} is {kind}, not a regular file; {fix}")
        if limit is not None and info.st_size > limit:
            raise InvalidInput(f"{what} has {info.st_size:,} bytes, more than the {limit:,} it may have; {fix}")
        return path.read_bytes()
    except OSError as exc:  # no permission, a dangling link
        raise InvalidInput(f"{what} cannot be read ({type(exc).__name__}: {exc.strerror or exc}); {fix}") from None
