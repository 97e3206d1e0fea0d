"""ReferenceEngine: exact NumPy equations for every cell and variant; the CPU default.

Speed comes from three choices: the input projection of all steps is one GEMM;
the batch is sorted by length once so each step runs on a contiguous active
prefix (PyTorch packed-sequence semantics without masks); and data is time-major
so each step touches contiguous rows.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...errors import InvalidInput
from ...packing import unpack_block
from ...repository import PackedModel
from ..base import (BlockState, Engine, EngineOutput, check_block_states, check_forward_args,
                    split_block_states, stack_block_states)
from .cells import DirectionParams, prepare


def reverse_within_lengths(seq: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Reverse each sequence of a time-major [T, B, F] array over its own valid steps."""
    t = seq.shape[0]
    steps = np.arange(t)[:, None]
    idx = np.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return np.take_along_axis(seq, idx[:, :, None], axis=0)


class ReferenceEngine(Engine):
    """NumPy engine; ``dtype`` float32 (default) or float64."""

    name = "reference"

    def __init__(self, model: PackedModel, dtype: Any = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise InvalidInput(f"the reference engine computes in float32 or float64, not {self.dtype}")
        self.model = model
        self.spec = model.spec
        self._params: list[list[DirectionParams]] = []
        for k, (blk, flat) in enumerate(zip(self.spec.blocks, model.weights)):
            layers = unpack_block(blk, np.asarray(flat, dtype=np.float64))
            extras = {n: np.asarray(v, dtype=np.float64) for n, v in model.block_extras(k).items()}
            self._params.append([prepare(blk, lw, extras, p, self.dtype) for p, lw in enumerate(layers)])

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "dtype": str(self.dtype), "device": "cpu"}

    def forward(self, x: Any, lengths: Any = None, h0: Any = None, c0: Any = None) -> EngineOutput:
        """Run the model; see :mod:`service.engines.base` for shapes."""
        x = np.asarray(x)
        b, t, lens = check_forward_args(self.spec, x, lengths, h0, c0)
        states = split_block_states(self.spec, h0, c0) if h0 is not None or c0 is not None else None
        output, finals = self._run(x, lens, states)
        h_n, c_n = stack_block_states(self.spec, finals)
        return EngineOutput(output, h_n, c_n)

    def forward_blocks(self, x: Any, lengths: Any = None,
                       states: Sequence[BlockState] | None = None) -> tuple[Any, list[BlockState]]:
        """Per-block states in and out (see :mod:`service.engines.base`); any mix of state widths."""
        x = np.asarray(x)
        b, _, lens = check_forward_args(self.spec, x, lengths, None, None)
        if states is not None:
            check_block_states(self.spec, states, b)
        return self._run(x, lens, states)

    def _run(self, x: np.ndarray, lens: np.ndarray,
             states: Sequence[BlockState] | None) -> tuple[np.ndarray, list[BlockState]]:
        """All blocks; ``states[k]`` (h, c) of block k or None (zeros) per block or for all."""
        b, t = x.shape[0], x.shape[1]
        order = np.argsort(-lens, kind="stable")
        inverse = np.argsort(order)
        lens_sorted = lens[order]
        active = (lens_sorted[None, :] > np.arange(t)[:, None]).sum(axis=1)
        seq = np.ascontiguousarray(x[order].transpose(1, 0, 2), dtype=self.dtype)

        finals: list[BlockState] = []
        for k, (blk, params) in enumerate(zip(self.spec.blocks, self._params)):
            d_count, ho, h = blk.directions, blk.output_size, blk.hidden_size
            h_in, c_in = states[k] if states is not None else (None, None)
            h0s = None if h_in is None else np.asarray(h_in, dtype=self.dtype)[order]
            c0s = None if c_in is None else np.asarray(c_in, dtype=self.dtype)[order]
            h_rows: list[np.ndarray] = []
            c_rows: list[np.ndarray] = []
            for layer in range(blk.num_layers):
                outs = []
                for d in range(d_count):
                    p = layer * d_count + d
                    prm = params[p]
                    backwards = d == 1 or bool(blk.variant.get("reverse"))
                    inp = reverse_within_lengths(seq, lens_sorted) if backwards else seq
                    # One 2-D GEMM for every step: a 3-D matmul would loop over T in NumPy.
                    xp = (inp.reshape(t * b, -1) @ prm.wt).reshape(t, b, -1)
                    xp += prm.bias_x
                    hs = np.zeros((b, ho), self.dtype) if h0s is None else h0s[:, p].copy()
                    cs = None
                    if blk.cell == "lstm":
                        cs = np.zeros((b, h), self.dtype) if c0s is None else c0s[:, p].copy()
                    out = np.zeros((t, b, ho), self.dtype)
                    for step in range(t):
                        n = int(active[step])
                        prm.step(xp[step, :n], hs[:n], None if cs is None else cs[:n])
                        out[step, :n] = hs[:n]
                    outs.append(reverse_within_lengths(out, lens_sorted) if backwards else out)
                    h_rows.append(hs)
                    if cs is not None:
                        c_rows.append(cs)
                seq = outs[0] if d_count == 1 else np.concatenate(outs, axis=2)
            finals.append((np.stack(h_rows, axis=1)[inverse],
                           np.stack(c_rows, axis=1)[inverse] if c_rows else None))

        output = seq.transpose(1, 0, 2)[inverse]
        return np.ascontiguousarray(output), finals
