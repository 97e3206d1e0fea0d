"""RecurrentLayer: one framework layer in canonical form, and assembling layers into blocks.

Every loader turns its file into a list of RecurrentLayer (gate order, transposes
and bias splits already mapped, see layouts.md section 7), then :func:`assemble`
merges consecutive compatible layers (same cell, H, D, Ho, variant, and input
width matching) into cuDNN blocks and packs each block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConversionError
from ..packing import LayerWeights, pack_block
from ..spec import BlockSpec, RNNSpec


@dataclass
class RecurrentLayer:
    """One recurrent layer of a source model, weights in canonical gate order.

    ``directions`` holds one LayerWeights per direction (forward, then reverse).
    ``peephole`` (LSTM variant) holds one [3, H] array per direction, rows i, f, o.
    ``name`` is the framework's name for the layer, used in messages and ``--select``.
    """

    name: str
    cell: str
    input_size: int
    hidden_size: int
    directions: list[LayerWeights]
    proj_size: int = 0
    variant: dict[str, Any] = field(default_factory=dict)
    peephole: list[np.ndarray] | None = None

    @property
    def bidirectional(self) -> bool:
        return len(self.directions) == 2

    @property
    def output_width(self) -> int:
        return len(self.directions) * (self.proj_size or self.hidden_size)

    def block_key(self) -> tuple:
        import json

        return (self.cell, self.hidden_size, len(self.directions), self.proj_size,
                json.dumps(self.variant, sort_keys=True))


def assemble(layers: list[RecurrentLayer], dtype=np.float32) -> tuple[RNNSpec, list[np.ndarray], dict[str, np.ndarray]]:
    """Merge consecutive compatible layers into blocks; return (spec, packed buffers, extras)."""
    if not layers:
        raise ConversionError("no recurrent layer to convert")
    groups: list[list[RecurrentLayer]] = []
    for layer in layers:
        if groups:
            prev = groups[-1][-1]
            if layer.input_size != prev.output_width:
                raise ConversionError(
                    f"layer '{layer.name}' takes {layer.input_size} features but the layer before it, "
                    f"'{prev.name}', produces {prev.output_width}: these layers are not a stack; "
                    f"select a consecutive chain of recurrent layers"
                )
            if layer.block_key() == prev.block_key():
                groups[-1].append(layer)
                continue
        groups.append([layer])
    for layer in layers:
        _check_values(layer)
    blocks, buffers, extras = [], [], {}
    for k, group in enumerate(groups):
        first = group[0]
        spec = BlockSpec(first.cell, first.input_size, first.hidden_size, len(group), first.bidirectional,
                         first.proj_size, dict(first.variant))
        weights = [lw for layer in group for lw in layer.directions]
        buffers.append(pack_block(spec, weights, dtype=np.float64).astype(dtype))
        if first.peephole is not None:
            peep = np.stack([np.asarray(p, dtype=np.float64) for layer in group for p in layer.peephole])
            if peep.shape != (spec.pseudo_layers, 3, spec.hidden_size):
                raise ConversionError(f"peephole tensors of block {k} have shape {peep.shape}, expected "
                                      f"{(spec.pseudo_layers, 3, spec.hidden_size)}")
            extras[f"block{k}.peephole"] = peep.astype(dtype)
        blocks.append(spec)
    return RNNSpec(tuple(blocks)), buffers, extras


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_PARTS = (("w", "input matrix"), ("r", "recurrent matrix"), ("bw", "input bias"), ("br", "recurrent bias"),
          ("proj", "projection"))


def _check_values(layer: RecurrentLayer) -> None:
    """Refuse NaN, infinities and values float32 cannot hold, naming the layer, the tensor and the place.

    rnnserve computes in float32: a float64 weight past its range (about 3.4e38) became inf, and the model
    answered NaN wherever an input feature was exactly 0 (the probe has none, so the check passed)."""
    for d, lw in enumerate(layer.directions):
        for attr, what in _PARTS:
            arr = getattr(lw, attr)
            if arr is None:
                continue
            arr = np.asarray(arr, dtype=np.float64)
            where = f"layer '{layer.name}'{' (reverse direction)' if d else ''}, {what}"
            bad = np.argwhere(~np.isfinite(arr))
            if bad.size:
                raise ConversionError(f"{where}: {arr[tuple(bad[0])]} at {bad[0].tolist()} (canonical gate order); "
                                      f"the weights must be finite: check the training run that saved them")
            big = np.argwhere(np.abs(arr) > _FLOAT32_MAX)
            if big.size:
                raise ConversionError(f"{where}: {arr[tuple(big[0])]:.3g} at {big[0].tolist()} (canonical gate "
                                      f"order) is past float32's range (about 3.4e38), which rnnserve computes "
                                      f"in; such a model overflows in float32: check the weights")
