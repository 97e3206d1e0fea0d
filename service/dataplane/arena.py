"""Request arrays from front-end processes to the engine process through shared memory.

A request's input is most of its bytes (binary HTTP at concurrency 64, lengths 20..200,
I=40: ~18 KB a request), and carried on the Unix socket those bytes cost the engine
process's one busy thread about as much as everything else it does per request: the
socket read, the copy out of the frame (``bench/engine_process.py``, 2-core VM: 43-45 µs of
the engine process per request with I=40, 22-24 µs with I=1). So each front-end keeps an
:class:`Arena`, a block of shared memory that the engine process maps once
(:func:`attach`): an array the front-end sends is written there and only its place
travels on the socket (see :mod:`service.wire`), and the engine process reads it in place.

The front-end frees an array's place when the engine process has answered the message
that carried it; the engine process reads a message's arrays only until it answers it
(its batch has been merged and run by then), so a place is never reused while read.
When the arena is full, when an array is small, or when shared memory is not available
(no ``/dev/shm``, too small to reserve the arena: Docker's default is 64 MiB, see the
README), arrays travel on the socket as before; nothing else changes.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import secrets
import numpy as np

from ..engines import shared_host

log = logging.getLogger("rnnserve.dataplane.arena")

SHM_DIR = "/dev/shm"
MIN_BYTES = 2048  # smaller arrays cost less on the socket than a place in the arena
_ALIGN = 64


class Arena:
    """A front-end's block of shared memory, handing out places for arrays first-fit."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve every page now: on a full tmpfs, writing into a file's hole kills the process
            # (SIGBUS); reserving fails here instead, with ENOSPC, and the front-end goes without.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._map, np.uint8)
        self._free: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted, never adjacent

    @classmethod
    def create(cls, size: int) -> Arena | None:
        """A new arena of ``size`` bytes in ``/dev/shm``, or None (logged) when there is none to have."""
        if size <= 0:
            return None
        path = os.path.join(SHM_DIR, f"rnnserve-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            return cls(path, size)
        except OSError as exc:
            log.warning("no shared memory for request arrays (%s: %s); they travel on the socket instead. "
                        "Give the container more /dev/shm (docker run --shm-size) or set --frontend-shm-mb 0",
                        path, exc)
            return None

    def put(self, array: np.ndarray) -> int | None:
        """Copy C-contiguous ``array`` into a free place; its offset, or None when none is large enough."""
        need = (array.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                self._buffer[start:start + array.nbytes] = array.reshape(-1).view(np.uint8)
                return start
        return None

    def release(self, places: list[tuple[int, int]]) -> None:
        """Free places given by :meth:`put` ((offset, nbytes) each) once the engine process is done with them."""
        for start, nbytes in places:
            length = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            i = bisect.bisect_left(self._free, (start, 0))
            if i < len(self._free) and start + length == self._free[i][0]:  # joins the next free place
                length += self._free[i][1]
                del self._free[i]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and the one before
                start, length = self._free[i - 1][0], self._free[i - 1][1] + length
                i -= 1
                del self._free[i]
            self._free.insert(i, (start, length))

    @property
    def free_bytes(self) -> int:
        """Bytes not handed out."""
        return sum(length for _, length in self._free)

    def close(self) -> None:
        """Remove the file if the engine process has not (the mapping goes when nothing uses it)."""
        with contextlib.suppress(FileNotFoundError):  # the engine process removed it when it mapped it
            os.unlink(self.path)


# The engine process's mappings of the front-ends' arenas, by path.
_attached: dict[str, mmap.mmap] = {}


def attach(path: str, size: int) -> None:
    """Map a front-end's arena in this (the engine) process and remove its file, which nothing opens again."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} is not the {size}-byte arena the front-end announced")
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)
    _attached[path] = mapped
    shared_host.announce(path, mapped)  # a GPU engine maps it for the device (batches upload straight from it)


def detach(path: str) -> None:
    """Forget a front-end's arena (its connection closed); arrays still in use keep the mapping alive."""
    if _attached.pop(path, None) is not None:
        shared_host.withdraw(path)


def shared_array(path: str, offset: int, dtype: str, shape: tuple) -> np.ndarray:
    """The array a front-end put at ``offset`` of its arena, read in place (unpickling in the engine process)."""
    # one constructor over the mapping: a NumPy product, slice and view cost several µs a request here
    return np.ndarray(shape, dtype=dtype, buffer=_attached[path], offset=offset)


class Placing:
    """Puts a frame's large arrays into ``arena`` while it is pickled, and lists the places taken."""

    __slots__ = ("arena", "places")

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.places: list[tuple[int, int]] = []

    def place(self, array: np.ndarray) -> tuple | None:
        """The reconstructor of ``array`` in the arena, or None to send it on the socket."""
        if array.nbytes < MIN_BYTES:
            return None
        offset = self.arena.put(array)
        if offset is None:
            return None
        self.places.append((offset, array.nbytes))
        return shared_array, (self.arena.path, offset, array.dtype.str, array.shape)
