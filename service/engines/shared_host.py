"""Host buffers that other processes write request arrays into, announced to device engines.

The engine process maps each front-end's shared-memory arena (:mod:`service.dataplane.arena`)
and reads request arrays in place. A GPU engine can do better than read them: with the arena
page-locked and mapped for the device, a batch's rows go from the arena to the GPU without
being merged on the host first (see :mod:`service.engines.cudnn.mapped`). This module is
the meeting point, free of any GPU import: the dataplane announces and withdraws buffers,
and an engine that can use them watches (and is told of those already announced).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("rnnserve.engines.shared_host")

_lock = threading.Lock()
_buffers: dict[str, Any] = {}
_watchers: list[tuple[Callable[[str, Any], None], Callable[[str], None]]] = []


def announce(key: str, buffer: Any) -> None:
    """``buffer`` (an mmap or any writable buffer) holds request arrays from now on, under ``key``."""
    with _lock:
        _buffers[key] = buffer
        watchers = list(_watchers)
    for on_add, _ in watchers:
        _call(on_add, key, buffer)


def withdraw(key: str) -> None:
    """The buffer announced as ``key`` is no longer written (its front-end has gone); watchers let go of it."""
    with _lock:
        known = _buffers.pop(key, None) is not None
        watchers = list(_watchers)
    if known:
        for _, on_remove in watchers:
            _call(on_remove, key)


def watch(on_add: Callable[[str, Any], None], on_remove: Callable[[str], None]) -> None:
    """Call ``on_add(key, buffer)`` for every buffer announced, now and later, and ``on_remove(key)`` when
    one is withdrawn."""
    with _lock:
        _watchers.append((on_add, on_remove))
        current = list(_buffers.items())
    for key, buffer in current:
        _call(on_add, key, buffer)


def _call(fn: Callable[..., None], *args: Any) -> None:
    # a watcher that fails (a device that refuses to map memory) costs its own speed-up, never the attach
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        log.exception("a shared host buffer watcher failed on %s", args[0])
