"""Engines: ``reference`` (NumPy, CPU) and ``cudnn`` (cuDNN 9 through ctypes, GPU)."""
from .base import Engine, EngineOutput
from .factory import create_engine

__all__ = ["Engine", "EngineOutput", "create_engine"]
