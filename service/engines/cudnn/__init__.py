"""The GPU engine: cuDNN 9 RNN inference through ctypes, CuPy for memory and streams.

Importing this package needs neither CuPy nor cuDNN; constructing
:class:`CudnnEngine` raises EngineUnavailable when either is missing.
"""
from .engine import CudnnEngine
from .library import CudnnError

__all__ = ["CudnnEngine", "CudnnError"]
