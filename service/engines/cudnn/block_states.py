"""A batch's recurrent states on the device, per block: the engine's contract holds all blocks'
states in one ``[rows, n, W]`` array (rows = every block's layers x directions), cuDNN runs a
block at a time on that block's rows.

:func:`block_views` and :func:`new_states` cut the whole arrays into per-block rows (the
whole array itself where a block spans it: a CuPy view costs microseconds of host time on
every batch), and :func:`read_slots` / :func:`write_slots` move the rows of stateful streams
from and to their slots of the engine's state pool (see service.engines.state_pool).
"""
from __future__ import annotations

from typing import Any

from ...spec import RNNSpec
from ..state_pool import PooledRows
from .copies import gather_slots, scatter_slots


def _rows(a: Any, start: int, count: int) -> Any:
    return a if start == 0 and count == a.shape[0] else a[start:start + count]


def block_views(spec: RNNSpec, h0: Any, c0: Any) -> list[tuple[Any, Any]] | None:
    """Per-block (h, c) rows of whole [R, n, Ho] / [Rc, n, H] states, or None when neither is given."""
    if h0 is None and c0 is None:
        return None
    views = []
    row = crow = 0
    for blk in spec.blocks:
        rows = blk.pseudo_layers
        c = None
        if blk.cell == "lstm":
            c = None if c0 is None else _rows(c0, crow, rows)
            crow += rows
        views.append((None if h0 is None else _rows(h0, row, rows), c))
        row += rows
    return views


def new_states(xp: Any, spec: RNNSpec, store: Any, n: int, uniform_h: bool, uniform_c: bool
               ) -> tuple[Any, Any, list[Any], list[Any]]:
    """Output states for ``n`` sequences: whole (hy, cy) buffers (None where the blocks' widths
    differ: ``uniform_h``/``uniform_c`` false) and per-block buffers (rows of the whole ones)."""
    hy = xp.empty((spec.state_layers, n, spec.state_size), store) if uniform_h else None
    cy = xp.empty((spec.cell_state_layers, n, spec.cell_state_size), store) if uniform_c else None
    hys, cys = [], []
    row = crow = 0
    for blk in spec.blocks:
        rows = blk.pseudo_layers
        hys.append(_rows(hy, row, rows) if hy is not None else xp.empty((rows, n, blk.output_size), store))
        row += rows
        if blk.cell == "lstm":
            cys.append(_rows(cy, crow, rows) if cy is not None else xp.empty((rows, n, blk.hidden_size), store))
            crow += rows
        else:
            cys.append(None)
    return hy, cy, hys, cys


def read_slots(cp: Any, spec: RNNSpec, store: Any, states: list[tuple[Any, Any]] | None, b: int,
               pooled: PooledRows, index_d: Any) -> list[tuple[Any, Any]] | None:
    """Per-block initial states with the rows ``pooled`` reads from their slots (one kernel per block).

    ``index_d``: ``pooled.index`` on the device, flat (reads first). Rows that read no slot keep
    their given h_0/c_0 row, or start at zeros where none was given.
    """
    if not pooled.reads:
        return states
    out = []
    for k, blk in enumerate(spec.blocks):
        h, c = states[k] if states is not None else (None, None)
        keep = (h is not None, c is not None)
        if h is None:
            h = cp.empty((blk.pseudo_layers, b, blk.output_size), store)
        if c is None and blk.cell == "lstm":
            c = cp.empty((blk.pseudo_layers, b, blk.hidden_size), store)
        gather_slots(cp, pooled.pool.arrays[k], (h, c), index_d, 0, b, keep)
        out.append((h, c))
    return out


def write_slots(cp: Any, hys: list[Any], cys: list[Any], b: int, pooled: PooledRows, index_d: Any) -> None:
    """The final states of the rows ``pooled`` writes, into their slots (one kernel per block)."""
    for k, (hy, cy) in enumerate(zip(hys, cys)):
        scatter_slots(cp, (hy, cy), pooled.pool.arrays[k], index_d, b, b)
