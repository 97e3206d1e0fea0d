"""The DataPlane interface over several engine processes (``rnnserve serve --engines N``).

One engine process runs every batch launch, merge and answer on one Python thread,
which is the limit of a server whose GPU still has room (measured on H100 hosts: the
engine process's main thread at 100 % with the GPU between batches). With ``--engines
N`` every engine process loads every model on the same device and batches on its
own, like Triton's ``instance_group`` count, and each front-end holds one
:class:`~.remote.RemoteDataPlane` per engine process and routes through this class:

- a request without ``sequence_id`` goes to the engine process with the fewest of this
  front-end's requests in flight (ties: the next in turn), so a busy process gets less;
- every chunk of a stream goes to the engine process its ``sequence_id`` hashes to
  (CRC-32, the same in every front-end), where the stream's state lives; stream errors
  (unknown, expired, second start) are therefore exactly those of one engine process;
- load and unload go to every engine process, one at a time per model across front-ends
  (:mod:`.repository_lock`), so that every process goes through them in one order; health, readiness and the repository
  index combine theirs (ready when ready in all; a version not READY in one process is
  shown with that process's state and reason); metadata and configuration come from the
  first (the configuration counts one instance per engine process);
- statistics add up (:func:`~.statistics.merge_statistics`);
- ``/metrics`` adds their expositions up (:mod:`service.metrics.merge`).

Limits (``max_queue_size``, ``max_streams``) are each engine process's own.
"""
from __future__ import annotations

import asyncio
import contextlib
import zlib
from typing import Any, Sequence

from ..errors import InvalidInput
from ..metrics.merge import merge_expositions
from .remote import RemoteDataPlane
from .repository_lock import RepositoryLock
from .statistics import merge_statistics
from .types import InferRequest, InferResponse
from .validation import stream_request


def stream_shard(parameters: dict[str, Any], count: int) -> int | None:
    """The engine process a stream chunk with these request parameters belongs to (None: not a stream chunk)."""
    try:
        stream = stream_request(parameters)
    except InvalidInput:
        return None  # any engine process answers the error the same way
    if stream is None:
        return None
    return zlib.crc32(stream.key.encode()) % count


def merge_indexes(indexes: Sequence[list[dict]]) -> list[dict]:
    """One repository index from the engine processes' indexes (rows keyed by name and version).

    Where the processes disagree (a load that failed in one, out of memory), the row is the first process's
    that is not READY, its reason naming that process, and the processes where it is READY: whichever process
    holds which state, the index must not read as if every process agreed. A version READY in some processes
    and not listed by another is UNAVAILABLE, its reason naming the process that lacks it.
    """
    seen: dict[tuple[str, str], list[tuple[int, dict]]] = {}
    for k, index in enumerate(indexes):
        for row in index:
            seen.setdefault((row["name"], row["version"]), []).append((k, row))
    rows = []
    for copies in seen.values():
        ready = [k for k, row in copies if row["state"] == "READY"]
        if not ready or len(ready) == len(indexes):
            rows.append(dict(copies[0][1]))
            continue
        where = f"READY in engine process {', '.join(map(str, ready))}"
        other = next(((k, row) for k, row in copies if row["state"] != "READY"), None)
        if other is None:  # READY where it is listed, and not listed by another process at all
            k = next(k for k in range(len(indexes)) if k not in ready)
            row = copies[0][1]
            rows.append({**row, "state": "UNAVAILABLE",
                         "reason": f"engine process {k} does not have this version ({where})"})
            continue
        k, row = other
        reason = f"engine process {k}: {row['reason']}" if row["reason"] else f"engine process {k}"
        rows.append({**row, "reason": f"{reason} ({where})"})
    return sorted(rows, key=lambda r: (r["name"], _version_order(r["version"])))


def _version_order(label: str) -> tuple[int, str]:
    return (int(label), "") if label.isdigit() else (-1, label)


class ShardedDataPlane:
    """Routes the DataPlane interface of a front-end process over several engine processes."""

    def __init__(self, shards: Sequence[RemoteDataPlane], lock_folder: str | None = None) -> None:
        """``lock_folder``: where the front-ends of one server keep their repository locks (None: no other
        front-end sends loads or unloads)."""
        if not shards:
            raise ValueError("ShardedDataPlane needs at least one engine process")
        self.shards = list(shards)
        self._repository_lock = RepositoryLock(lock_folder) if lock_folder else None
        self._in_flight = [0] * len(self.shards)
        self._turn = 0
        self._draining = False

    async def connect(self) -> None:
        """Connect to every engine process."""
        await asyncio.gather(*(shard.connect() for shard in self.shards))

    async def close(self) -> None:
        """Close every connection; calls still waiting fail with Unavailable."""
        await asyncio.gather(*(shard.close() for shard in self.shards))

    def report_waiting(self) -> None:
        """Tell each engine process how many requests wait in this front-end for it (see RemoteDataPlane)."""
        for shard in self.shards:
            shard.report_waiting()

    def begin_drain(self) -> None:
        """Report not ready from now on (this front-end is stopping)."""
        self._draining = True
        for shard in self.shards:
            shard.begin_drain()

    def pick(self, request: InferRequest) -> int:
        """Index of the engine process that runs ``request``."""
        n = len(self.shards)
        shard = stream_shard(request.parameters, n) if request.parameters else None
        if shard is not None:
            return shard
        loads, turn = self._in_flight, self._turn
        best = min(range(n), key=lambda i: (loads[i], (i - turn) % n))
        self._turn = (best + 1) % n
        return best

    async def infer(self, request: InferRequest) -> InferResponse:
        k = self.pick(request)
        self._in_flight[k] += 1
        try:
            return await self.shards[k].infer(request)
        finally:
            self._in_flight[k] -= 1

    async def end_stream(self, model: str, version: str, parameters: dict[str, Any], why: str, caller: int) -> None:
        shard = stream_shard(parameters, len(self.shards))
        if shard is not None:  # the engine process that holds the stream, as for its chunks
            await self.shards[shard].end_stream(model, version, parameters, why, caller)

    async def live(self) -> bool:
        return all(await asyncio.gather(*(shard.live() for shard in self.shards)))

    async def ready(self) -> bool:
        return not self._draining and all(await asyncio.gather(*(shard.ready() for shard in self.shards)))

    async def server_metadata(self) -> dict:
        return await self.shards[0].server_metadata()

    async def model_metadata(self, name: str, version: str = "") -> dict:
        return await self.shards[0].model_metadata(name, version)

    async def model_ready(self, name: str, version: str = "") -> bool:
        return all(await asyncio.gather(*(shard.model_ready(name, version) for shard in self.shards)))

    async def model_config(self, name: str, version: str = "") -> dict:
        """The first engine process's, with one instance per engine process."""
        config = await self.shards[0].model_config(name, version)
        for group in config["instance_group"]:
            group["count"] = len(self.shards)
        return config

    async def model_statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Every engine process's statistics, added up (:func:`~.statistics.merge_statistics`)."""
        return merge_statistics(await asyncio.gather(*(shard.model_statistics(name, version)
                                                       for shard in self.shards)))

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        rows = merge_indexes(await asyncio.gather(*(shard.repository_index(False) for shard in self.shards)))
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def render_metrics(self) -> bytes:
        """Every engine process's series, added up (:func:`~service.metrics.merge.merge_expositions`)."""
        texts = await asyncio.gather(*(shard.render_metrics() for shard in self.shards))
        return await asyncio.to_thread(merge_expositions, texts)  # a parse and a render: off the event loop

    async def load_model(self, name: str) -> None:
        await self._everywhere("load_model", name)

    async def unload_model(self, name: str) -> None:
        await self._everywhere("unload_model", name)

    async def _everywhere(self, method: str, name: str) -> None:
        """Run ``method`` in every engine process; the first failure (in process order) is raised after all end."""
        # a task of its own: a caller that leaves must not release the lock while the engine processes still work
        task = asyncio.ensure_future(self._in_turn(method, name))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, should the caller have left
        results = await asyncio.shield(task)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _in_turn(self, method: str, name: str) -> list[Any]:
        """``method``'s result (or exception) in every engine process, holding the model's repository lock."""
        lock = self._repository_lock
        async with lock.hold(name) if lock is not None else contextlib.nullcontext():
            return await asyncio.gather(*(getattr(shard, method)(name) for shard in self.shards),
                                        return_exceptions=True)
