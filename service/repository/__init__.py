"""The model repository on disk: REPO/<name>/config.json and REPO/<name>/<version>/model.safetensors."""
from .config import ModelConfig, load_config
from .model import PackedModel, load_model, resolve_model_path

__all__ = ["ModelConfig", "load_config", "PackedModel", "load_model", "resolve_model_path"]
