"""The engine contract shared by every engine, and the argument checks they all apply.

forward(x [B, T, I], lengths [B] | None, h0 [B, L*D, Ho] | None, c0 [B, L*D, H] | None)
  -> output [B, T, D*Ho] (zeros past each length), h_n [B, L*D, Ho], c_n [B, L*D, H] (LSTM only)

State rows are the (layer, direction) pairs of every block in order; c rows count
only LSTM blocks. A model whose blocks have different Ho (or H for LSTM blocks) has
no single state tensor: such a model refuses h0/c0 and returns h_n/c_n as None.

An engine whose class sets ``skips_states`` also takes ``forward(..., states_needed=False)``:
the caller will not read h_n/c_n, which may then come back as None. The cuDNN engine
uses that freedom on causal models to run a ragged batch padded to equal lengths
(one persistent-kernel launch instead of a launch per step; outputs past each length
are zeroed, and outputs up to it do not depend on what follows).

An engine whose class sets ``computes_last`` also takes ``forward(..., last_only=True)``:
the caller reads only the many-to-one output (each direction's output at its own final
step, as :func:`service.scheduler.batching.output_last` defines it), which then comes
back as ``last`` [B, D*Ho] with ``output`` None.

An engine whose class sets ``launches`` also has ``launch(x, lengths, h0, c0,
states_needed, last_only) -> Launched``: ``forward`` with host outputs, split into
queueing the work (returns at once) and waiting for it (:class:`Launched`); and
``launch_blocks(x, lengths, states) -> Launched`` the same for ``forward_blocks``.

forward_blocks(x, lengths, states) -> (output, states) is the same computation with
each block's state kept separately, ``states[k] = (h [B, L_k*D_k, Ho_k], c [B, L_k*D_k, H_k] | None)``,
so it works for every model, including those with no single state tensor; the states
it returns are the engine's own arrays (CuPy on the GPU engine), ``output`` is a host
NumPy array as from ``forward``.

Stateful streams keep their states in the engine's :meth:`Engine.state_pool` (a slot per
stream, on the GPU for the cuDNN engine) and run through ``forward_pooled(x, lengths,
h0, c0, pooled, states_needed)`` (and, on launching engines, ``launch(..., pooled=)``):
the rows ``pooled`` names start from their slots and leave their final states there,
so a stream's state never leaves the device between chunks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InvalidInput
from ..spec import RNNSpec
from .state_pool import PooledRows, StatePool


# One block's state: (h [B, L*D, Ho], c [B, L*D, H] for LSTM blocks else None).
BlockState = tuple[Any, Any]


def array_module(a: Any) -> Any:
    """NumPy, or CuPy for a CuPy array (without importing CuPy on CPU-only machines)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def check_block_states(spec: RNNSpec, states: Sequence[BlockState], b: int) -> None:
    """InvalidInput unless ``states`` holds one correctly shaped (h, c) per block."""
    if len(states) != len(spec.blocks):
        raise InvalidInput(f"states must hold one (h, c) per block ({len(spec.blocks)}), got {len(states)}")
    for k, (blk, (h, c)) in enumerate(zip(spec.blocks, states)):
        want = (b, blk.pseudo_layers, blk.output_size)
        if h is None or tuple(int(s) for s in h.shape) != want:
            raise InvalidInput(f"state h of block {k} must have shape {list(want)}, got "
                               f"{None if h is None else list(h.shape)}")
        if blk.cell == "lstm":
            want_c = (b, blk.pseudo_layers, blk.hidden_size)
            if c is None or tuple(int(s) for s in c.shape) != want_c:
                raise InvalidInput(f"state c of block {k} must have shape {list(want_c)}, got "
                                   f"{None if c is None else list(c.shape)}")
        elif c is not None:
            raise InvalidInput(f"block {k} ({blk.cell}) has no cell state; pass None as its c")


def split_block_states(spec: RNNSpec, h_n: Any, c_n: Any) -> list[BlockState]:
    """Per-block views of stacked h_n [B, R, Ho] / c_n [B, Rc, H] (either may be None: None per block)."""
    states: list[BlockState] = []
    row = crow = 0
    for blk in spec.blocks:
        rows = blk.pseudo_layers
        c = None
        if blk.cell == "lstm":
            c = None if c_n is None else c_n[:, crow:crow + rows]
            crow += rows
        states.append((None if h_n is None else h_n[:, row:row + rows], c))
        row += rows
    return states


def stack_block_states(spec: RNNSpec, states: Sequence[BlockState]) -> tuple[Any, Any]:
    """The contract's h_n/c_n from per-block states, or None where the widths differ."""
    xp = array_module(states[0][0])
    h_n = xp.concatenate([h for h, _ in states], axis=1) if spec.state_size is not None else None
    cs = [c for _, c in states if c is not None]
    c_n = xp.concatenate(cs, axis=1) if cs and spec.cell_state_size is not None else None
    return h_n, c_n


@dataclass
class EngineOutput:
    """What an engine returns; arrays are NumPy or, for the GPU engine if asked, CuPy."""

    output: Any
    h_n: Any
    c_n: Any = None
    last: Any = None  # many-to-one outputs [B, D*Ho], from engines that compute them (``computes_last``)


@dataclass
class Launched:
    """A forward call queued on a device by ``engine.launch(...)`` (engines that set ``launches``).

    ``wait()`` blocks until its results are on the host without holding the GIL, so a
    worker thread can wait while the caller's thread goes on; ``finish()`` then returns
    the EngineOutput (once).
    """

    event: Any
    finish: Callable[[], EngineOutput]

    def wait(self) -> None:
        """Block until the device has finished this call and its copies to the host."""
        self.event.synchronize()

    def ready(self) -> bool:
        """Whether :meth:`wait` would return at once (the event's ``done``: a query, never a wait)."""
        return bool(self.event.done)


class Engine(ABC):
    """An engine runs one packed model; ``name`` appears in model metadata as the platform."""

    name: str = "engine"
    spec: RNNSpec
    skips_states: bool = False  # forward() takes states_needed=False (see the module docstring)
    concurrent_batches: int = 1  # batches the scheduler keeps in flight (see service.scheduler)

    @abstractmethod
    def forward(self, x: Any, lengths: Any = None, h0: Any = None, c0: Any = None) -> EngineOutput:
        """Run the model on a batch; see the module docstring for shapes."""

    def forward_blocks(self, x: Any, lengths: Any = None,
                       states: Sequence[BlockState] | None = None) -> tuple[Any, list[BlockState]]:
        """Run the model with per-block states (see the module docstring); ``states`` None = zeros.

        This default serves engines whose models have one state width: it stacks the
        blocks' states into h0/c0 and splits h_n/c_n back. Engines that can run models
        with different widths per block override it.
        """
        spec = self.spec
        if spec.state_size is None or (spec.is_lstm and spec.cell_state_size is None):
            raise InvalidInput(f"engine '{self.name}' cannot run per-block states for a model whose blocks have "
                               f"different state sizes")
        xp = array_module(states[0][0]) if states else np
        h0 = c0 = None
        if states is not None:
            check_block_states(spec, states, int(x.shape[0]))
            h0 = xp.concatenate([h for h, _ in states], axis=1)
            cs = [c for _, c in states if c is not None]
            c0 = xp.concatenate(cs, axis=1) if cs else None
        out = self.forward(x, lengths, h0, c0)
        return out.output, split_block_states(spec, out.h_n, out.c_n)

    def state_pool(self, max_slots: int, initial: int | None = None) -> StatePool:
        """A pool for the states of up to ``max_slots`` live streams of this model (see :mod:`.state_pool`;
        ``initial``: slots to start with, default as there).

        This default keeps them in host NumPy arrays; the GPU engine keeps them on its device.
        """
        return StatePool(self.spec, np, np.float32, max_slots, initial)

    def forward_pooled(self, x: Any, lengths: Any, h0: Any, c0: Any, pooled: PooledRows,
                       states_needed: bool = True) -> EngineOutput:
        """:meth:`forward` where some rows start from, and leave their final state in, pool slots.

        Rows ``pooled`` reads start from their slot's state instead of ``h0``/``c0`` (zeros
        where those are None); every row ``pooled`` writes leaves its final state in its slot.
        h_n/c_n come back only when ``states_needed`` (and the model has one state width).
        This default runs :meth:`forward_blocks` on host arrays.
        """
        spec, pool = self.spec, pooled.pool
        pool.reserve()
        b = int(np.shape(x)[0])
        given = split_block_states(spec, h0, c0) if h0 is not None or c0 is not None else None
        reads, writes = pooled.read_pairs(), pooled.write_pairs()
        states: list[BlockState] = []
        for k, blk in enumerate(spec.blocks):
            pair = []
            for which, width in enumerate((blk.output_size, blk.hidden_size if blk.cell == "lstm" else None)):
                if width is None:
                    pair.append(None)
                    continue
                start = None if given is None else given[k][which]
                a = (np.zeros((b, blk.pseudo_layers, width), np.float32) if start is None
                     else np.array(start, dtype=np.float32))
                a[reads[:, 1]] = pool.arrays[k][which][:, reads[:, 0]].transpose(1, 0, 2)
                pair.append(a)
            states.append((pair[0], pair[1]))
        output, finals = self.forward_blocks(x, lengths, states)
        for k, final in enumerate(finals):
            for which, a in enumerate(final):
                if a is not None:
                    pool.arrays[k][which][:, writes[:, 1]] = np.asarray(a)[writes[:, 0]].transpose(1, 0, 2)
        h_n, c_n = stack_block_states(spec, finals) if states_needed else (None, None)
        return EngineOutput(output, h_n, c_n)

    def input_buffer(self, shape: tuple[int, int, int]) -> np.ndarray | None:
        """An uninitialized float32 host array for the ``x`` of a coming call, or None.

        An engine that copies its inputs to a device lends memory it copies from without a
        host copy first (the GPU engine: pinned memory), so the scheduler merges a batch
        straight into it. The array may be given to this engine's calls only; it stays
        the caller's while any view of it lives. This default has none.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for `rnnserve inspect` and model metadata."""
        return {"engine": self.name}

    def close(self) -> None:
        """Release device resources (no-op for CPU engines)."""


def check_forward_args(spec: RNNSpec, x: Any, lengths: Any, h0: Any, c0: Any, xp: Any = np) -> tuple[int, int, np.ndarray]:
    """Validate shapes and values; return (B, T, lengths as a host int64 array).

    ``xp`` is the array module of ``x`` (NumPy or CuPy); lengths are always checked on the host.
    """
    if getattr(x, "ndim", None) != 3:
        raise InvalidInput(f"input must have shape [batch, time, features], got shape {tuple(getattr(x, 'shape', ()))}")
    b, t, feat = (int(s) for s in x.shape)
    if b < 1 or t < 1:
        raise InvalidInput(f"input must hold at least one sequence of at least one step, got shape {(b, t, feat)}")
    if feat != spec.input_size:
        raise InvalidInput(f"input has {feat} features per step, the model expects {spec.input_size}")
    if x.dtype.kind != "f":
        raise InvalidInput(f"input must be a floating-point tensor, got {x.dtype}")
    if lengths is None:
        lens = np.full(b, t, dtype=np.int64)
    else:
        lens_arr = lengths.get() if hasattr(lengths, "get") else np.asarray(lengths)
        if lens_arr.shape != (b,):
            raise InvalidInput(f"lengths must have shape [{b}] (one per sequence), got {tuple(lens_arr.shape)}")
        if lens_arr.dtype.kind not in "iu":
            raise InvalidInput(f"lengths must be integers, got {lens_arr.dtype}")
        lens = lens_arr.astype(np.int64)
        if lens.min() < 1 or lens.max() > t:
            bad = int(np.flatnonzero((lens < 1) | (lens > t))[0])
            raise InvalidInput(
                f"lengths[{bad}] = {int(lens[bad])} is out of range: every length must be between 1 and T = {t}"
            )
    _check_state(spec, "h0", h0, b, spec.state_layers, spec.state_size)
    if c0 is not None and not spec.is_lstm:
        raise InvalidInput("c0 is only for LSTM models; this model has no cell state")
    _check_state(spec, "c0", c0, b, spec.cell_state_layers, spec.cell_state_size)
    return b, t, lens


def _check_state(spec: RNNSpec, name: str, arr: Any, b: int, rows: int, width: int | None) -> None:
    if arr is None:
        return
    if width is None:
        raise InvalidInput(f"{name} is not supported for this model: its blocks have different state sizes")
    shape = tuple(int(s) for s in arr.shape)
    if shape != (b, rows, width):
        raise InvalidInput(f"{name} must have shape [{b}, {rows}, {width}] ([batch, layers*directions, size]), got {list(shape)}")
