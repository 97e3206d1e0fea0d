"""One model's load and unload at a time across front-end processes (``--frontends N --engines M``).

Each front-end sends a load or unload to every engine process itself. Two front-ends
loading and unloading one model at once reached the engine processes in different
orders, and left the model loaded in one and unloaded in the other: half the requests
answered, the model shown not ready. Holding this lock (one file per model in the
server's socket folder, ``flock``) around the whole fan-out puts every engine process
through the same sequence. The kernel drops a lock whose holder dies, so a front-end
that dies mid-load does not wedge the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
from typing import AsyncIterator

_POLL_S = 0.005  # loads take milliseconds to seconds; a poll keeps waiting cancellable without a thread


@contextlib.asynccontextmanager
async def model_lock(folder: str, model: str) -> AsyncIterator[None]:
    """Hold the cross-process lock of ``model``'s repository operations (waiting, cancellably, while another
    front-end, or another request of this one, holds it)."""
    # hashed: the name reaches here before any engine process has checked it is a model name
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    fd = os.open(os.path.join(folder, f"repository-{digest}.lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                # a lock of this open file description: another request of this same process waits for it too
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EINTR):
                    raise
            await asyncio.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock
