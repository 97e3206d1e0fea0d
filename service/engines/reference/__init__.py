"""The NumPy reference engine."""
from .engine import ReferenceEngine

__all__ = ["ReferenceEngine"]
