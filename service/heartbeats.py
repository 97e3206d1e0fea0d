"""Child processes' heartbeats: a front-end or engine process that stopped running is found and ended.

A child that exits is seen at once (:func:`service.children.watch_children`), but one that is
stopped (SIGSTOP, a debugger) or wedged (a deadlock, a loop that never yields) stays alive
and keeps what it holds: its kept-alive HTTP connections, its gRPC connections, the requests
routed to it. Health probes cannot tell, since they reach whichever front-end accepts them.
So each child's event loop counts in a shared slot every :data:`BEAT_S`, and the supervisor,
which watches the slots, ends a child whose count has not moved for ``child_stall_timeout_s``
of the supervisor's own running time; the server then exits non-zero, as when a child dies,
for its supervisor (Kubernetes, systemd) to start it afresh.

Time is counted on the supervisor's side in its own ticks, each worth at most two tick
lengths: a whole process group stopped and continued (Ctrl-Z, then ``fg``) comes back with
every slot still and the supervisor's clock far ahead, and must not end every child.
"""
from __future__ import annotations

import asyncio
from typing import Any

BEAT_S = 0.25  # how often a child counts; the supervisor looks every WATCH_S
WATCH_S = 0.5


class Heartbeats:
    """One counter per child in shared memory, and the supervisor's view of how long each has been still."""

    def __init__(self, ctx: Any, children: int) -> None:
        self.counts = ctx.RawArray("Q", children)  # lock-free: one writer per slot, a torn read only delays
        self._seen = [0] * children
        self._still_s = [0.0] * children

    def stalled(self, elapsed_s: float, timeout_s: float) -> list[int]:
        """The slots whose count has not moved for ``timeout_s`` of watching, after a look ``elapsed_s`` after
        the last one (counted as at most two looks' worth: see the module's note). A slot that never counted
        (its child still starting) is never stalled: starting has its own timeout."""
        step = min(elapsed_s, 2 * WATCH_S)
        out = []
        for k, count in enumerate(self.counts):
            if count != self._seen[k] or count == 0:
                self._seen[k] = count
                self._still_s[k] = 0.0
                continue
            self._still_s[k] += step
            if timeout_s > 0 and self._still_s[k] >= timeout_s:
                out.append(k)
        return out


async def beat(counts: Any, slot: int) -> None:
    """Run forever in a child's event loop: count in ``counts[slot]`` every :data:`BEAT_S`."""
    while True:
        counts[slot] += 1
        await asyncio.sleep(BEAT_S)
