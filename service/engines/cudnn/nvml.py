"""The GPU's own counters from NVML (the driver's management library), for ``/metrics``.

Triton exports the GPU's utilization, memory and power (``nv_gpu_*``) beside its inference
series, and dashboards built for it expect them; rnnserve's memory series counts only what
rnnserve holds. NVML ships with the driver (``libnvidia-ml.so.1``) and is reached through
ctypes, as cuDNN is: where it is missing or fails, these series are left out, and serving
does not depend on them.

NVML numbers GPUs in PCI order while CUDA puts the fastest first (and honours
``CUDA_VISIBLE_DEVICES``), so the GPU is found by its PCI bus id, not by an index.
"""
from __future__ import annotations

import ctypes
import logging
import math
from typing import Any

log = logging.getLogger("rnnserve.engines.nvml")
_LIBRARY = "libnvidia-ml.so.1"


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class GpuCounters:
    """Readings of one GPU; each is NaN when NVML cannot give it (a scrape must never fail on one)."""

    def __init__(self, lib: Any, handle: ctypes.c_void_p) -> None:
        self._lib = lib
        self._handle = handle

    @classmethod
    def open(cls, pci_bus_id: str) -> GpuCounters | None:
        """The GPU at ``pci_bus_id`` (as ``cudaDeviceGetPCIBusId`` gives it), or None without a working NVML."""
        try:
            lib = ctypes.CDLL(_LIBRARY)
            if lib.nvmlInit_v2() != 0:
                return None
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) != 0:
                return None
        except (OSError, AttributeError) as exc:
            log.info("GPU utilization and power metrics are off: %s cannot be used (%s)", _LIBRARY, exc)
            return None
        return cls(lib, handle)

    def utilization(self) -> float:
        """Share of the last sample period (1/6 s to 1 s, the driver's) in which a kernel ran, 0 to 1."""
        out = _Utilization()
        return out.gpu / 100.0 if self._lib.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(out)) == 0 \
            else math.nan

    def memory_used(self) -> float:
        """Bytes of GPU memory in use by every process."""
        return self._memory()[0]

    def memory_total(self) -> float:
        """Bytes of GPU memory."""
        return self._memory()[1]

    def power_watts(self) -> float:
        """Power drawn, in watts."""
        milliwatts = ctypes.c_uint()
        return milliwatts.value / 1000.0 if self._lib.nvmlDeviceGetPowerUsage(
            self._handle, ctypes.byref(milliwatts)) == 0 else math.nan

    def _memory(self) -> tuple[float, float]:
        out = _Memory()
        if self._lib.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(out)) != 0:
            return math.nan, math.nan
        return float(out.used), float(out.total)
