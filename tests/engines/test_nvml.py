"""NVML readings (service.engines.cudnn.nvml) against a stand-in library: what a failed reading gives.

The real library is read on the GPU (tests/serving/test_gpu_serving.py); here the calls' ctypes
arguments are filled as NVML fills them, and a failing call must give NaN, never an exception
(a scrape renders every series).
"""
from __future__ import annotations

import ctypes
import math

from service.engines.cudnn.nvml import GpuCounters


class _Lib:
    """NVML's three readings: each fills its out-argument and returns 0, or returns ``fail`` when set."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail

    def nvmlDeviceGetUtilizationRates(self, handle, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_uint))[0] = 37
        return self.fail

    def nvmlDeviceGetMemoryInfo(self, handle, out):
        fields = ctypes.cast(out, ctypes.POINTER(ctypes.c_ulonglong))
        fields[0], fields[1], fields[2] = 80 << 30, 60 << 30, 20 << 30  # total, free, used
        return self.fail

    def nvmlDeviceGetPowerUsage(self, handle, out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_uint))[0] = 123_456
        return self.fail


def test_readings_in_prometheus_units():
    gpu = GpuCounters(_Lib(), ctypes.c_void_p(1))
    assert gpu.utilization() == 0.37
    assert gpu.memory_used() == float(20 << 30)
    assert gpu.memory_total() == float(80 << 30)
    assert gpu.power_watts() == 123.456


def test_a_failed_reading_is_nan_not_an_error():
    gpu = GpuCounters(_Lib(fail=999), ctypes.c_void_p(1))  # NVML_ERROR_UNKNOWN
    for read in (gpu.utilization, gpu.memory_used, gpu.memory_total, gpu.power_watts):
        assert math.isnan(read())


def test_no_nvml_library_means_no_counters(monkeypatch):
    monkeypatch.setattr("service.engines.cudnn.nvml._LIBRARY", "libnvidia-ml-not-here.so.1")
    assert GpuCounters.open("0000:00:00.0") is None
