"""Stream state pools (service.engines.state_pool) and engines' forward_pooled, on the reference engine (CPU).

Chunked runs through pool slots, interleaved in batches with other streams and with a
stateless request, must equal each sequence run whole; the GPU engine's pool is checked
the same way in test_cudnn_copies_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.base import split_block_states
from service.engines.reference import ReferenceEngine
from service.engines.state_pool import PooledRows, StatePool
from service.errors import Unavailable
from service.packing import LayerWeights, pack_block
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec


def _block(cell: str, i: int, h: int, layers: int, rng) -> tuple[BlockSpec, np.ndarray]:
    spec = BlockSpec(cell, i, h, layers)
    g = spec.gates
    ws = [LayerWeights(rng.uniform(-0.4, 0.4, (g * h, i if layer == 0 else h)), rng.uniform(-0.4, 0.4, (g * h, h)),
                       rng.uniform(-0.2, 0.2, g * h), rng.uniform(-0.2, 0.2, g * h)) for layer in range(layers)]
    return spec, pack_block(spec, ws)


def model(blocks: list[tuple[str, int, int]], seed: int = 0) -> PackedModel:
    """Blocks (cell, hidden, layers) in a chain from 5 input features, random weights."""
    rng = np.random.default_rng(seed)
    specs, weights, i = [], [], 5
    for cell, h, layers in blocks:
        spec, flat = _block(cell, i, h, layers, rng)
        specs.append(spec)
        weights.append(flat)
        i = h
    return PackedModel(RNNSpec(tuple(specs)), weights)


def test_slots_are_reused_and_limited():
    pool = StatePool(model([("lstm", 3, 1)]).spec, np, np.float32, max_slots=3)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert sorted((a, b, c)) == [0, 1, 2] and pool.in_use == 3
    with pytest.raises(Unavailable, match="all 3 stream state slots are in use"):
        pool.acquire()
    pool.release(b)
    assert pool.acquire() == b and pool.in_use == 3


def test_growth_keeps_the_states_it_holds():
    spec = model([("lstm", 3, 2), ("gru", 4, 1)]).spec
    pool = StatePool(spec, np, np.float32, max_slots=40, initial=2)
    first = [pool.acquire() for _ in range(2)]
    pool.reserve()
    h, c = pool.arrays[0]
    h[:, first] = 1.5
    c[:, first] = -2.0
    pool.arrays[1][0][:, first] = 7.0
    more = [pool.acquire() for _ in range(20)]
    pool.reserve()
    assert pool.capacity == 32  # doubled until every slot handed out fits
    h, c = pool.arrays[0]
    assert h.shape == (2, 32, 3) and c.shape == (2, 32, 3) and pool.arrays[1][1] is None
    assert np.all(h[:, first] == 1.5) and np.all(c[:, first] == -2.0) and np.all(pool.arrays[1][0][:, first] == 7.0)
    assert np.all(h[:, more] == 0)
    [pool.acquire() for _ in range(18)]
    pool.reserve()
    assert pool.capacity == 40  # never past max_slots


def test_a_pool_starts_with_room_for_every_stream_when_that_fits_the_presize_budget(monkeypatch):
    spec = model([("lstm", 3, 2), ("gru", 4, 1)]).spec
    per = StatePool.slot_bytes(spec, np.float32)
    assert per == 4 * (2 * (3 + 3) + 1 * 4)  # h and c of 2 LSTM layers, h of a GRU layer, float32
    pool = StatePool(spec, np, np.float32, max_slots=1000)
    arrays = [a for pair in pool.arrays for a in pair if a is not None]
    assert pool.capacity == 1000 and arrays[0].shape == (2, 1000, 3)
    [pool.acquire() for _ in range(1000)]
    pool.reserve()  # every stream the model allows: the arrays (and graphs over their addresses) stay put
    assert all(a is b for a, b in zip(arrays, [a for pair in pool.arrays for a in pair if a is not None]))
    # past the budget: as many slots as fit in it, at least 16; growth then works as before
    monkeypatch.setattr("service.engines.state_pool.PRESIZE_BYTES", 100 * per)
    assert StatePool(spec, np, np.float32, max_slots=1000).capacity == 100
    assert StatePool(spec, np, np.float32, max_slots=1000, initial=2).capacity == 2
    monkeypatch.setattr("service.engines.state_pool.PRESIZE_BYTES", 1)
    assert StatePool(spec, np, np.float32, max_slots=1000).capacity == 16


MODELS = {
    "lstm-2-layers": [("lstm", 6, 2)],
    "gru": [("gru", 7, 1)],
    "rnn_tanh-2-layers": [("rnn_tanh", 4, 2)],
    "lstm-then-gru (different widths)": [("lstm", 6, 1), ("gru", 3, 2)],
}


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64)


def check_pooled_chunks(engine, oracle, rtol: float, atol: float, seed: int = 3) -> None:
    """20 streams (more than a pool's first 16 slots) in chunks of 1-5 steps through ``engine``'s pool,
    each round a batch of some streams' next chunks (first chunks among them, one with its own
    h_0/c_0 where the model has one state width) beside a stateless request with an h_0: every
    stream's outputs and final states (read from its slot) equal ``oracle`` run on the whole sequence."""
    spec = engine.spec
    rng = np.random.default_rng(seed)
    n, t, feat = 20, 12, spec.input_size
    xs = rng.standard_normal((n, t, feat)).astype(np.float32)
    uniform = spec.state_size is not None and (not spec.is_lstm or spec.cell_state_size is not None)
    h_start = rng.standard_normal((1, spec.state_layers, spec.state_size)).astype(np.float32) if uniform else None
    c_start = (rng.standard_normal((1, spec.cell_state_layers, spec.cell_state_size)).astype(np.float32)
               if uniform and spec.is_lstm else None)
    pool = engine.state_pool(n, initial=4)  # grows while the streams run
    slots = [pool.acquire() for _ in range(n)]
    done = [0] * n
    outs: list[list[np.ndarray]] = [[] for _ in range(n)]
    rounds = 0
    while min(done) < t:
        live = [k for k in range(n) if done[k] < t and rng.random() < 0.7] or [min(range(n), key=done.__getitem__)]
        steps = [min(int(rng.integers(1, 6)), t - done[k]) for k in live]
        width = max(steps) + 2  # client padding past the longest chunk
        x = np.zeros((len(live) + 1, width, feat), np.float32)
        lengths = np.array(steps + [width], np.int64)
        h0 = c0 = None
        if uniform:
            h0 = np.zeros((len(live) + 1, spec.state_layers, spec.state_size), np.float32)
            h0[-1] = 0.3
            c0 = np.zeros((len(live) + 1, spec.cell_state_layers, spec.cell_state_size), np.float32) \
                if spec.is_lstm else None
        reads, writes = [], []
        for row, (k, s) in enumerate(zip(live, steps)):
            x[row, :s] = xs[k, done[k]:done[k] + s]
            if done[k]:
                reads.append((slots[k], row))
            elif k == 0 and uniform:  # stream 0 starts from its own state, like a first chunk with h_0/c_0
                h0[row] = h_start[0]
                if c0 is not None:
                    c0[row] = c_start[0]
            writes.append((row, slots[k]))
        x[-1] = rng.standard_normal((width, feat))
        rounds += 1
        states_needed = rounds % 2 == 0
        out = engine.forward_pooled(x, lengths, h0, c0, PooledRows.of(pool, len(live) + 1, reads, writes),
                                    states_needed=states_needed)
        for row, (k, s) in enumerate(zip(live, steps)):
            outs[k].append(_host(out.output[row, :s]))
            done[k] += s
        alone = oracle.forward(x[-1:], None, None if h0 is None else h0[-1:], None if c0 is None else c0[-1:])
        np.testing.assert_allclose(_host(out.output[-1]), alone.output[0], rtol=rtol, atol=atol)
        if states_needed and uniform:
            np.testing.assert_allclose(_host(out.h_n[-1]), alone.h_n[0], rtol=rtol, atol=atol)
    for k in range(n):
        start = (h_start, c_start) if k == 0 and uniform else (None, None)
        whole = oracle.forward(xs[k:k + 1], None, *start)
        np.testing.assert_allclose(np.concatenate(outs[k])[None], whole.output, rtol=rtol, atol=atol)
        _, finals = oracle.forward_blocks(xs[k:k + 1], None,
                                          None if start[0] is None else split_block_states(spec, *start))
        for b, (h, c) in enumerate(finals):
            np.testing.assert_allclose(_host(pool.arrays[b][0][:, slots[k]]), h[0], rtol=rtol, atol=atol)
            if c is not None:
                np.testing.assert_allclose(_host(pool.arrays[b][1][:, slots[k]]), c[0], rtol=rtol, atol=atol)


@pytest.mark.parametrize("blocks", list(MODELS.values()), ids=list(MODELS))
def test_pooled_chunks_equal_whole_sequences(blocks):
    m = model(blocks, seed=len(blocks))
    check_pooled_chunks(ReferenceEngine(m), ReferenceEngine(m), rtol=1e-5, atol=1e-6)
