"""The model registry: which models and versions are served, in what state, by which engine."""
from .registry import (DEFAULTED_FIELDS, ModelEntry, ModelRegistry, ModelState, ServedVersion, check_serving,
                       effective_config)

__all__ = ["ModelRegistry", "check_serving", "ModelState", "ModelEntry", "ServedVersion", "effective_config", "DEFAULTED_FIELDS"]
