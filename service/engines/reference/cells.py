"""One time step of each cell, on the active prefix of a length-sorted batch, in place.

Weights are rearranged once at load so that gates sharing an activation are
contiguous (LSTM i, f, o, g), and every bias that cuDNN adds outside a reset gate is
folded into the input projection, which runs as one GEMM over all steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...packing import LayerWeights
from ...spec import BlockSpec
from .activations import InPlace, make_activation
from .native import NativeGRU, NativeLSTM

# internal row order of the canonical gates
_LSTM_ORDER = (0, 1, 3, 2)  # i, f, o, g


def _rows(mat: np.ndarray, order: tuple[int, ...], h: int) -> np.ndarray:
    return np.concatenate([mat[k * h:(k + 1) * h] for k in order], axis=0)


@dataclass
class DirectionParams:
    """One (layer, direction) prepared for stepping; built once by :func:`prepare`."""

    wt: np.ndarray                   # [in, G*H]
    bias_x: np.ndarray               # [G*H], folded into the input projection
    step: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None]
    native: NativeLSTM | NativeGRU | None = None  # runs every step in C instead of wt/bias_x/step


def prepare(spec: BlockSpec, lw: LayerWeights, extras: dict[str, np.ndarray], p: int, dtype,
            native: bool = False) -> DirectionParams:
    """Build the stepping function for pseudo-layer ``p`` of a block.

    ``native``: also pack a plain (cuDNN-expressible) float32 LSTM or GRU for the C kernels;
    variants (reset-before GRU, other activations, clip, ...) keep to the NumPy step.
    """
    prm = _prepare(spec, lw, extras, p, dtype)
    if native and spec.is_cudnn and np.dtype(dtype) == np.float32:
        if spec.cell == "lstm":
            prm.native = NativeLSTM.pack(lw.w, lw.r, lw.bw + lw.br, lw.proj)
        elif spec.cell == "gru":
            prm.native = NativeGRU.pack(lw.w, lw.r, lw.bw, lw.br)
    return prm


def _prepare(spec: BlockSpec, lw: LayerWeights, extras: dict[str, np.ndarray], p: int, dtype) -> DirectionParams:
    h = spec.hidden_size
    var = spec.variant
    d = p % spec.directions
    acts = (var.get("activations") or [None, None])[d] if var.get("activations") else None
    clip = float(var["clip"]) if var.get("clip") else None

    def act(i: int, default: str) -> InPlace:
        return make_activation(acts[i] if acts and i < len(acts) else None, default)

    def clipped(a: np.ndarray) -> None:
        if clip is not None:
            np.clip(a, -clip, clip, out=a)

    cast = lambda a: np.ascontiguousarray(a, dtype=dtype)  # noqa: E731

    if spec.cell == "lstm":
        w, r = _rows(lw.w, _LSTM_ORDER, h), _rows(lw.r, _LSTM_ORDER, h)
        b = _rows(lw.bw + lw.br, _LSTM_ORDER, h)
        rt = cast(r.T)
        pt = cast(lw.proj.T) if lw.proj is not None else None
        f_act, g_act, h_act = act(0, "sigmoid"), act(1, "tanh"), act(2, "tanh")
        peep = extras.get("peephole")
        p_i, p_f, p_o = (cast(peep[p][k]) for k in range(3)) if peep is not None else (None, None, None)
        input_forget = bool(var.get("input_forget"))
        if spec.is_cudnn:
            return _plain_lstm(w, r, b, pt, h, cast)

        def step(xt: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> None:
            gates = hs @ rt
            gates += xt
            if p_i is not None:
                gates[:, :h] += p_i * cs
                gates[:, h:2 * h] += p_f * cs
            if p_o is None:
                # o does not wait for the new cell state: one activation call for i, f, o.
                clipped(gates)
                f_act(gates[:, :3 * h])
            else:
                clipped(gates[:, :2 * h])
                clipped(gates[:, 3 * h:])
                f_act(gates[:, :2 * h])
            i_g, f_g = gates[:, :h], gates[:, h:2 * h]
            if input_forget:
                np.subtract(1.0, i_g, out=f_g)
            g_act(gates[:, 3 * h:])
            cs *= f_g
            i_g *= gates[:, 3 * h:]
            cs += i_g
            o_g = gates[:, 2 * h:3 * h]
            if p_o is not None:
                o_g += p_o * cs
                clipped(o_g)
                f_act(o_g)
            out = cs.copy()
            h_act(out)
            out *= o_g
            if pt is not None:
                np.matmul(out, pt, out=hs)
            else:
                hs[...] = out

        return DirectionParams(cast(w.T), cast(b), step)

    if spec.cell == "gru":
        f_act, g_act = act(0, "sigmoid"), act(1, "tanh")
        if var.get("reset_before"):
            # n = g(W_n x + bW_n + (r*h) R_n^T + bR_n): bR_n is outside the reset, so it folds.
            b = lw.bw + lw.br
            rt_rz, rt_n = cast(lw.r[:2 * h].T), cast(lw.r[2 * h:].T)

            def step(xt: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> None:
                rz = hs @ rt_rz
                rz += xt[:, :2 * h]
                clipped(rz)
                f_act(rz)
                n = (rz[:, :h] * hs) @ rt_n
                n += xt[:, 2 * h:]
                clipped(n)
                g_act(n)
                hs -= n
                hs *= rz[:, h:]
                hs += n

            return DirectionParams(cast(lw.w.T), cast(b), step)

        b = lw.bw.copy()
        b[:2 * h] += lw.br[:2 * h]
        brn = cast(lw.br[2 * h:])
        rt = cast(lw.r.T)

        def step(xt: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> None:
            hp = hs @ rt
            rz = hp[:, :2 * h]
            rz += xt[:, :2 * h]
            clipped(rz)
            f_act(rz)
            n = hp[:, 2 * h:]
            n += brn
            n *= rz[:, :h]
            n += xt[:, 2 * h:]
            clipped(n)
            g_act(n)
            hs -= n
            hs *= rz[:, h:]
            hs += n

        return DirectionParams(cast(lw.w.T), cast(b), step)

    f_act = act(0, "relu" if spec.cell == "rnn_relu" else "tanh")
    rt = cast(lw.r.T)

    def step(xt: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> None:
        a = hs @ rt
        a += xt
        clipped(a)
        f_act(a)
        hs[...] = a

    return DirectionParams(cast(lw.w.T), cast(lw.bw + lw.br), step)


def _plain_lstm(w: np.ndarray, r: np.ndarray, b: np.ndarray, pt: np.ndarray | None, h: int,
                cast: Callable[[np.ndarray], np.ndarray]) -> DirectionParams:
    """cuDNN's LSTM with the fewest NumPy calls per step (Python call overhead dominates small batches).

    sigmoid(x) = 0.5 * tanh(x / 2) + 0.5, so the i, f, o rows of every weight and bias are
    halved once here; one tanh call then serves all four gates.
    """
    scale = np.ones((4 * h, 1))
    scale[:3 * h] = 0.5
    rt = cast((r * scale).T)
    wt, bias = cast((w * scale).T), cast(b * scale[:, 0])

    def step(xt: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> None:
        gates = hs @ rt
        gates += xt
        np.tanh(gates, out=gates)
        ifo = gates[:, :3 * h]
        ifo *= 0.5
        ifo += 0.5
        cs *= gates[:, h:2 * h]
        i_g = gates[:, :h]
        i_g *= gates[:, 3 * h:]
        cs += i_g
        np.tanh(cs, out=i_g)
        if pt is None:
            np.multiply(i_g, gates[:, 2 * h:3 * h], out=hs)
        else:
            i_g *= gates[:, 2 * h:3 * h]
            np.matmul(i_g, pt, out=hs)

    return DirectionParams(wt, bias, step)
