"""Run the source framework and the converted model on one probe input and compare."""
from __future__ import annotations

from functools import partial
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


# What runs each format's source model, and the extra that installs it.
_RUNTIMES = {"torch": "torch", "keras": "keras", "onnx": "onnxruntime"}


def _missing(fmt: str) -> str:
    return (f"{_RUNTIMES.get(fmt, fmt)} is not installed, so the source model could not be run to check the "
            f"conversion (pip install 'rnnserve[{fmt}]' and convert again)")


def last_line(exc: BaseException) -> str:
    """The last line of a framework's error (where its runtimes say what went wrong), cut to 400 characters."""
    return (str(exc).strip().splitlines() or [""])[-1][:400]


def runtime_lacks_kernel(exc: BaseException) -> bool:
    """A framework's runtime lacks what a file uses (onnxruntime's NOT_IMPLEMENTED, "not supported", "does not
    support double yet"), rather than finding the file wrong."""
    text = str(exc).lower()
    return "not_implemented" in text or "not support" in text


def verify_against_source(model: PackedModel, loaded: LoadedSource) -> dict[str, Any]:
    """Compare outputs; return a record for the provenance, raise VerificationError on mismatch."""
    if loaded.runner is None:
        return {"checked": False, "reason": loaded.unchecked_reason or _missing(loaded.format)}
    from ..engines.reference import ReferenceEngine

    x, lengths = probe_input(model.spec.input_size)
    if not loaded.ragged_ok:
        lengths = np.full_like(lengths, x.shape[1])
    try:
        expected = np.asarray(loaded.runner(x, lengths), dtype=np.float64)
    except Exception as exc:  # noqa: BLE001 - any failure of the framework's own runtime is the file's to report
        # a valid file the runtime has no kernel for (onnxruntime's GRU in float64) is not the file's fault
        advice = ("the runtime has no kernel for what the file holds (e.g. float64 weights): export it in float32, "
                  "or convert with --no-verify" if runtime_lacks_kernel(exc)
                  else f"the file is likely invalid for {loaded.format}: export it again")
        raise VerificationError(
            f"{loaded.format}'s own runtime could not run the source model to check the conversion "
            f"({type(exc).__name__}: {last_line(exc)}); {advice}"
        ) from exc
    got = ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64), lengths).output
    if expected.shape != got.shape:
        raise VerificationError(
            f"the source model's output has shape {expected.shape} but the converted model's is {got.shape}"
        )
    diff = float(np.max(np.abs(got - expected)))
    rtol, atol = loaded.check_tolerance or (RTOL, ATOL)
    bound = atol + rtol * np.abs(expected)
    if not np.all(np.abs(got - expected) <= bound):
        raise VerificationError(
            f"converted model does not reproduce the {loaded.format} model: max abs difference {diff:.3g} "
            f"(tolerance {atol:g} + {rtol:g}*|x|). Check --cell and --select; if the file is right, report this."
        )
    record = {"checked": True, "max_abs_diff": diff, "probe": {"batch": 3, "time": 7, "lengths": lengths.tolist()}}
    if loaded.check_tolerance:
        record["tolerance"] = {"rtol": rtol, "atol": atol}
    if loaded.check_scope:
        record["scope"] = loaded.check_scope
    if loaded.file_check is not None:
        record["whole_file"] = loaded.file_check(partial(_final_states, ReferenceEngine(model, dtype=np.float64)))
    return record


def _final_states(engine: Any, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(output [B, T, F], h [D, B, Ho], c [D, B, H] or None) of ``engine`` on ``x`` at full length: the states of
    the last block's last layer, what an ONNX node's Y_h and Y_c hold."""
    y, states = engine.forward_blocks(x)
    d = engine.spec.blocks[-1].directions
    h, c = states[-1]  # [B, L*D, Ho]
    return (np.asarray(y), np.asarray(h)[:, -d:].transpose(1, 0, 2),
            None if c is None else np.asarray(c)[:, -d:].transpose(1, 0, 2))


def storage_difference(model: PackedModel, dtype: str) -> float:
    """Max abs difference on the probe input between ``model`` and the same model with its weights stored in
    ``dtype`` (float16 or bfloat16 round them): what storing it reduced costs, beside the float32 check above.
    InvalidInput when a weight does not fit ``dtype``."""
    from ..engines.reference import ReferenceEngine
    from ..repository.model import stored_weights

    def widened(name: str, w: np.ndarray) -> np.ndarray:
        return np.asarray(stored_weights(name, np.asarray(w, dtype=np.float32), dtype), dtype=np.float32)

    rounded = PackedModel(model.spec, [widened(f"block{k}.weights", w) for k, w in enumerate(model.weights)],
                          {n: widened(n, v) for n, v in model.extras.items()}, model.provenance)
    x, lengths = probe_input(model.spec.input_size)
    want = ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64), lengths).output
    got = ReferenceEngine(rounded, dtype=np.float64).forward(x.astype(np.float64), lengths).output
    return float(np.max(np.abs(got - want)))
