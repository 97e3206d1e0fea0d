"""die_with_parent: a child process of the server ends when the process that started it does, however it ends."""
from __future__ import annotations

import contextlib
import ctypes
import signal


def die_with_parent() -> None:
    """Linux: get SIGTERM when the process that started this one dies, however it dies (no orphaned children).

    Used by the front-end and engine processes, and by a front-end's JSON helper process: a front-end ended by
    SIGKILL (a heartbeat verdict, the OOM killer) cannot stop its helper, which held its own pipes open and ran
    on as an orphan."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the socket-closed path still stops us
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
