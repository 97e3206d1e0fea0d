"""Pack per-layer gate-stacked weights into cuDNN's canonical flat buffer, and back.

Loaders hand over, for each pseudo-layer, matrices already in canonical gate order
(LSTM i,f,g,o; GRU r,z,n) stacked along rows, exactly like PyTorch's
``weight_ih_l{k}``. The buffer then holds gate k's rows as linLayerID k.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConversionError
from ..spec import BlockSpec
from .layout import block_layout, block_param_count


@dataclass
class LayerWeights:
    """One pseudo-layer's parameters in canonical gate order (float64 or float32).

    w: [G*H, in_p]; r: [G*H, Ho]; bw, br: [G*H]; proj: [Ho, H] (LSTM projection) or None.
    """

    w: np.ndarray
    r: np.ndarray
    bw: np.ndarray
    br: np.ndarray
    proj: np.ndarray | None = None


def _check(name: str, arr: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.shape != shape:
        raise ConversionError(f"{where}: {name} has shape {tuple(arr.shape)}, expected {shape}")
    if not np.all(np.isfinite(arr)):
        raise ConversionError(f"{where}: {name} contains NaN or infinite values")
    return arr


def pack_block(spec: BlockSpec, layers: list[LayerWeights], dtype=np.float32) -> np.ndarray:
    """Return the flat canonical buffer for ``spec`` from ``layers`` (one per pseudo-layer)."""
    if len(layers) != spec.pseudo_layers:
        raise ConversionError(
            f"block has {spec.pseudo_layers} (layer, direction) pairs but {len(layers)} weight sets were given"
        )
    g, h, ho = spec.gates, spec.hidden_size, spec.output_size
    flat = np.zeros(block_param_count(spec), dtype=np.float64)
    for entry in block_layout(spec):
        lw = layers[entry.pseudo_layer]
        where = f"pseudo-layer {entry.pseudo_layer}"
        in_p = spec.layer_input_size(entry.pseudo_layer // spec.directions)
        if entry.kind == "matrix":
            if entry.lin_id == 8:
                if lw.proj is None:
                    raise ConversionError(f"{where}: LSTM proj_size={spec.proj_size} but no projection matrix")
                src = _check("projection", lw.proj, (ho, h), where)
            elif entry.lin_id < g:
                src = _check("input matrix", lw.w, (g * h, in_p), where)[entry.lin_id * h:(entry.lin_id + 1) * h]
            else:
                k = entry.lin_id - g
                src = _check("recurrent matrix", lw.r, (g * h, ho), where)[k * h:(k + 1) * h]
        else:
            k = entry.lin_id % g
            vec = lw.bw if entry.lin_id < g else lw.br
            src = _check("bias", vec, (g * h,), where)[k * h:(k + 1) * h]
        flat[entry.offset:entry.offset + entry.size] = np.asarray(src, dtype=np.float64).reshape(-1)
    return flat.astype(dtype)


def unpack_block(spec: BlockSpec, flat: np.ndarray) -> list[LayerWeights]:
    """Inverse of :func:`pack_block`: per-pseudo-layer weights as views into a copy of ``flat``."""
    flat = np.asarray(flat)
    expected = block_param_count(spec)
    if flat.shape != (expected,):
        raise ConversionError(f"block buffer has {flat.size} elements, spec needs {expected}")
    g = spec.gates
    out: list[LayerWeights] = []
    entries = block_layout(spec)
    by_key = {(e.kind, e.pseudo_layer, e.lin_id): e for e in entries}

    def take(kind: str, p: int, k: int) -> np.ndarray:
        e = by_key[(kind, p, k)]
        return flat[e.offset:e.offset + e.size].reshape(e.shape)

    for p in range(spec.pseudo_layers):
        w = np.concatenate([take("matrix", p, k) for k in range(g)], axis=0)
        r = np.concatenate([take("matrix", p, g + k) for k in range(g)], axis=0)
        bw = np.concatenate([take("bias", p, k) for k in range(g)])
        br = np.concatenate([take("bias", p, g + k) for k in range(g)])
        proj = take("matrix", p, 8) if spec.proj_size else None
        out.append(LayerWeights(w, r, bw, br, proj))
    return out
