"""Front-end arenas page-locked and mapped for the GPU, so a batch's rows upload straight from them.

With ``rnnserve serve --frontends N`` a request's input lies in its front-end's shared-memory
arena (:mod:`service.dataplane.arena`). Merging a batch on the host meant copying every row
into a pinned buffer (and zeroing the padding) on the engine process's one busy thread before
one upload: 171 µs for 20 requests in 8 parts on an H100 host (``bench/results/h100-2026-11-23f``).
Registered with ``cudaHostRegister`` (mapped, portable), the arena is readable by the device
itself, and one gather kernel (:func:`.copies.gather_rows`) builds the padded batch on the GPU
from a table of row addresses: the host writes only that table.

Registration is process-wide (portable) and happens when an arena is announced
(:mod:`service.engines.shared_host`), once per front-end connection (it holds the engine process's
event loop for ~14 ms per 32 MiB on an H100 host, so at start, or when a front-end reconnects); an arena is unregistered
when its front-end goes, after the devices that read it have finished (a batch still queued
with rows in it then finds it unmapped and merges on the host, as before). A device or driver
that refuses the registration leaves the arena unmapped: batches merge on the host. A batch of one
part (nothing to merge) is staged through pinned memory as before (see
:func:`service.scheduler.batching.merge`).
"""
from __future__ import annotations

import bisect
import logging
import threading
from typing import Any

import numpy as np

from .. import shared_host

log = logging.getLogger("rnnserve.engines.cudnn")

_REGISTER_PORTABLE, _REGISTER_MAPPED = 0x01, 0x02


class MappedHost:
    """The host ranges this process has page-locked and mapped for its devices.

    Registrations are made with ``device`` current (portable: every device sees them), so that an
    announcement on a thread whose current device is another one creates no context there.
    """

    def __init__(self, cp: Any, device: int = 0) -> None:
        self._cp = cp
        self._device = device
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted host start addresses
        self._ranges: dict[int, tuple[int, int, str]] = {}  # start -> (size, device address, key)
        self._by_key: dict[str, int] = {}
        self._devices: set[int] = set()  # devices that have read a range (synchronized before unmapping)

    def add(self, key: str, buffer: Any) -> bool:
        """Page-lock and map ``buffer`` (announced as ``key``); whether that worked."""
        cp = self._cp
        view = np.frombuffer(buffer, np.uint8)
        start, size = int(view.ctypes.data), int(view.nbytes)
        if size == 0:
            return False
        with self._lock:
            if key in self._by_key:  # announced while the watch began: seen twice
                return True
        try:
            with cp.cuda.Device(self._device):
                cp.cuda.runtime.hostRegister(start, size, _REGISTER_PORTABLE | _REGISTER_MAPPED)
                device_address = int(cp.cuda.runtime.pointerGetAttributes(start).devicePointer)
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: the batches merge on the host instead
            log.warning("could not map front-end arena %s (%d bytes) for the GPU (%s); its batches merge on the "
                        "host", key, size, exc)
            return False
        with self._lock:
            bisect.insort(self._starts, start)
            self._ranges[start] = (size, device_address, key)
            self._by_key[key] = start
        return True

    def remove(self, key: str) -> None:
        """Unmap the range announced as ``key`` once every device that read it has finished its work."""
        with self._lock:
            start = self._by_key.pop(key, None)
            if start is None:
                return
            self._starts.remove(start)
            del self._ranges[start]
            devices = sorted(self._devices)
        cp = self._cp
        try:
            for device in devices:
                with cp.cuda.Device(device):
                    cp.cuda.runtime.deviceSynchronize()
            with cp.cuda.Device(self._device):
                cp.cuda.runtime.hostUnregister(start)
        except Exception as exc:  # noqa: BLE001 - a failing device; the mapping goes with the process
            log.warning("could not unmap front-end arena %s: %s", key, exc)

    def device_address(self, ptr: int, nbytes: int, device: int) -> int | None:
        """The address through which ``device`` reads host bytes ``[ptr, ptr + nbytes)``, or None when they
        do not lie in one mapped range."""
        starts = self._starts
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return None
        start = starts[i]
        hit = self._ranges.get(start)
        if hit is None or ptr + nbytes > start + hit[0]:
            return None
        if device not in self._devices:
            with self._lock:
                self._devices.add(device)
        return hit[1] + (ptr - start)

    def __len__(self) -> int:
        return len(self._ranges)


_mapped: MappedHost | None = None
_install_lock = threading.Lock()


def mapped_host(cp: Any, device: int = 0) -> MappedHost:
    """This process's MappedHost, watching announced arenas from its first call on (registering them with
    ``device``, the first caller's, current)."""
    global _mapped
    with _install_lock:
        if _mapped is None:
            _mapped = MappedHost(cp, device)
            shared_host.watch(_mapped.add, _mapped.remove)
        return _mapped
