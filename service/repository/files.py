"""Reading a repository's files: regular files only, and small ones where they are settings.

A model folder is written by people and tools; a FIFO or a link to ``/dev/zero`` in place of a model
file or ``config.json`` must not hang a load (holding the model's lock, keeping readiness false and
the server from stopping) or read without end until the kernel kills the server.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, Callable, TypeVar

_T = TypeVar("_T")

from ..errors import InvalidInput


def open_regular(path: Path, what: str, fix: str, limit: int | None = None) -> BinaryIO:
    """``path`` (links followed) open for reading, refused with InvalidInput unless it is a regular file of at
    most ``limit`` bytes; ``what`` names it in the message, ``fix`` says what to do."""
    try:
        info = os.stat(path)  # before opening: opening a FIFO blocks
        if not stat.S_ISREG(info.st_mode):
            kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode)
                    else "a device or socket")
            raise InvalidInput(f"{what} is {kind}, not a regular file; {fix}")
        if limit is not None and info.st_size > limit:
            raise InvalidInput(f"{what} has {info.st_size:,} bytes, more than the {limit:,} it may have; {fix}")
        return open(path, "rb")
    except OSError as exc:  # no permission, a dangling link
        raise InvalidInput(f"{what} cannot be read ({type(exc).__name__}: {exc.strerror or exc}); {fix}") from None


def read_regular(path: Path, what: str, fix: str, limit: int | None = None) -> bytes:
    """The bytes of ``path``, with :func:`open_regular`'s checks."""
    with open_regular(path, what, fix, limit) as f:
        return read_from(f, -1, what, fix)


def read_from(f: BinaryIO, size: int, what: str, fix: str) -> bytes:
    """``size`` bytes (-1: the rest) of ``f``, an OSError named as :func:`open_regular` names one."""
    try:
        return f.read(size)
    except OSError as exc:  # an I/O error mid-file
        raise InvalidInput(f"{what} cannot be read ({type(exc).__name__}: {exc.strerror or exc}); {fix}") from None

def looked_at(test: Callable[[], bool], unreadable: _T) -> bool | _T:
    """``test()`` (a path's ``exists``, ``is_dir``, ``is_file``), or ``unreadable`` where the path cannot be looked at:
    Python 3.11 raises PermissionError for a path inside a folder the server may not enter, and one such path
    aborted a whole repository scan or model load."""
    try:
        return test()
    except OSError:
        return unreadable
