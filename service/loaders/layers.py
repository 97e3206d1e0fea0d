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
