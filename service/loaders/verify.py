"""Run the source framework and the converted model on one probe input and compare."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import VerificationError
from ..repository import PackedModel
from .source import LoadedSource

# fp32 tolerance used everywhere a conversion is checked: |a - b| <= ATOL + RTOL * |b|.
RTOL = 1e-5
ATOL = 1e-5


def probe_input(input_size: int, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """A small ragged batch (lengths 7, 1, 4) of unit-normal features."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 7, input_size)).astype(np.float32)
    return x, np.array([7, 1, 4], dtype=np.int64)


def verify_against_source(model: PackedModel, loaded: LoadedSource) -> dict[str, Any]:
    """Compare outputs; return a record for the provenance, raise VerificationError on mismatch."""
    if loaded.runner is None:
        return {"checked": False, "reason": f"{loaded.format} framework not installed"}
    from ..engines.reference import ReferenceEngine

    x, lengths = probe_input(model.spec.input_size)
    if not loaded.ragged_ok:
        lengths = np.full_like(lengths, x.shape[1])
    expected = np.asarray(loaded.runner(x, lengths), dtype=np.float64)
    got = ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64), lengths).output
    if expected.shape != got.shape:
        raise VerificationError(
            f"the source model's output has shape {expected.shape} but the converted model's is {got.shape}"
        )
    diff = float(np.max(np.abs(got - expected)))
    bound = ATOL + RTOL * np.abs(expected)
    if not np.all(np.abs(got - expected) <= bound):
        raise VerificationError(
            f"converted model does not reproduce the {loaded.format} model: max abs difference {diff:.3g} "
            f"(tolerance {ATOL:g} + {RTOL:g}*|x|). Check --cell and --select; if the file is right, report this."
        )
    return {"checked": True, "max_abs_diff": diff, "probe": {"batch": 3, "time": 7, "lengths": lengths.tolist()}}
