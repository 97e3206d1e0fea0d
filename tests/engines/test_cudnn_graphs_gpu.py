"""CUDA graphs of the cuDNN engine (service/engines/cudnn/graphs.py): a replayed call gives exactly
the numbers of the same call run launch by launch, and the reference engine's within the usual
tolerance; outputs a caller keeps are never overwritten by a later replay."""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.cudnn import CudnnEngine
from service.engines.cudnn.graphs import MIN_USES

from test_cudnn_gpu import check, check_all, gpu, make_torch, model_from_torch, rand, reference_run  # noqa: E402


def _pair(model, **kw):
    plain = {k: v for k, v in kw.items() if k != "bucket_graphs"}
    return CudnnEngine(model, **kw), CudnnEngine(model, graph_memory_mb=0, **plain)


@gpu
@pytest.mark.parametrize("cell,layers,bi,layout", [
    ("lstm", 2, False, "seq_major"), ("lstm", 1, True, "batch_major"), ("gru", 2, False, "batch_major"),
    ("rnn_tanh", 3, True, "seq_major"), ("lstm", 2, False, None)])
def test_replayed_calls_equal_plain_calls(cell, layers, bi, layout):
    model = model_from_torch(make_torch(cell, 7, 33, layers, bi, seed=3), max_batch_size=8)
    graphed, plain = _pair(model, layout=layout, algorithm="standard")
    try:
        rows = model.spec.state_layers
        for call in range(MIN_USES + 2):  # the first calls run plain, then the graph is captured and replayed
            x = rand((5, 17, 7), seed=call)
            h0 = rand((5, rows, 33), seed=100 + call, scale=0.5)
            c0 = rand((5, rows, 33), seed=200 + call, scale=0.5) if cell == "lstm" else None
            a, b = graphed.forward(x, None, h0, c0), plain.forward(x, None, h0, c0)
            np.testing.assert_array_equal(a.output, b.output)
            np.testing.assert_array_equal(a.h_n, b.h_n)
            if cell == "lstm":
                np.testing.assert_array_equal(a.c_n, b.c_n)
            check_all(a, reference_run(model, x, None, h0, c0))
        info = graphed.describe()["cuda_graphs"]
        assert info["captures"] == 1 and info["replays"] >= 2 and info["failed_shapes"] == 0
    finally:
        graphed.close()
        plain.close()


@gpu
@pytest.mark.parametrize("algorithm", ["standard", "persist_static", "persist_dynamic"])
def test_every_algorithm_replays(algorithm):
    model = model_from_torch(make_torch("gru", 16, 64, 2, False, seed=5), max_batch_size=4)
    graphed, plain = _pair(model, algorithm=algorithm)
    try:
        for call in range(MIN_USES + 1):
            x = rand((4, 12, 16), seed=call)
            np.testing.assert_array_equal(graphed.forward(x).output, plain.forward(x).output)
        assert graphed.describe()["cuda_graphs"]["replays"] >= 1
    finally:
        graphed.close()
        plain.close()


@gpu
def test_device_outputs_survive_later_replays():
    import cupy as cp

    model = model_from_torch(make_torch("lstm", 6, 20, 1, False, seed=7), max_batch_size=4)
    eng = CudnnEngine(model)
    try:
        xs = [rand((3, 9, 6), seed=s) for s in range(MIN_USES + 3)]
        kept = [eng.forward(cp.asarray(x), output_device="device").output for x in xs]
        eng.synchronize()
        for x, y in zip(xs, kept):
            np.testing.assert_allclose(cp.asnumpy(y), reference_run(model, x).output, rtol=1e-5, atol=1e-5)
        assert eng.describe()["cuda_graphs"]["replays"] >= 1
    finally:
        eng.close()


@gpu
def test_stream_chunks_replay_with_their_states():
    # forward_blocks with carried states: the path stateful streams take, chunk after chunk
    model = model_from_torch(make_torch("lstm", 5, 24, 2, False, seed=9), max_batch_size=4)
    graphed, plain = _pair(model, bucket_graphs=False)  # bit for bit: the graph at the call's own shape
    try:
        x = rand((3, 8 * (MIN_USES + 2), 5), seed=11)
        sg = sp = None
        for k in range(MIN_USES + 2):
            chunk = x[:, 8 * k:8 * (k + 1)]
            yg, sg = graphed.forward_blocks(chunk, None, sg)
            yp, sp = plain.forward_blocks(chunk, None, sp)
            np.testing.assert_array_equal(yg, yp)
        whole = reference_run(model, x)
        np.testing.assert_allclose(yg, whole.output[:, -8:], rtol=1e-5, atol=1e-5)
        assert graphed.describe()["cuda_graphs"]["replays"] >= 1
    finally:
        graphed.close()
        plain.close()


@gpu
def test_budget_evicts_and_zero_turns_graphs_off():
    # graphs of a few MB each (their input, output and state buffers; the workspace is shared)
    model = model_from_torch(make_torch("gru", 64, 256, 1, False, seed=13), max_batch_size=64)
    shapes = [(64, t) for t in (40, 41, 42, 43, 44, 45)]

    def run_all(eng):
        for n, t in shapes:
            x = rand((n, t, 64), seed=t)
            for _ in range(MIN_USES):
                check_all(eng.forward(x), reference_run(model, x))
        return eng.describe()["cuda_graphs"]

    off, probe = CudnnEngine(model, graph_memory_mb=0), CudnnEngine(model)
    try:
        assert off.describe()["cuda_graphs"] is None
        run_all(off)
        whole = run_all(probe)
        # a graph needing more workspace than the shared one grows it and drops the graphs captured before
        assert whole["captures"] == len(shapes) and whole["failed_shapes"] == 0
        assert whole["graphs"] == whole["captures"] - whole["evictions"] >= 1
    finally:
        off.close()
        probe.close()
    per_graph = (whole["bytes"] - whole["workspace_bytes"]) / whole["graphs"]
    assert per_graph > 1 << 20
    budget_mb = -(-int(whole["workspace_bytes"] + 2.5 * per_graph) // (1 << 20))  # about two graphs
    small = CudnnEngine(model, graph_memory_mb=budget_mb)
    try:
        info = run_all(small)
        assert info["bytes"] <= info["budget_bytes"] == budget_mb << 20
        assert 1 <= info["graphs"] < len(shapes) and info["graphs"] < info["captures"]  # least recently used dropped
        assert info["evictions"] == info["captures"] - info["graphs"]
    finally:
        small.close()


@gpu
def test_graphs_of_many_shapes_share_one_workspace():
    """Interleaved replays of graphs of several batch sizes and lengths (one shared cuDNN workspace,
    grown as larger shapes come) equal plain calls, exactly, every round."""
    model = model_from_torch(make_torch("lstm", 7, 33, 2, False, seed=5), max_batch_size=64)
    graphed, plain = _pair(model, algorithm="standard")
    shapes = [(1, 10), (64, 10), (5, 17), (33, 10), (2, 40)]
    try:
        for rnd in range(MIN_USES + 4):
            for n, t in (shapes if rnd % 2 == 0 else shapes[::-1]):
                x = rand((n, t, 7), seed=10 * n + t + rnd)
                a, b = graphed.forward(x), plain.forward(x)
                np.testing.assert_array_equal(a.output, b.output)
                np.testing.assert_array_equal(a.h_n, b.h_n)
                np.testing.assert_array_equal(a.c_n, b.c_n)
        info = graphed.describe()["cuda_graphs"]
        assert info["graphs"] >= 2 and info["replays"] >= len(shapes) and info["failed_shapes"] == 0
        assert info["bytes"] <= info["budget_bytes"]
    finally:
        graphed.close()
        plain.close()


@gpu
@pytest.mark.parametrize("layout", ["batch_major", "seq_major"])
def test_ragged_padded_calls_replay_graphs_of_bucketed_shapes(layout):
    """Many-to-one and full-output calls of ragged batches whose exact shapes never repeat run as
    replays of a few graphs at bucketed shapes (shape_buckets.py), with the numbers of plain calls."""
    from service.scheduler.batching import output_last

    model = model_from_torch(make_torch("lstm", 6, 24, 2, False, seed=21), max_batch_size=16)
    graphed, plain = _pair(model, layout=layout)
    rng = np.random.default_rng(4)
    try:
        shapes = set()
        for call in range(24):
            n = int(rng.integers(9, 17))
            lengths = rng.integers(20, 45, n)
            lengths[0] = 44 - call % 3  # longest 42..44: one step bucket, never the same (n, t) pair twice in a row
            shapes.add((n, int(lengths.max())))
            x = rand((n, int(lengths.max()), 6), seed=call)
            want = reference_run(model, x, lengths)
            last = graphed.launch(x, lengths, states_needed=False, last_only=True)
            last.wait()
            got_last = last.finish().last
            check(got_last, output_last(model.spec, want.output, lengths), what="output_last")
            plain_last = plain.launch(x, lengths, states_needed=False, last_only=True)
            plain_last.wait()
            np.testing.assert_allclose(got_last, plain_last.finish().last, rtol=1e-5, atol=1e-6)
            full = graphed.forward(x, lengths, states_needed=False)
            check(full.output, want.output, what="output")  # zero past each length, as the reference
        info = graphed.describe()["cuda_graphs"]
        assert info["replays"] >= 24 and info["failed_shapes"] == 0
        assert info["captures"] < len(shapes) // 2, (info, len(shapes))
    finally:
        graphed.close()
        plain.close()


@gpu
def test_launch_bound_ragged_batches_replay_graphs():
    """A 2-layer H=256 LSTM whose larger buckets run STANDARD (per-step launches: ~5 ms of host time for a
    ragged batch of 200 steps on an H100, ~1.5 ms of GPU work) runs ragged many-to-one batches padded at
    bucketed shapes, so that they replay graphs, with the numbers of plain calls. Before the autotuner had
    host lines, such batches ran ragged and uncaptured: 11 replays in 240 calls (H100)."""
    from service.scheduler.batching import output_last

    model = model_from_torch(make_torch("lstm", 40, 256, 2, False, seed=31), max_batch_size=32)
    graphed, plain = _pair(model)
    rng = np.random.default_rng(8)
    try:
        calls = 48
        for call in range(calls):
            n = int(rng.integers(8, 33))
            lengths = rng.integers(20, 201, n)
            x = rand((n, int(lengths.max()), 40), seed=call)
            got = graphed.launch(x, lengths, states_needed=False, last_only=True)
            got.wait()
            got_last = got.finish().last
            if call % 8 == 0:
                check(got_last, output_last(model.spec, reference_run(model, x, lengths).output, lengths),
                      what="output_last")
            want = plain.launch(x, lengths, states_needed=False, last_only=True)
            want.wait()
            np.testing.assert_allclose(got_last, want.finish().last, rtol=1e-5, atol=1e-6)
        info = graphed.describe()["cuda_graphs"]
        assert info["failed_shapes"] == 0 and info["replays"] >= calls // 2, (info, graphed.describe()["algorithms"])
    finally:
        graphed.close()
        plain.close()


@gpu
def test_equal_length_calls_with_states_replay_graphs_at_their_bucket_rows():
    """Stream-like calls (equal lengths, initial and final states) of changing batch sizes replay a graph
    per batch bucket: the caller's rows and states go into the graph's first rows and come back out."""
    model = model_from_torch(make_torch("lstm", 5, 24, 2, False, seed=23), max_batch_size=16)
    graphed, plain = _pair(model)
    rows = model.spec.state_layers
    try:
        sizes = [9, 11, 13, 15, 16, 10, 12, 14] * 2
        for call, n in enumerate(sizes):
            x = rand((n, 10, 5), seed=call)
            h0, c0 = rand((n, rows, 24), seed=50 + call, scale=0.5), rand((n, rows, 24), seed=90 + call, scale=0.5)
            a, b = graphed.forward(x, None, h0, c0), plain.forward(x, None, h0, c0)
            for got, want in ((a.output, b.output), (a.h_n, b.h_n), (a.c_n, b.c_n)):
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            check_all(a, reference_run(model, x, None, h0, c0))
        info = graphed.describe()["cuda_graphs"]
        assert info["replays"] >= len(sizes) - 4 and info["captures"] <= 2 and info["failed_shapes"] == 0, info
    finally:
        graphed.close()
        plain.close()


@gpu
def test_a_capture_with_an_algorithm_the_runner_rejects_runs_uncaptured():
    """PERSIST_DYNAMIC is built at load for the batch buckets only; a graph asked for another batch size
    with it gives up capturing (the caller then runs the call itself, falling back to STANDARD)."""
    import cupy as cp

    from service.engines.cudnn import library as L

    model = model_from_torch(make_torch("lstm", 5, 32, 1, False, seed=3), max_batch_size=8)
    eng = CudnnEngine(model)
    try:
        n, t = 3, 9
        x = cp.asarray(rand((n, t, 5)))
        lens_key, lens_host, lens_dev = eng._uniform(n, t)
        hys, cys = eng._new_states(n)[2:]
        for _ in range(MIN_USES + 1):
            assert eng._graphs.run(x, n, t, lens_key, lens_host, lens_dev, None, (L.ALGO_PERSIST_DYNAMIC,),
                                   False, hys, cys) is None
        assert eng.describe()["cuda_graphs"]["failed_shapes"] == 1
        check_all(eng.forward(rand((n, t, 5), seed=1)), reference_run(model, rand((n, t, 5), seed=1)))
    finally:
        eng.close()
