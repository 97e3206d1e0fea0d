"""The compiled LSTM and GRU kernels of the reference engine (float32, x86-64 with AVX-512).

Why they exist: the NumPy LSTM step is about nine NumPy calls (a GRU step about twelve),
and PyTorch runs its CPU LSTM and GRU through oneDNN's fused RNN primitive. On the 2-core
CI-class machine (Xeon with AVX-512, torch 2.13 with 2 threads, T=100, float32) the NumPy
engine reached only 0.29x-0.46x of torch.nn.LSTM's speed at most points (e.g. B=1,
H=128: 0.98 ms vs 0.34 ms; B=64, H=512: 147 ms vs 68 ms) and 0.59x-0.63x of
torch.nn.GRU's at B=64, H=128. OpenBLAS's sgemm is no way out: for the recurrent product
[64, 512] x [512, 2048] it reaches ~120 GFLOP/s where oneDNN's fused LSTM sustains ~300.
``kernels.c`` runs the whole time loop of one (layer, direction) in C with the GIL
released: the input projection of a chunk of steps as one GEMM, then per step a
register-blocked AVX-512 GEMM on pre-packed weights whose epilogue applies the gates, and
one helper thread per extra core that owns its own hidden units (one barrier a step).
Measured on that machine (2026-11-22, 1 layer, T=100, best median of 3 blocks of 5 calls),
NumPy path -> kernel:

    H=128  LSTM B=1 1.36 -> 0.41 ms, B=16 8.0 -> 2.8 ms, B=64 18.2 -> 8.8 ms
           GRU  B=1 1.33 -> 0.31 ms, B=16 6.2 -> 1.8 ms, B=64 18.5 -> 6.8 ms
    H=512  LSTM B=1 9.0 -> 4.6 ms,   B=16 49.9 -> 25.4 ms, B=64 143 -> 90 ms
           GRU  B=1 7.9 -> 2.7 ms,   B=16 47.4 -> 24.6 ms, B=64 154 -> 86 ms

README.md, "CPU: reference engine", compares them with torch.

The GRU kernel runs cuDNN's (and PyTorch's) form, the reset gate applied after the
recurrent product: n = tanh(W_n x + bW_n + r * (R_n h + bR_n)). The NumPy path stays the
exact reference and the fallback: it runs float64, every variant (peepholes, clip, other
activations, coupled gates, reset-before GRU, reversed blocks), RNN cells, and every
block where the extension was not built (the package not installed, or no C compiler), the CPU lacks
AVX-512, or ``RNNSERVE_NATIVE_CPU=0`` is set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

try:
    from . import _kernels
except ImportError:  # built without a C compiler: the NumPy path serves
    _kernels = None

ENV_SWITCH = "RNNSERVE_NATIVE_CPU"
_UNITS = 16   # hidden units per weight panel; a panel row is G gates x 16 floats
_PANEL = 64   # columns of a projection panel
# A second thread pays when a step has this many multiply-adds, or when the recurrent
# weights are this large (a step is then bound by reading them, and two cores' caches
# hold more). Below both, its start-up and per-step barrier cost more than it saves.
# Both cells use the same rule. The MAC bound was 2^21 while the helper thread could start
# on the caller's CPU (kernels.c, helper_attr), which made two threads swing from run to run
# (B=16 H=128 LSTM: 0.44x-1.0x PyTorch); with the helper kept off that CPU, two threads
# beat one at B=16 H=128 in every block of the CPU bench's pattern (this 2-core VM,
# 2026-11-22, best medians: LSTM 2.3-2.7 vs 2.9 ms, 2 layers 4.5-5.0 vs 5.6-5.9 ms, GRU
# 1.9-2.1 vs 2.2-2.4 ms). B=1 H=512 ran 1.1x-1.5x PyTorch on two threads, 0.48x on one.
_THREAD_MIN_MACS = 1 << 19
_THREAD_MIN_WEIGHT_BYTES = 1 << 20


def built() -> bool:
    """True when the C extension was compiled and imports."""
    return _kernels is not None


def status() -> tuple[bool, str]:
    """(usable, why): whether plain float32 LSTM and GRU blocks run on the kernels in this process."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_SWITCH}=0"
    if _kernels is None:
        return False, ("the compiled kernels are not built, which installing the package does with a C compiler "
                       "present: pip install -e . or make serve")
    if not _kernels.supported():
        return False, "CPU has no AVX-512"
    return True, "native LSTM and GRU kernels (AVX-512)"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _aligned(a: np.ndarray) -> np.ndarray:
    """A float32 copy of ``a`` on a 64-byte boundary: a 64-byte load that crosses two
    cache lines costs two, which halved the kernel's speed on NumPy's 16-byte alignment."""
    buf = np.empty(a.size + 16, np.float32)
    start = (-buf.ctypes.data % 64) // 4
    out = buf[start:start + a.size].reshape(a.shape)
    out[...] = a
    return out


def _gate_panels(m: np.ndarray, h: int, gates: int) -> np.ndarray:
    """[G*H, K] cuDNN-ordered gate rows -> [H/16, K, 16*G] panels (16 units x the G gates)."""
    k = m.shape[1]
    nb = -(-h // _UNITS)
    padded = np.zeros((gates, nb * _UNITS, k))
    padded[:, :h] = m.reshape(gates, h, k)
    return _aligned(padded.reshape(gates, nb, _UNITS, k).transpose(1, 3, 0, 2).reshape(nb, k, gates * _UNITS))


def _bias_panels(b: np.ndarray, h: int, gates: int) -> np.ndarray:
    """[G*H] cuDNN-ordered gate biases -> [H/16, 16*G], one panel row per unit block."""
    return _gate_panels(b[:, None], h, gates)[:, 0]


def _column_panels(mt: np.ndarray) -> np.ndarray:
    """[K, N] -> [N/64, K, 64] column panels, zero-padded."""
    k, n = mt.shape
    npb = -(-n // _PANEL)
    padded = np.zeros((k, npb * _PANEL))
    padded[:, :n] = mt
    return _aligned(padded.reshape(k, npb, _PANEL).transpose(1, 0, 2))


@dataclass
class _Packed:
    """What both cells' kernels share: sizes and the panel-packed input and recurrent weights."""

    gates: ClassVar[int]
    input_size: int
    hidden_size: int
    output_size: int
    wx: np.ndarray
    bx: np.ndarray
    wh: np.ndarray

    def _call_arrays(self, seq: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(float32 input, int64 ``active``, zeroed output [T, B, Ho], thread count) for one call."""
        t, b, _ = seq.shape
        out = np.zeros((t, b, self.output_size), np.float32)
        macs = b * self.output_size * self.gates * self.hidden_size
        weight_bytes = 4 * self.gates * self.hidden_size * self.output_size
        threads = _cpu_count() if macs >= _THREAD_MIN_MACS or weight_bytes >= _THREAD_MIN_WEIGHT_BYTES else 1
        return (np.ascontiguousarray(seq, dtype=np.float32), np.ascontiguousarray(active, dtype=np.int64), out,
                threads)


@dataclass
class NativeLSTM(_Packed):
    """One (layer, direction) of a cuDNN-expressible LSTM, packed for the kernel."""

    gates: ClassVar[int] = 4
    proj: np.ndarray | None = None

    @classmethod
    def pack(cls, w: np.ndarray, r: np.ndarray, bias: np.ndarray, proj: np.ndarray | None) -> "NativeLSTM":
        """Canonical weights: w [4H, in], r [4H, Ho], bias [4H] (bW + bR), proj [Ho, H] or None."""
        g = cls.gates
        h = r.shape[0] // g
        return cls(w.shape[1], h, r.shape[1], _gate_panels(w, h, g), _bias_panels(bias, h, g), _gate_panels(r, h, g),
                   None if proj is None else _column_panels(proj.T))

    def run(self, seq: np.ndarray, active: np.ndarray, hs: np.ndarray, cs: np.ndarray | None) -> np.ndarray:
        """Run all steps of time-major ``seq`` [T, B, in] (batch sorted by length, ``active[t]``
        rows live at step t); ``hs`` [B, Ho] and ``cs`` [B, H] hold the initial state and
        receive the final one. Returns [T, B, Ho], zero past each sequence's end."""
        x, act, out, threads = self._call_arrays(seq, active)
        _kernels.lstm(x.shape[0], x.shape[1], self.input_size, self.hidden_size, self.output_size,
                      x, self.wx, self.bx, self.wh, self.proj, act, hs, cs, out, threads)
        return out


@dataclass
class NativeGRU(_Packed):
    """One (layer, direction) of a cuDNN-expressible (reset-after) GRU, packed for the kernel."""

    gates: ClassVar[int] = 3
    bh: np.ndarray = field(kw_only=True)

    @classmethod
    def pack(cls, w: np.ndarray, r: np.ndarray, bw: np.ndarray, br: np.ndarray) -> "NativeGRU":
        """Canonical weights: w [3H, in], r [3H, H], bw and br [3H], gates r, z, n.

        bR_n sits inside the reset gate's product, so it starts the recurrent GEMM (``bh``);
        every other bias folds into the input projection (``bx``), as in the NumPy path."""
        g = cls.gates
        h = r.shape[0] // g
        bx = bw.copy()
        bx[:2 * h] += br[:2 * h]
        bh = np.zeros(g * h)
        bh[2 * h:] = br[2 * h:]
        return cls(w.shape[1], h, h, _gate_panels(w, h, g), _bias_panels(bx, h, g), _gate_panels(r, h, g),
                   bh=_bias_panels(bh, h, g))

    def run(self, seq: np.ndarray, active: np.ndarray, hs: np.ndarray, cs: np.ndarray | None = None) -> np.ndarray:
        """Run all steps of time-major ``seq`` [T, B, in] (batch sorted by length, ``active[t]``
        rows live at step t); ``hs`` [B, H] holds the initial state and receives the final one
        (``cs`` is there for the LSTM's signature and must be None). Returns [T, B, H], zero
        past each sequence's end."""
        x, act, out, threads = self._call_arrays(seq, active)
        _kernels.gru(x.shape[0], x.shape[1], self.input_size, self.hidden_size,
                     x, self.wx, self.bx, self.wh, self.bh, act, hs, out, threads)
        return out
