"""ReferenceEngine: exact NumPy equations for every cell and variant; the CPU default.

Speed comes from three choices: the input projection of all steps is one GEMM;
the batch is sorted by length once so each step runs on a contiguous active
prefix (PyTorch packed-sequence semantics without masks); and data is time-major
so each step touches contiguous rows.

Plain float32 LSTM and (reset-after) GRU blocks run on compiled kernels instead
(:mod:`.native`: the whole time loop in C; measured 1.6x-3.3x faster than the NumPy
steps for the LSTM, 1.8x-4.2x for the GRU, 1 layer, T=100, H 128 and 512, B 1 to 64)
when the extension was built and the CPU has AVX-512; ``RNNSERVE_NATIVE_CPU=0`` turns
them off. ``describe()["cpu_kernel"]`` says which path runs.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...errors import InvalidInput
from ...packing import unpack_block
from ...repository import PackedModel
from ..base import (BlockState, Engine, EngineOutput, check_block_states, check_forward_args,
                    split_block_states, stack_block_states)
from .native import status as native_status
from .cells import DirectionParams, prepare


def reverse_within_lengths(seq: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Reverse each sequence of a time-major [T, B, F] array over its own valid steps."""
    t = seq.shape[0]
    steps = np.arange(t)[:, None]
    idx = np.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return np.take_along_axis(seq, idx[:, :, None], axis=0)


class ReferenceEngine(Engine):
    """NumPy engine; ``dtype`` float32 (default) or float64.

    ``native``: run plain float32 LSTM and GRU blocks on the C kernels; None (default)
    means whenever they are usable (built, AVX-512, ``RNNSERVE_NATIVE_CPU`` not 0).
    """

    name = "reference"

    def __init__(self, model: PackedModel, dtype: Any = np.float32, native: bool | None = None) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise InvalidInput(f"the reference engine computes in float32 or float64, not {self.dtype}")
        usable, why = native_status()
        if native and not usable:
            raise InvalidInput(f"the native CPU kernel is not usable: {why}")
        if self.dtype != np.float32:
            usable, why = False, "float64 runs on NumPy"
        elif native is False:
            usable, why = False, "native=False"
        self._native, self._native_why = usable, why
        self.model = model
        self.spec = model.spec
        self._params: list[list[DirectionParams]] = []
        for k, (blk, flat) in enumerate(zip(self.spec.blocks, model.weights)):
            layers = unpack_block(blk, np.asarray(flat, dtype=np.float64))
            extras = {n: np.asarray(v, dtype=np.float64) for n, v in model.block_extras(k).items()}
            self._params.append([prepare(blk, lw, extras, p, self.dtype, self._native)
                                 for p, lw in enumerate(layers)])

    @property
    def cpu_kernel(self) -> str:
        """The cells that run on the C kernels, or why none does."""
        cells = [cell for cell in ("lstm", "gru")
                 if any(blk.cell == cell and any(prm.native is not None for prm in params)
                        for blk, params in zip(self.spec.blocks, self._params))]
        if cells:
            return f"native {' + '.join(c.upper() for c in cells)} (AVX-512)"
        return f"numpy ({self._native_why if not self._native else 'no plain float32 LSTM or GRU block'})"

    def describe(self) -> dict[str, Any]:
        """Engine facts; ``cpu_kernel`` names the cells that run on the C kernels, or why none does."""
        return {"engine": self.name, "dtype": str(self.dtype), "device": "cpu", "cpu_kernel": self.cpu_kernel}

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
                    hs = np.zeros((b, ho), self.dtype) if h0s is None else h0s[:, p].copy()
                    cs = None
                    if blk.cell == "lstm":
                        cs = np.zeros((b, h), self.dtype) if c0s is None else c0s[:, p].copy()
                    if prm.native is not None:
                        out = prm.native.run(inp, active, hs, cs)
                    else:
                        out = self._steps(prm, inp, active, hs, cs)
                    outs.append(reverse_within_lengths(out, lens_sorted) if backwards else out)
                    h_rows.append(hs)
                    if cs is not None:
                        c_rows.append(cs)
                seq = outs[0] if d_count == 1 else np.concatenate(outs, axis=2)
            finals.append((np.stack(h_rows, axis=1)[inverse],
                           np.stack(c_rows, axis=1)[inverse] if c_rows else None))

        output = seq.transpose(1, 0, 2)[inverse]
        return np.ascontiguousarray(output), finals

    def _steps(self, prm: DirectionParams, inp: np.ndarray, active: np.ndarray, hs: np.ndarray,
               cs: np.ndarray | None) -> np.ndarray:
        """The NumPy time loop of one (layer, direction); ``hs``/``cs`` end as the final state."""
        t, b = inp.shape[0], inp.shape[1]
        # One 2-D GEMM for every step: a 3-D matmul would loop over T in NumPy.
        xp = (inp.reshape(t * b, -1) @ prm.wt).reshape(t, b, -1)
        xp += prm.bias_x
        out = np.zeros((t, b, hs.shape[1]), self.dtype)
        for step in range(t):
            n = int(active[step])
            prm.step(xp[step, :n], hs[:n], None if cs is None else cs[:n])
            out[step, :n] = hs[:n]
        return out
