"""Fused calls of the cuDNN engine (service.engines.cudnn.fused): an equal-length call's whole device work as one
CUDA graph. Checked against the float64 reference engine on whole sequences and against the same engine with
CUDA graphs off (the general path), for stream chunks through the state pool, stateless calls carrying
h_0/c_0, many-to-one and full outputs, both memory layouts, bucketed rows, float16 and a pool that grows
(its arrays move) while streams are live. Every test also checks that the fused path ran.

GPU only (``pytest -m gpu``).
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.base import split_block_states
from service.engines.reference import ReferenceEngine
from service.engines.state_pool import PooledRows
from service.loaders.verify import ATOL, RTOL
from test_cudnn_copies_gpu import cp  # noqa: F401 - the fixture (CuPy, or skip without a CUDA device)
from test_state_pool import MODELS
from test_state_pool import model as pool_model

pytestmark = pytest.mark.gpu
BUCKETS = (1, 2, 4, 8, 16, 32)


def _engine(model, **kw):
    from service.engines.cudnn import CudnnEngine
    from service.errors import EngineUnavailable

    try:
        return CudnnEngine(model, buckets=BUCKETS, **kw)
    except EngineUnavailable as exc:  # a forced layout this cuDNN build refuses for the model
        pytest.skip(str(exc))


def _call(engine, x, h0, c0, pooled, states_needed, last_only):
    launched = engine.launch(x, np.full(len(x), x.shape[1], np.int64), h0, c0, states_needed=states_needed,
                             last_only=last_only, pooled=pooled)
    launched.wait()
    return launched.finish()


def _uniform_states(spec) -> bool:
    return spec.state_size is not None and (not spec.is_lstm or spec.cell_state_size is not None)


@pytest.mark.parametrize("layout", [None, "seq_major"])
@pytest.mark.parametrize("blocks", list(MODELS.values()), ids=list(MODELS))
def test_fused_stream_chunks_equal_whole_sequences(cp, blocks, layout):
    """20 streams in 3-step chunks (the pool grows from 4 slots meanwhile), each round a batch of some streams'
    next chunks, first chunks among them (stream 0 from its own h_0/c_0); rounds alternate many-to-one and full
    outputs and whether the final states are read: every stream's outputs and its slot's final states equal
    the reference engine on the whole sequence."""
    model = pool_model(blocks, seed=len(blocks) + 10)
    engine = _engine(model, layout=layout)
    oracle = ReferenceEngine(model, dtype=np.float64)
    spec, rng = model.spec, np.random.default_rng(4)
    streams, chunk, chunks = 20, 3, 5
    xs = rng.standard_normal((streams, chunk * chunks, spec.input_size)).astype(np.float32)
    uniform = _uniform_states(spec)
    h_start = rng.standard_normal((1, spec.state_layers, spec.state_size)).astype(np.float32) if uniform else None
    c_start = (rng.standard_normal((1, spec.cell_state_layers, spec.cell_state_size)).astype(np.float32)
               if uniform and spec.is_lstm else None)
    try:
        pool = engine.state_pool(streams, initial=4)  # grows meanwhile
        slots = [pool.acquire() for _ in range(streams)]
        done = [0] * streams
        lasts: dict[tuple[int, int], np.ndarray] = {}
        outs: list[list[np.ndarray]] = [[] for _ in range(streams)]
        rounds = 0
        while min(done) < chunks:
            live = [k for k in range(streams) if done[k] < chunks and rng.random() < 0.6]
            live = live or [min(range(streams), key=done.__getitem__)]
            x = np.stack([xs[k, done[k] * chunk:(done[k] + 1) * chunk] for k in live])
            h0 = c0 = None
            reads, writes = [], []
            for row, k in enumerate(live):
                if done[k]:
                    reads.append((slots[k], row))
                elif k == 0 and uniform:
                    h0 = np.zeros((len(live), spec.state_layers, spec.state_size), np.float32)
                    h0[row] = h_start[0]
                    if c_start is not None:
                        c0 = np.zeros((len(live), spec.cell_state_layers, spec.cell_state_size), np.float32)
                        c0[row] = c_start[0]
                writes.append((row, slots[k]))
            rounds += 1
            last_only = rounds % 3 == 0
            out = _call(engine, x, h0, c0, PooledRows.of(pool, len(live), reads, writes),
                        states_needed=rounds % 2 == 0, last_only=last_only)
            for row, k in enumerate(live):
                if last_only:
                    lasts[(k, done[k])] = np.asarray(out.last[row])
                    outs[k].append(None)
                else:
                    outs[k].append(np.asarray(out.output[row]))
                done[k] += 1
        assert engine.describe()["fused_calls"] > 0, "the fused path never ran"
        assert pool.capacity >= streams
        for k in range(streams):
            start = (h_start, c_start) if k == 0 and uniform else (None, None)
            whole = oracle.forward(xs[k:k + 1], None, *start).output[0]
            for j, got in enumerate(outs[k]):
                steps = whole[j * chunk:(j + 1) * chunk]
                if got is None:
                    np.testing.assert_allclose(lasts[(k, j)], steps[-1], rtol=RTOL, atol=ATOL,
                                               err_msg=f"stream {k} chunk {j} (many-to-one)")
                else:
                    np.testing.assert_allclose(got, steps, rtol=RTOL, atol=ATOL, err_msg=f"stream {k} chunk {j}")
            _, finals = oracle.forward_blocks(xs[k:k + 1], None,
                                              None if start[0] is None else split_block_states(spec, *start))
            for b, (h, c) in enumerate(finals):
                np.testing.assert_allclose(cp.asnumpy(pool.arrays[b][0][:, slots[k]]), h[0], rtol=RTOL, atol=ATOL)
                if c is not None:
                    np.testing.assert_allclose(cp.asnumpy(pool.arrays[b][1][:, slots[k]]), c[0], rtol=RTOL,
                                               atol=ATOL)
    finally:
        engine.close()


@pytest.mark.parametrize("precision,tol", [("float32", None), ("float16", 1e-2)])
@pytest.mark.parametrize("blocks", [MODELS["lstm-2-layers"], MODELS["gru"]], ids=["lstm-2-layers", "gru"])
def test_fused_stateless_calls_equal_the_general_path(cp, blocks, precision, tol):
    """Equal-length calls with and without h_0/c_0, for every row count 1..9 (bucketed rows), with the final
    states read and not: the fused results equal the same engine with CUDA graphs off and the reference."""
    model = pool_model(blocks, seed=7)
    spec, rng = model.spec, np.random.default_rng(9)
    fused, plain = _engine(model, precision=precision), _engine(model, precision=precision, graph_memory_mb=0)
    oracle = ReferenceEngine(model, dtype=np.float64)
    rtol, atol = (RTOL, ATOL) if tol is None else (tol, tol)
    try:
        for with_states in (False, True):
            for b in range(1, 10):
                for rep in range(3):  # a shape's first calls run the general path, later ones the graph
                    x = rng.standard_normal((b, 6, spec.input_size)).astype(np.float32)
                    h0 = rng.standard_normal((b, spec.state_layers, spec.state_size)).astype(np.float32) \
                        if with_states else None
                    c0 = rng.standard_normal((b, spec.cell_state_layers, spec.cell_state_size)).astype(np.float32) \
                        if with_states and spec.is_lstm else None
                    last_only = rep == 2
                    got = _call(fused, x, h0, c0, None, True, last_only)
                    want = _call(plain, x, h0, c0, None, True, last_only)
                    ref = oracle.forward(x, None, h0, c0)
                    what = f"b={b} states={with_states} rep={rep}"
                    if last_only:
                        assert got.output is None
                        np.testing.assert_allclose(got.last, want.last, rtol=rtol, atol=atol, err_msg=what)
                        np.testing.assert_allclose(got.last, ref.output[:, -1], rtol=rtol, atol=atol, err_msg=what)
                    else:
                        np.testing.assert_allclose(got.output, want.output, rtol=rtol, atol=atol, err_msg=what)
                        np.testing.assert_allclose(got.output, ref.output, rtol=rtol, atol=atol, err_msg=what)
                    assert got.output is None or got.output.dtype == np.float32
                    np.testing.assert_allclose(got.h_n, ref.h_n, rtol=rtol, atol=atol, err_msg=what)
                    if spec.is_lstm:
                        np.testing.assert_allclose(got.c_n, ref.c_n, rtol=rtol, atol=atol, err_msg=what)
                    else:
                        assert got.c_n is None
        assert fused.describe()["fused_calls"] > 0, "the fused path never ran"
        assert plain.describe()["fused_calls"] is None
    finally:
        fused.close()
        plain.close()


def test_ragged_calls_take_the_general_path(cp):
    """A batch whose lengths differ is not fused (cuDNN reads ragged lengths at launch): it still runs exactly."""
    model = pool_model(MODELS["lstm-2-layers"], seed=3)
    engine = _engine(model)
    try:
        rng = np.random.default_rng(2)
        x = rng.standard_normal((3, 5, model.spec.input_size)).astype(np.float32)
        lengths = np.array([5, 2, 4])
        for _ in range(3):
            out = engine.forward(x, lengths)
        assert engine.describe()["fused_calls"] == 0
        ref = ReferenceEngine(model, dtype=np.float64).forward(x, lengths)
        np.testing.assert_allclose(out.output, ref.output, rtol=RTOL, atol=ATOL)
    finally:
        engine.close()


def test_fused_calls_queued_back_to_back_keep_their_own_inputs_and_outputs(cp):
    """Seven calls of one shape launched before any is waited for (more than a graph's input slabs, so a slab
    is written again while earlier calls may still be queued), each with its own inputs: each gets its own
    results."""
    from service.engines.cudnn.fused import SLABS

    model = pool_model(MODELS["lstm-2-layers"], seed=8)
    engine = _engine(model)
    oracle = ReferenceEngine(model, dtype=np.float64)
    rng = np.random.default_rng(12)
    try:
        xs = [rng.standard_normal((3, 4, model.spec.input_size)).astype(np.float32) for _ in range(2 * SLABS + 1)]
        _call(engine, xs[0], None, None, None, True, True)  # the shape's first call: the general path
        launched = [engine.launch(x, None, states_needed=True, last_only=True) for x in xs]
        results = []
        for one in launched:
            one.wait()
            results.append(one.finish())
        assert engine.describe()["fused_calls"] >= len(xs) - 1
        for x, got in zip(xs, results):
            ref = oracle.forward(x)
            np.testing.assert_allclose(got.last, ref.output[:, -1], rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got.h_n, ref.h_n, rtol=RTOL, atol=ATOL)
            np.testing.assert_allclose(got.c_n, ref.c_n, rtol=RTOL, atol=ATOL)
    finally:
        engine.close()


@pytest.mark.parametrize("layout", [None, "seq_major"])
def test_fused_ragged_many_to_one_batches_equal_the_reference(cp, layout):
    """Ragged many-to-one batches of a causal model (what the scheduler sends for requests of different lengths)
    run padded as one fused graph, the rows' own lengths travelling with the inputs: each row's last output
    equals the reference engine on that row alone, for batches of 1..9 rows and lengths 1..23."""
    model = pool_model(MODELS["lstm-2-layers"], seed=21)
    engine = _engine(model, layout=layout)
    plain = _engine(model, layout=layout, graph_memory_mb=0)
    oracle = ReferenceEngine(model, dtype=np.float64)
    rng = np.random.default_rng(22)
    try:
        for b in range(1, 10):
            t = int(rng.integers(2, 24))
            for rep in range(3):  # one shape: its first call runs the general path, later ones the graph
                lengths = rng.integers(1, t + 1, size=b)
                lengths[rng.integers(0, b)] = t
                x = rng.standard_normal((b, t, model.spec.input_size)).astype(np.float32)
                for row, n in enumerate(lengths):
                    x[row, n:] = 0
                got = engine.launch(x, lengths, states_needed=False, last_only=True)
                got.wait()
                got = got.finish()
                want = plain.forward(x, lengths, states_needed=False, last_only=True)
                ref = oracle.forward(x, lengths)
                what = f"b={b} t={t} lengths={lengths.tolist()}"
                np.testing.assert_allclose(got.last, ref.output[np.arange(b), lengths - 1], rtol=RTOL, atol=ATOL,
                                           err_msg=what)
                np.testing.assert_allclose(got.last, want.last, rtol=RTOL, atol=ATOL, err_msg=what)
        assert engine.describe()["fused_calls"] > 0, "the fused path never ran"
    finally:
        engine.close()
        plain.close()


@pytest.mark.parametrize("path", ["fused", "general"])
def test_single_many_to_one_requests_replay_graphs_on_the_step_grid(cp, monkeypatch, path):
    """Single many-to-one requests of a causal model (what ``max_batch_size`` 1 and light load send) run as
    graphs of the padded shape, not of their own length: every length of 20..200 (181 shapes, each otherwise
    captured only on its second call) replays one of the step grid's graphs, and each answer equals the
    reference engine and the same engine without graphs. ``general``: inputs too large to fuse (the engine's
    general path, whose graphs replay the blocks alone) pad the same way."""
    from service.engines.cudnn import fused

    if path == "general":
        monkeypatch.setattr(fused, "FUSED_MAX_BYTES", 0)
    model = pool_model(MODELS["lstm-2-layers"], seed=23)
    engine = _engine(model)
    plain = _engine(model, graph_memory_mb=0)
    oracle = ReferenceEngine(model, dtype=np.float64)
    rng = np.random.default_rng(24)
    lengths = list(range(20, 201))
    try:
        padded = {engine._shapes.padded(1, t) for t in lengths}
        before = engine.describe()["fused_calls"] if path == "fused" else engine._graphs.replays
        for rep in range(2):  # the first pass captures each grid shape on its second call, the second replays
            for t in rng.permutation(lengths):
                t = int(t)
                x = rng.standard_normal((1, t, model.spec.input_size)).astype(np.float32)
                got = engine.launch(x, np.array([t]), states_needed=False, last_only=True)
                got.wait()
                got = got.finish()
                if rep == 1 and t % 10 == 0:  # the reference is slow: a sample of lengths
                    ref = oracle.forward(x, np.array([t]))
                    want = plain.forward(x, np.array([t]), states_needed=False, last_only=True)
                    np.testing.assert_allclose(got.last, ref.output[:, t - 1], rtol=RTOL, atol=ATOL, err_msg=f"t={t}")
                    np.testing.assert_allclose(got.last, want.last, rtol=RTOL, atol=ATOL, err_msg=f"t={t}")
        # graphs of one row (the engine's load warms batches of 4 rows and up, which may leave graphs of theirs)
        if path == "fused":
            shapes = {(key[1], key[2]) for key in engine._graphs._graphs if key[0] == "fused" and key[1] == 1}
        else:
            shapes = {(key[0], key[1]) for key in engine._graphs._graphs if key[0] == 1}
        assert shapes <= padded, f"graphs of shapes off the grid: {sorted(shapes - padded)}"
        assert len(shapes) == len(padded), f"{len(shapes)} of the grid's {len(padded)} shapes captured"
        replays = engine.describe()["fused_calls"] - before if path == "fused" else engine._graphs.replays - before
        assert replays >= len(lengths), "the second pass did not replay"
    finally:
        engine.close()
        plain.close()
