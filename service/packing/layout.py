"""Offsets of every matrix and bias in cuDNN's packed weight space (DOUBLE_BIAS).

Order, as cudnnGetRNNWeightParams reports it (measured on cuDNN 9.19, layouts.md 1.4):
all matrices first, pseudo-layer-major (p = layer*D + direction), linLayerID
ascending inside each pseudo-layer (ids 0..G-1 input, G..2G-1 recurrent, then id 8
for an LSTM projection); then all biases in the same pseudo-layer/id order.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import GATE_NAMES, BlockSpec


@dataclass(frozen=True)
class LayoutEntry:
    """One matrix or bias vector inside a block's flat buffer."""

    kind: str            # "matrix" or "bias"
    pseudo_layer: int    # layer * D + direction
    lin_id: int          # cuDNN linLayerID
    offset: int          # in elements
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    def describe(self, cell: str) -> str:
        """Human name, e.g. 'W_i', 'R_f', 'bW_n', 'P' (projection)."""
        gates = GATE_NAMES[cell]
        g = len(gates)
        if self.lin_id == 8:
            return "W_proj"
        side = "W" if self.lin_id < g else "R"
        gate = gates[self.lin_id % g]
        return f"{'b' if self.kind == 'bias' else ''}{side}_{gate}"


def block_layout(spec: BlockSpec) -> list[LayoutEntry]:
    """Every matrix and bias of ``spec`` with its offset in the canonical flat buffer."""
    entries: list[LayoutEntry] = []
    g, h, ho = spec.gates, spec.hidden_size, spec.output_size
    offset = 0
    for layer in range(spec.num_layers):
        for d in range(spec.directions):
            p = layer * spec.directions + d
            in_p = spec.layer_input_size(layer)
            for k in range(2 * g):
                shape = (h, in_p) if k < g else (h, ho)
                entries.append(LayoutEntry("matrix", p, k, offset, shape))
                offset += shape[0] * shape[1]
            if spec.proj_size:
                entries.append(LayoutEntry("matrix", p, 8, offset, (ho, h)))
                offset += ho * h
    for p in range(spec.pseudo_layers):
        for k in range(2 * g):
            entries.append(LayoutEntry("bias", p, k, offset, (h,)))
            offset += h
    return entries


def block_param_count(spec: BlockSpec) -> int:
    """Total elements of the canonical flat buffer (what :func:`block_layout` spans), in closed form.

    Not from the layout itself, whose length grows with ``num_layers``: a model file's spec is checked against
    its tensor's size before anything is built from it, and a corrupt spec saying 10^12 layers spun the load
    for minutes, growing memory, to describe a 2 KB tensor.
    """
    g, h, ho, d = spec.gates, spec.hidden_size, spec.output_size, spec.directions
    proj = ho * h if spec.proj_size else 0

    def pseudo_layer(in_p: int) -> int:  # its matrices and its two bias vectors per gate
        return g * h * in_p + g * h * ho + proj + 2 * g * h

    return d * pseudo_layer(spec.input_size) + (spec.num_layers - 1) * d * pseudo_layer(d * ho)
