"""create_engine: pick the engine for a model and a device request."""
from __future__ import annotations

import logging
from typing import Any

from ..errors import EngineUnavailable, InvalidInput, NoCudaDevice
from ..repository import PackedModel
from .base import Engine

log = logging.getLogger("rnnserve.engines")
DEVICES = ("cpu", "cuda", "auto")


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot serve on this machine (no CuPy, no GPU, no cuDNN), or None when it can.

    Checked once at start: without it every model failed to load with the same reason while the server
    reported ready, so a misconfigured replica took traffic it could only refuse.
    """
    try:
        from .cudnn import library
        from .cudnn.engine import import_cupy

        import_cupy()
        library.get_library()
    except (ImportError, OSError, RuntimeError, EngineUnavailable) as exc:
        return getattr(exc, "message", None) or str(exc)
    return None


def create_engine(model: PackedModel, device: str = "cpu", **options: Any) -> Engine:
    """Return an engine for ``model``: "cpu" (reference), "cuda" (cuDNN) or "auto".

    "auto" takes cuDNN when a GPU and cuDNN work and the model has no variant cuDNN
    cannot run; otherwise it falls back to the reference engine and logs why. ``options``
    go to the cuDNN engine; the reference engine takes only ``dtype`` and ``native``.
    """
    if device not in DEVICES:
        raise InvalidInput(f"device '{device}' is not known; use one of {', '.join(DEVICES)}")
    if device == "cpu":
        from .reference import ReferenceEngine

        precision = getattr(model.config, "precision", "float32")
        if precision != "float32":
            # served all the same (float32 is the closer answer), but the operator asked for something else
            log.warning("model '%s': config.json asks for precision %s, which only the cuDNN engine computes in; "
                        "the reference engine computes in float32", model.name or "?", precision)
        return ReferenceEngine(model, **{k: v for k, v in options.items() if k in ("dtype", "native")})
    try:
        from .cudnn import CudnnEngine
    except ImportError as exc:
        if device == "cuda":
            raise EngineUnavailable(f"the cuDNN engine is not available: {exc}") from exc
        log.info("device auto: cuDNN engine unavailable (%s); using the reference engine", exc)
        return create_engine(model, "cpu")
    try:
        return CudnnEngine(model, **options)
    except EngineUnavailable as exc:
        if device == "cuda":
            raise
        # a machine without a GPU is what "auto" is for; a GPU that fails, or a model cuDNN cannot run, is not
        level = logging.INFO if isinstance(exc, NoCudaDevice) else logging.WARNING
        log.log(level, "device auto: model '%s' runs on the reference engine: %s", model.name or "?", exc)
        return create_engine(model, "cpu")
