"""Memory budget of an engine call (service.scheduler.memory_budget): its estimate, its limits and its errors."""
from __future__ import annotations

import asyncio
import threading
import tracemalloc

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from service import create_engine
from service.errors import TooLarge
from service.scheduler import MemoryBudget, Scheduler, SequenceWork, output_last
from service.scheduler.memory_budget import host_memory_bytes, step_bytes
from service.spec import BlockSpec
from serving_support import LSTM, build_repository, make_model, rest_client, start_server, stop_server, \
    triton_inputs, write_config

MIB = 1024 * 1024

# LSTM (I=4, H=8, 2 layers): 4 x (2*4 + 2*4*8 + (2*8 + 2*8) + 3*8) = 512 bytes a sequence step, so 1 MiB holds
# 2,048 sequence steps.
LSTM_STEPS_PER_MIB = MIB // 512


@pytest.mark.parametrize("blocks", [
    (BlockSpec("lstm", 2, 256, num_layers=2, bidirectional=True),),   # few inputs, wide bidirectional layers
    (BlockSpec("gru", 3, 128, bidirectional=True),),
    (BlockSpec("lstm", 16, 128, num_layers=2, proj_size=32),),
    (BlockSpec("rnn_tanh", 40, 96, num_layers=3),),
    (BlockSpec("gru", 5, 64, variant={"reset_before": True}), BlockSpec("gru", 64, 33, bidirectional=True)),
    (BlockSpec("rnn_relu", 3, 200, num_layers=2, bidirectional=True, variant={"clip": 3.0}),),
], ids=["lstm_bi_wide", "gru_bi", "lstm_proj", "rnn_3layer", "gru_reset_before_then_bi", "rnn_relu_bi_clip"])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "numpy"])
def test_estimate_bounds_the_reference_engines_peak_memory(blocks, native, monkeypatch):
    monkeypatch.setenv("RNNSERVE_NATIVE_CPU", native)
    model = make_model(*blocks)
    engine = create_engine(model, "cpu")
    rows, steps = 16, 300
    x = np.random.default_rng(0).standard_normal((rows, steps, model.spec.input_size)).astype(np.float32)
    lengths = np.full(rows, steps)
    lengths[::2] = steps // 2
    engine.forward(x[:1, :5], lengths[:1] * 0 + 5)  # anything allocated once per engine, before measuring
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = engine.forward(x, lengths)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    estimate = rows * steps * step_bytes(model.spec)
    assert result.output.shape == (rows, steps, model.spec.output_size)
    # an upper bound of what the engine holds, and not so loose that it refuses much that would fit (the C kernels
    # never hold the gate projections the estimate counts for cuDNN's workspace: 13x for the projected LSTM)
    assert peak <= estimate <= 16 * peak, (peak, estimate)


class _Engine:
    """The reference engine, recording each batch's (rows, padded steps)."""

    def __init__(self) -> None:
        self.inner = create_engine(make_model(*LSTM), "cpu")
        self.spec = self.inner.spec
        self.name = "recording"
        self.batches: list[tuple[int, int]] = []
        self.gate = threading.Event()

    def forward(self, x, lengths=None, h0=None, c0=None):
        self.batches.append((int(x.shape[0]), int(x.shape[1])))
        self.gate.wait(10)
        return self.inner.forward(x, lengths, h0, c0)


def _work(rows: int, steps: int, seed: int) -> SequenceWork:
    x = np.random.default_rng(seed).standard_normal((rows, steps, 4)).astype(np.float32)
    return SequenceWork(x, np.full(rows, steps, dtype=np.int64))


@pytest.mark.asyncio
async def test_scheduler_forms_batches_within_the_budget():
    engine = _Engine()
    sched = Scheduler(engine, "m", "1", max_batch_size=64, max_queue_delay_us=0, max_queue_size=100,
                      max_batch_steps=1000)
    await sched.start()
    first = asyncio.create_task(sched.submit(_work(1, 5, 0)))
    while not engine.batches:
        await asyncio.sleep(0.001)
    shapes = [(1, 400), (2, 100), (1, 390), (3, 120), (1, 30), (4, 20), (2, 300)]
    works = [_work(r, t, i + 1) for i, (r, t) in enumerate(shapes)]
    tasks = [asyncio.create_task(sched.submit(w)) for w in works]
    await asyncio.sleep(0.01)
    engine.gate.set()
    results = await asyncio.gather(first, *tasks)
    await sched.stop()
    later = engine.batches[1:]
    # all 15 rows would fit max_batch_size; the budget splits them, and every batch keeps to it
    assert len(later) > 1 and sum(rows for rows, _ in later) == sum(r for r, _ in shapes)
    assert all(rows * steps <= 1000 for rows, steps in later), later
    for work, got in zip(works, results[1:]):  # batching within the budget changes no answer
        want = engine.inner.forward(work.x, work.lengths)
        np.testing.assert_allclose(got["output"], want.output, rtol=1e-5, atol=1e-6)


def test_budget_from_setting_or_a_quarter_of_memory():
    spec = make_model(*LSTM).spec
    assert step_bytes(spec) == 512
    set_ = MemoryBudget.of(spec, 1)
    assert (set_.limit_bytes, set_.max_steps) == (MIB, LSTM_STEPS_PER_MIB)
    assert set_.fits(1, LSTM_STEPS_PER_MIB) and not set_.fits(2, LSTM_STEPS_PER_MIB // 2 + 1)
    assert MemoryBudget.of(spec, 0).limit_bytes == host_memory_bytes() // 4
    assert 0 < host_memory_bytes() <= 1 << 50

    class SmallGPU:
        def device_memory_bytes(self) -> int:
            return 64 * MIB

    assert MemoryBudget.of(spec, 0, SmallGPU()).limit_bytes == 16 * MIB
    with pytest.raises(TooLarge) as info:
        set_.check(2, 2000, "lstm")
    message = info.value.message
    assert "2 sequence(s) of 2000 steps would need about 2.0 MiB of engine memory for model 'lstm'" in message
    assert f"send at most {LSTM_STEPS_PER_MIB:,} sequence steps per request" in message
    assert "max_batch_memory_mb" in message


def _body(rows: int, steps: int) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, steps, 4], "data": [0.5] * (rows * steps * 4)}],
            "outputs": [{"name": "output_last"}]}


@pytest.mark.asyncio
async def test_rest_refuses_a_request_over_the_budget_with_413(repo):
    write_config(repo, "lstm", max_batch_memory_mb=1)
    # the server-wide default applies to gru_bi, which has no setting of its own; lstm's config.json wins
    async with rest_client(repo, max_batch_memory_mb=2) as (client, dataplane):
        over = await client.post("/v2/models/lstm/infer", json=_body(2, LSTM_STEPS_PER_MIB // 2 + 1))
        assert over.status_code == 413, over.text
        assert "over its max_batch_memory_mb of 1 MiB" in over.json()["error"]
        fits = await client.post("/v2/models/lstm/infer", json=_body(2, LSTM_STEPS_PER_MIB // 2))
        assert fits.status_code == 200, fits.text
        gru = make_model(*(BlockSpec("gru", 4, 6, bidirectional=True),)).spec
        gru_steps = 2 * MIB // step_bytes(gru)
        assert (await client.post("/v2/models/gru_bi/infer", json=_body(1, gru_steps))).status_code == 200
        r = await client.post("/v2/models/gru_bi/infer", json=_body(1, gru_steps + 1))
        assert r.status_code == 413 and "max_batch_memory_mb of 2 MiB" in r.json()["error"]
        predict = await client.post("/v1/models/lstm:predict",
                                    json={"instances": [[[0.5] * 4] * LSTM_STEPS_PER_MIB, [[0.5] * 4] * 3]})
        assert predict.status_code == 413 and "max_batch_memory_mb" in predict.json()["error"]
        assert (await client.get("/v2/health/live")).json() == {"live": True}


def test_real_server_refuses_over_the_budget_on_http_and_grpc_and_keeps_serving(tmp_path):
    """The flag, through `rnnserve serve` with front-end processes (validation runs there)."""
    repo = build_repository(tmp_path)
    proc, http_url, grpc_url = start_server(repo, "--max-batch-memory-mb", "1", "--frontends", "2")
    try:
        x = np.full((1, LSTM_STEPS_PER_MIB + 1, 4), 0.25, np.float32)
        lengths = np.array([LSTM_STEPS_PER_MIB + 1], np.int32)
        with th.InferenceServerClient(http_url.removeprefix("http://")) as client:
            with pytest.raises(InferenceServerException) as info:
                client.infer("lstm", triton_inputs(th, x, lengths))
            assert info.value.status() == "413" and "max_batch_memory_mb of 1 MiB" in info.value.message()
        with tg.InferenceServerClient(grpc_url.removeprefix("grpc://")) as client:
            with pytest.raises(InferenceServerException) as info:
                client.infer("lstm", triton_inputs(tg, x, lengths))
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "max_batch_memory_mb of 1 MiB" in info.value.message()
            ok = client.infer("lstm", triton_inputs(tg, x[:, :-1], lengths - 1))
            want = create_engine(make_model(*LSTM, seed=1), "cpu").forward(x[:, :-1]).output
            np.testing.assert_allclose(ok.as_numpy("output"), want, rtol=1e-5, atol=1e-6)
    finally:
        assert stop_server(proc) == 0


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CUDA stack
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("blocks", [
    (BlockSpec("lstm", 2, 256, num_layers=2, bidirectional=True),),
    (BlockSpec("gru", 3, 512, num_layers=3),),
    (BlockSpec("lstm", 16, 256, num_layers=2, proj_size=64),),
    (BlockSpec("lstm", 4, 256, num_layers=4, bidirectional=True),),
    (BlockSpec("rnn_tanh", 40, 96, num_layers=1, bidirectional=True), BlockSpec("lstm", 192, 128)),
], ids=["lstm_bi_wide", "gru_3layer", "lstm_proj", "lstm_bi_4layer", "rnn_bi_then_lstm"])
@pytest.mark.parametrize("last_only,algorithm", [(False, None), (True, None), (False, "standard")],
                         ids=["output", "output_last", "output_standard"])
def test_estimate_bounds_the_cudnn_engines_device_memory(blocks, last_only, algorithm):
    """What the GPU engine's call takes from CuPy's pool (buffers, workspace) stays within the estimate."""
    import cupy

    from service.engines.cudnn import CudnnEngine
    from service.engines.reference import ReferenceEngine

    from service.repository import PackedModel

    random = make_model(*blocks)
    # weights of std 1/sqrt(H), as frameworks initialise them: 600 steps of make_model's std 0.4 are chaotic at
    # H=512, and float32 rounding alone would then part the two engines
    scale = 1 / (0.4 * np.sqrt(max(b.hidden_size for b in blocks)))
    model = PackedModel(random.spec, [(w * scale).astype(np.float32) for w in random.weights])
    engine = CudnnEngine(model, graph_memory_mb=0, algorithm=algorithm)
    pool = cupy.get_default_memory_pool()
    try:
        assert engine.device_memory_bytes() == cupy.cuda.runtime.memGetInfo()[1]
        budget = MemoryBudget.of(model.spec, 0, engine)
        assert budget.limit_bytes == min(host_memory_bytes(), engine.device_memory_bytes()) // 4
        rows, steps = 64, 600
        rng = np.random.default_rng(1)
        x = rng.standard_normal((rows, steps, model.spec.input_size)).astype(np.float32)
        lengths = rng.integers(steps // 2, steps + 1, rows)
        lengths[0] = steps
        engine.forward(x[:2, :7], np.array([7, 3]))
        engine.synchronize()
        pool.free_all_blocks()
        before = pool.total_bytes()
        if last_only:
            launched = engine.launch(x, lengths, states_needed=False, last_only=True)
            launched.wait()
            got = launched.finish()
        else:
            got = engine.forward(x, lengths)
        engine.synchronize()
        taken = pool.total_bytes() - before
        estimate = rows * steps * step_bytes(model.spec)
        print(f"{model.spec.blocks[0].cell} {algorithm or 'autotuned'} algorithms {engine.algorithms_for(rows, steps)}:"
              f" taken {taken / MIB:.1f} MiB, estimate {estimate / MIB:.1f} MiB")
        assert 0 < taken <= estimate, (taken, estimate)
        # rows are independent: the float64 reference of the first eight is the check (and spares the CPU)
        want = ReferenceEngine(model, dtype=np.float64).forward(x[:8].astype(np.float64), lengths[:8])
        if last_only:
            assert got.output is None
            np.testing.assert_allclose(got.last[:8], output_last(model.spec, want.output, lengths[:8]),
                                       rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_allclose(got.output[:8], want.output, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()
