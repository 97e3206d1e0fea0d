"""One model's load and unload at a time across front-end processes (``--frontends N --engines M``).

Each front-end sends a load or unload to every engine process itself. Two front-ends
loading and unloading one model at once reached the engine processes in different
orders, and left the model loaded in one and unloaded in the other: half the requests
answered, the model shown not ready. Holding this lock around the whole fan-out puts
every engine process through the same sequence.

Two levels: within a front-end, an ``asyncio.Lock`` keeps its requests in arrival order
(first come, first served, as one process's registry does; a load whose client left
still runs in its turn, before a later unload); across front-ends, a ``flock`` on a
file in the server's socket folder, which only the front-end's first waiter polls.
Models share 64 lock files by a hash of their name, so a client naming endless models
cannot grow the folder (a file per name did), and two models now and then wait for
each other. The kernel drops a lock whose holder dies, so a front-end that dies
mid-load does not wedge the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import zlib
from typing import AsyncIterator

from ..errors import Unavailable

_BUCKETS = 64
_POLL_S = 0.01  # loads take milliseconds to seconds; a poll keeps waiting cancellable without a thread


class RepositoryLock:
    """The repository lock of one front-end process for the server whose socket folder is ``folder``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._local: dict[int, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, model: str) -> AsyncIterator[None]:
        """Hold ``model``'s lock, waiting (cancellably) behind this front-end's earlier requests, then for any
        other front-end's holder."""
        bucket = zlib.crc32(model.encode("utf-8", "surrogatepass")) % _BUCKETS
        local = self._local.setdefault(bucket, asyncio.Lock())
        async with local:
            fd = self._open(bucket)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as exc:
                        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                            raise
                    await asyncio.sleep(_POLL_S)
                yield
            finally:
                os.close(fd)  # releases the lock

    def _open(self, bucket: int) -> int:
        path = os.path.join(self.folder, f"repository-{bucket:02d}.lock")
        try:
            # the folder may have gone (a tmp cleaner): made again, as the lock needs only a shared file
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
            return os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise Unavailable(f"the server cannot take its repository lock {path} ({exc.strerror}); loads and "
                              f"unloads need it with several engine processes: check the server's temporary "
                              f"folder, or restart the server") from None
