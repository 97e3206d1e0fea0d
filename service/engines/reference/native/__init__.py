"""The compiled LSTM kernel of the reference engine (float32, x86-64 with AVX-512).

Why it exists: the NumPy LSTM step is about nine NumPy calls, and PyTorch runs its CPU
LSTM through oneDNN's fused RNN primitive. On the 2-core CI-class machine (Xeon with
AVX-512, torch 2.13 with 2 threads, T=100, float32) the NumPy engine reached only
0.29x-0.46x of torch.nn.LSTM's speed at most points (e.g. B=1, H=128: 0.98 ms vs
0.34 ms; B=64, H=512: 147 ms vs 68 ms). OpenBLAS's sgemm is no way out: for the
recurrent product [64, 512] x [512, 2048] it reaches ~120 GFLOP/s where oneDNN's
fused LSTM sustains ~300. ``kernels.c`` runs the whole time loop of one (layer,
direction) in C with the GIL released: a register-blocked AVX-512 GEMM on
pre-packed weights whose epilogue applies the gates, and one helper thread per
extra core that owns its own hidden units (one barrier a step). Measured in one run
on that machine, 1 layer, T=100, NumPy path -> kernel: H=128: B=1 1.32 -> 0.42 ms,
B=16 7.85 -> 3.49 ms, B=64 21.5 -> 8.2 ms; H=512: B=1 10.0 -> 5.8 ms, B=16 69.5 ->
32.9 ms, B=64 163 -> 118 ms. README.md, "CPU: reference engine", compares it with torch.

The NumPy path stays the exact reference and the fallback: it runs float64, every
variant (peepholes, clip, other activations, coupled gates), GRU and RNN cells, and
every LSTM where the extension was not built (no C compiler at install time), the CPU
lacks AVX-512, or ``RNNSERVE_NATIVE_CPU=0`` is set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

try:
    from . import _kernels
except ImportError:  # built without a C compiler: the NumPy path serves
    _kernels = None

ENV_SWITCH = "RNNSERVE_NATIVE_CPU"
_UNITS = 16   # hidden units per weight panel; a panel row is 4 gates x 16 floats
_PANEL = 64
# A second thread pays when a step has this many multiply-adds, or when the recurrent
# weights are this large (a step is then bound by reading them, and two cores' caches
# hold more). Below both, its start-up and per-step barrier cost more than it saves, and
# the barrier stalls whenever another thread takes a core (this 2-core VM, 2026-11-22:
# B=16 H=128 ran 0.44x-1.0x PyTorch on two threads from run to run, 0.82x-0.96x on one;
# B=1 H=512 ran 1.1x-1.5x on two threads, 0.48x on one).
_THREAD_MIN_MACS = 1 << 21
_THREAD_MIN_WEIGHT_BYTES = 1 << 20


def built() -> bool:
    """True when the C extension was compiled and imports."""
    return _kernels is not None


def status() -> tuple[bool, str]:
    """(usable, why): whether float32 LSTM blocks run on the kernel in this process."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"{ENV_SWITCH}=0"
    if _kernels is None:
        return False, "extension not built (no C compiler at install time)"
    if not _kernels.supported():
        return False, "CPU has no AVX-512"
    return True, "native LSTM kernel (AVX-512)"


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


def _gate_panels(m: np.ndarray, h: int) -> np.ndarray:
    """[4H, K] cuDNN-ordered gate rows -> [H/16, K, 64] panels (16 units x i, f, g, o)."""
    k = m.shape[1]
    nb = -(-h // _UNITS)
    padded = np.zeros((4, nb * _UNITS, k))
    padded[:, :h] = m.reshape(4, h, k)
    return _aligned(padded.reshape(4, nb, _UNITS, k).transpose(1, 3, 0, 2).reshape(nb, k, _PANEL))


def _column_panels(mt: np.ndarray) -> np.ndarray:
    """[K, N] -> [N/64, K, 64] column panels, zero-padded."""
    k, n = mt.shape
    npb = -(-n // _PANEL)
    padded = np.zeros((k, npb * _PANEL))
    padded[:, :n] = mt
    return _aligned(padded.reshape(k, npb, _PANEL).transpose(1, 0, 2))


@dataclass
class NativeLSTM:
    """One (layer, direction) of a cuDNN-expressible LSTM, packed for the kernel."""

    input_size: int
    hidden_size: int
    output_size: int
    wx: np.ndarray
    bx: np.ndarray
    wh: np.ndarray
    proj: np.ndarray | None

    @classmethod
    def pack(cls, w: np.ndarray, r: np.ndarray, bias: np.ndarray, proj: np.ndarray | None) -> "NativeLSTM":
        """Canonical weights: w [4H, in], r [4H, Ho], bias [4H] (bW + bR), proj [Ho, H] or None."""
        h = r.shape[0] // 4
        return cls(w.shape[1], h, r.shape[1], _gate_panels(w, h), _gate_panels(bias[:, None], h)[:, 0],
                   _gate_panels(r, h), None if proj is None else _column_panels(proj.T))

    def run(self, seq: np.ndarray, active: np.ndarray, hs: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Run all steps of time-major ``seq`` [T, B, in] (batch sorted by length, ``active[t]``
        rows live at step t); ``hs`` [B, Ho] and ``cs`` [B, H] hold the initial state and
        receive the final one. Returns [T, B, Ho], zero past each sequence's end."""
        t, b, _ = seq.shape
        out = np.zeros((t, b, self.output_size), np.float32)
        macs = b * self.output_size * 4 * self.hidden_size
        weight_bytes = 4 * self.hidden_size * self.output_size * 4
        threads = _cpu_count() if macs >= _THREAD_MIN_MACS or weight_bytes >= _THREAD_MIN_WEIGHT_BYTES else 1
        _kernels.lstm(t, b, self.input_size, self.hidden_size, self.output_size,
                      np.ascontiguousarray(seq, dtype=np.float32), self.wx, self.bx, self.wh, self.proj,
                      np.ascontiguousarray(active, dtype=np.int64), hs, cs, out, threads)
        return out
