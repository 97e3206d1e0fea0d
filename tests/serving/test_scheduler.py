"""Scheduler: batching policy, backpressure, deadlines, failing batches, drain; and merge/split."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import numpy as np
import pytest

from service import create_engine
from service.errors import DeadlineExceeded, RNNServeError, Unavailable
from service.scheduler import Scheduler, SequenceWork, merge, output_last, split
from serving_support import GRU_BI, LSTM, make_model

pytestmark = pytest.mark.asyncio


class GatedEngine:
    """Wraps the reference engine; records each batch's lengths; can hold batches until released."""

    def __init__(self, blocks=LSTM) -> None:
        self.inner = create_engine(make_model(*blocks), "cpu")
        self.spec = self.inner.spec
        self.name = "gated"
        self.batches: list[list[int]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, x, lengths=None, h0=None, c0=None):
        self.batches.append([int(n) for n in lengths])
        self.entered.set()
        self.gate.wait(10)
        if np.any(x == 999):
            raise ValueError("poisoned input")
        return self.inner.forward(x, lengths, h0, c0)


def _work(steps: int, batch: int = 1, seed: int = 0, fill: float | None = None) -> SequenceWork:
    x = np.random.default_rng(seed).standard_normal((batch, steps, 4)).astype(np.float32)
    if fill is not None:
        x[:] = fill
    return SequenceWork(x, np.full(batch, steps, dtype=np.int64))


async def _hold(engine: GatedEngine, sched: Scheduler) -> asyncio.Task:
    """Start a batch that stays in the engine until ``engine.gate`` is set."""
    engine.gate.clear()
    engine.entered.clear()
    task = asyncio.create_task(sched.submit(_work(3)))
    await asyncio.to_thread(engine.entered.wait, 5)
    return task


async def _scheduler(engine, **kw) -> Scheduler:
    opts = dict(max_batch_size=4, max_queue_delay_us=1000, max_queue_size=100)
    opts.update(kw)
    sched = Scheduler(engine, "m", "1", **opts)
    await sched.start()
    return sched


async def test_groups_waiting_requests_by_length():
    engine = GatedEngine()
    sched = await _scheduler(engine)
    blocker = await _hold(engine, sched)
    lengths = [10, 200, 12, 190, 11, 205, 9, 195]
    tasks = [asyncio.create_task(sched.submit(_work(n, seed=n))) for n in lengths]
    await asyncio.sleep(0.01)
    assert sched.depth == 8
    engine.gate.set()
    await asyncio.gather(blocker, *tasks)
    await sched.stop()
    assert [sorted(b) for b in engine.batches[1:]] == [[9, 10, 11, 12], [190, 195, 200, 205]]


async def test_batching_does_not_change_results():
    engine = GatedEngine(GRU_BI)
    sched = await _scheduler(engine, max_batch_size=64, max_queue_delay_us=20_000)
    works = [_work(n, batch=1 + n % 3, seed=n) for n in range(1, 30)]
    results = await asyncio.gather(*(sched.submit(w) for w in works))
    await sched.stop()
    assert max(len(b) for b in engine.batches) > 10
    for w, res in zip(works, results):
        alone = engine.inner.forward(w.x, w.lengths)
        np.testing.assert_allclose(res["output"], alone.output, atol=1e-5)
        np.testing.assert_allclose(res["h_n"], alone.h_n, atol=1e-5)
        np.testing.assert_allclose(res["output_last"], output_last(engine.spec, alone.output, w.lengths), atol=1e-5)


async def test_queue_full_is_unavailable_at_once():
    engine = GatedEngine()
    sched = await _scheduler(engine, max_queue_size=2)
    blocker = await _hold(engine, sched)
    waiting = [asyncio.create_task(sched.submit(_work(3))) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match=r"overloaded: 2 requests are waiting \(max_queue_size 2\)"):
        await sched.submit(_work(3))
    engine.gate.set()
    await asyncio.gather(blocker, *waiting)
    await sched.stop()


async def test_deadline_in_queue():
    engine = GatedEngine()
    sched = await _scheduler(engine)
    blocker = await _hold(engine, sched)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="timeout ran out after it waited"):
        await sched.submit(_work(7), deadline=time.monotonic() + 0.02)
    assert time.monotonic() - start < 1.0
    with pytest.raises(DeadlineExceeded):
        await sched.submit(_work(7), deadline=time.monotonic() - 1)
    engine.gate.set()
    await blocker
    await sched.stop()
    assert all(7 not in b for b in engine.batches)  # expired requests never run


async def test_failing_batch_fails_only_its_requests():
    engine = GatedEngine()
    sched = await _scheduler(engine, max_queue_delay_us=0)
    with pytest.raises(RNNServeError, match=r"model 'm' version 1 failed on a batch of 1 sequences: ValueError: poisoned"):
        await sched.submit(_work(3, fill=999))
    res = await sched.submit(_work(3))
    assert res["output"].shape == (1, 3, 8)
    await sched.stop()


async def test_stop_drains_or_refuses():
    engine = GatedEngine()
    sched = await _scheduler(engine)
    blocker = await _hold(engine, sched)
    waiting = [asyncio.create_task(sched.submit(_work(5))) for _ in range(3)]
    await asyncio.sleep(0)
    stopping = asyncio.create_task(sched.stop(drain=True))
    await asyncio.sleep(0.01)
    with pytest.raises(Unavailable, match="not accepting requests"):
        await sched.submit(_work(3))
    engine.gate.set()
    await stopping
    await blocker
    assert all(r["output"].shape == (1, 5, 8) for r in await asyncio.gather(*waiting))

    engine2 = GatedEngine()
    sched2 = await _scheduler(engine2)
    blocker2 = await _hold(engine2, sched2)
    queued = asyncio.create_task(sched2.submit(_work(5)))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(sched2.stop(drain=False))
    await asyncio.sleep(0.01)
    engine2.gate.set()
    await stopping
    await blocker2
    with pytest.raises(Unavailable, match="was unloaded"):
        await queued


async def test_oversized_request_runs_alone():
    engine = GatedEngine()
    sched = await _scheduler(engine, max_batch_size=2)
    res = await sched.submit(_work(4, batch=5))
    assert res["output"].shape == (5, 4, 8) and engine.batches == [[4] * 5]
    await sched.stop()


async def test_merge_and_split_trim_client_padding():
    engine = GatedEngine()
    a = SequenceWork(np.ones((2, 10, 4), np.float32), np.array([3, 2]))
    b = SequenceWork(np.ones((1, 2, 4), np.float32), np.array([2]),
                     h0=np.full((1, 2, 8), 0.5, np.float32), outputs=frozenset({"output", "h_n"}))
    batch = merge([a, b])
    assert batch.x.shape == (3, 3, 4) and batch.lengths.tolist() == [3, 2, 2]
    assert batch.computed_steps == 9 and batch.useful_steps == 7
    assert np.all(batch.h0[:2] == 0) and np.all(batch.h0[2] == 0.5)
    out = engine.inner.forward(batch.x, batch.lengths, batch.h0, batch.c0)
    ra, rb = split(engine.spec, batch, out.output, out.h_n, out.c_n, [a, b])
    assert ra["output"].shape == (2, 10, 8) and np.all(ra["output"][:, 3:] == 0)
    assert set(rb) == {"output", "h_n"} and rb["output"].shape == (1, 2, 8)
    np.testing.assert_allclose(ra["output_last"][1], out.output[1, 1], atol=0)


class StatelessEngine(GatedEngine):
    """An engine that may skip final states: records what each batch was asked for."""

    skips_states = True

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[bool] = []

    def forward(self, x, lengths=None, h0=None, c0=None, states_needed=True):
        self.asked.append(states_needed)
        out = self.inner.forward(x, lengths, h0, c0)
        if not states_needed:
            out.h_n = out.c_n = None
        return out


async def test_final_states_are_asked_for_only_when_a_request_wants_them():
    engine = StatelessEngine()
    sched = await _scheduler(engine, max_queue_delay_us=0)
    last_only = SequenceWork(_work(5).x, np.array([3]), outputs=frozenset({"output_last"}))
    res = await sched.submit(last_only)
    assert engine.asked == [False] and set(res) == {"output_last"}
    want = engine.inner.forward(last_only.x, last_only.lengths)
    np.testing.assert_allclose(res["output_last"], want.output[:, 2], rtol=1e-6)
    with_states = SequenceWork(_work(5).x, np.array([5]), outputs=frozenset({"output_last", "h_n"}))
    res = await sched.submit(with_states)
    assert engine.asked == [False, True] and res["h_n"].shape == (1, 2, 8)
    await sched.stop()


class LastOnlyEngine(GatedEngine):
    """An engine that computes many-to-one outputs itself (``computes_last``), as the cuDNN engine does on the GPU."""

    computes_last = True

    def __init__(self, blocks=LSTM) -> None:
        super().__init__(blocks)
        self.asked: list[bool] = []

    def forward(self, x, lengths=None, h0=None, c0=None, last_only=False):
        self.asked.append(last_only)
        out = self.inner.forward(x, lengths, h0, c0)
        if last_only:
            lens = lengths if lengths is not None else np.full(x.shape[0], x.shape[1])
            out.last = output_last(self.spec, out.output, lens) + 0.0
            out.output = None
        return out


@pytest.mark.parametrize("blocks", [LSTM, GRU_BI])
async def test_many_to_one_batches_ask_the_engine_for_last_steps_only(blocks):
    engine = LastOnlyEngine(blocks)
    sched = await _scheduler(engine, max_queue_delay_us=20_000)
    parts = [SequenceWork(_work(t, seed=t).x, np.array([n]), outputs=frozenset({"output_last", "h_n"}))
             for t, n in ((5, 3), (7, 7), (2, 1))]
    got = await asyncio.gather(*(sched.submit(p) for p in parts))
    assert engine.asked == [True]
    for p, res in zip(parts, got):
        want = engine.inner.forward(p.x, p.lengths)
        assert set(res) == {"output_last", "h_n"}
        np.testing.assert_allclose(res["output_last"], output_last(engine.spec, want.output, p.lengths)[0:1],
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(res["h_n"], want.h_n, rtol=1e-6, atol=1e-7)
    full = SequenceWork(_work(4).x, np.array([4]), outputs=frozenset({"output", "output_last"}))
    res = await sched.submit(full)
    assert engine.asked == [True, False] and res["output"].shape == (1, 4, engine.spec.output_size)
    await sched.stop()


class _HostEvent:
    """Stands in for a CUDA event: set when the (CPU) work is done."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.waited_on: str | None = None
        self.queried = 0

    @property
    def done(self) -> bool:
        self.queried += 1
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread().name
        assert self.finished.wait(10)


class LaunchingEngine(LastOnlyEngine):
    """Queues work like the cuDNN engine (``launches``): computes on its own thread, waited on elsewhere."""

    launches = True
    skips_states = True

    def __init__(self, blocks=LSTM, fail_wait: bool = False) -> None:
        super().__init__(blocks)
        self.fail_wait = fail_wait
        self.launched_on: list[str] = []
        self.events: list[_HostEvent] = []

    def forward(self, x, lengths=None, h0=None, c0=None, states_needed=True, last_only=False):
        return super().forward(x, lengths, h0, c0, last_only=last_only)

    def launch(self, x, lengths=None, h0=None, c0=None, states_needed=True, last_only=False, pooled=None):
        from service.engines.base import Launched

        if np.any(x == 999):
            raise ValueError("poisoned input")
        self.launched_on.append(threading.current_thread().name)
        event = _HostEvent()
        self.events.append(event)
        box = {}

        def work():
            if pooled is not None:
                box["out"] = self.inner.forward_pooled(x, lengths, h0, c0, pooled, states_needed)
            else:
                box["out"] = self.forward(x, lengths, h0, c0, states_needed, last_only)
            if self.fail_wait:
                box["out"] = None
            event.finished.set()

        threading.Thread(target=work).start()

        def finish():
            if box["out"] is None:
                raise RuntimeError("device failure")
            return box["out"]

        return Launched(event, finish)



async def test_stream_chunks_on_a_launching_engine_carry_their_state():
    engine = LaunchingEngine()
    sched = await _scheduler(engine, max_queue_delay_us=0)
    pool = engine.inner.state_pool(4)
    slot = pool.acquire()
    x = _work(9, seed=4).x
    outs = []
    for a, b in ((0, 4), (4, 5), (5, 9)):
        chunk = SequenceWork(np.ascontiguousarray(x[:, a:b]), np.array([b - a]), pool=pool, slot=slot, resume=a > 0,
                             outputs=frozenset({"output", "h_n", "c_n"}))
        res = await sched.submit(chunk)
        outs.append(res["output"])
    want = engine.inner.forward(x)
    assert len(engine.launched_on) == 3 and set(engine.launched_on) == {threading.current_thread().name}
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want.output, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(res["h_n"], want.h_n, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(res["c_n"], want.c_n, rtol=1e-6, atol=1e-7)
    await sched.stop()


async def test_a_launching_engine_is_launched_from_the_loop_and_waited_on_elsewhere():
    engine = LaunchingEngine(GRU_BI)
    sched = await _scheduler(engine, max_queue_delay_us=20_000)
    parts = [SequenceWork(_work(t, seed=t).x, np.array([n]), outputs=frozenset(outs))
             for t, n, outs in ((5, 3, {"output_last"}), (7, 7, {"output_last"}), (4, 2, {"output", "h_n"}))]
    got = await asyncio.gather(*(sched.submit(p) for p in parts))
    assert engine.launched_on == [threading.current_thread().name]  # one batch, queued from the event loop
    assert engine.events[0].waited_on != threading.current_thread().name
    assert engine.asked == [False]  # one part wants the whole output
    for p, res in zip(parts, got):
        want = engine.inner.forward(p.x, p.lengths)
        if "output" in p.outputs:
            np.testing.assert_allclose(res["output"], want.output, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(res["h_n"], want.h_n, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_allclose(res["output_last"], output_last(engine.spec, want.output, p.lengths),
                                       rtol=1e-6, atol=1e-7)
    await sched.stop()


@pytest.mark.parametrize("fail_wait", [False, True])
async def test_a_launched_batch_that_fails_fails_only_its_requests(fail_wait):
    engine = LaunchingEngine(fail_wait=fail_wait)
    sched = await _scheduler(engine, max_queue_delay_us=0)
    bad = _work(3, fill=999.0) if not fail_wait else _work(3)
    with pytest.raises(RNNServeError, match="poisoned input" if not fail_wait else "device failure"):
        await sched.submit(bad)
    engine.fail_wait = False
    res = await sched.submit(_work(4, seed=2))
    np.testing.assert_allclose(res["output"], engine.inner.forward(_work(4, seed=2).x).output, rtol=1e-6, atol=1e-7)
    await sched.stop()


class PipelinedEngine(GatedEngine):
    concurrent_batches = 2


@pytest.mark.parametrize("engine_cls,queued_while_held", [(GatedEngine, 3), (PipelinedEngine, 0)])
async def test_a_pipelined_engine_gets_its_next_batch_while_one_runs(engine_cls, queued_while_held):
    engine = engine_cls()
    sched = await _scheduler(engine, max_queue_delay_us=0)
    blocker = await _hold(engine, sched)
    works = [_work(n, seed=n) for n in (4, 6, 5)]
    tasks = [asyncio.create_task(sched.submit(w)) for w in works]
    await asyncio.sleep(0.05)
    # one batch is in the engine; a pipelined scheduler has already taken the next one off the queue
    assert sched.depth == queued_while_held
    assert len(engine.batches) == 1
    engine.gate.set()
    results = await asyncio.gather(blocker, *tasks)
    assert engine.batches[1] == [4, 6, 5]
    for w, res in zip(works, results[1:]):
        want = engine.inner.forward(w.x, w.lengths)
        np.testing.assert_allclose(res["output"], want.output, rtol=1e-5, atol=1e-6)
    await sched.stop()


class StreamEngine(LaunchingEngine):
    """A launching engine with one in-order "device" (like a CUDA stream) taking ``step_s`` per step of a batch."""

    concurrent_batches = 2

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.sizes: list[int] = []
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._device, daemon=True).start()

    def _device(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def launch(self, x, lengths=None, h0=None, c0=None, states_needed=True, last_only=False):
        from service.engines.base import Launched

        self.sizes.append(int(x.shape[0]))
        event, box = _HostEvent(), {}
        self.events.append(event)

        def work():
            time.sleep(self.step_s * x.shape[1])
            box["out"] = self.forward(x, lengths, h0, c0, states_needed, last_only)
            event.finished.set()

        self._queue.put(work)
        return Launched(event, lambda: box["out"])

    def close(self) -> None:
        self._queue.put(None)


async def test_the_next_batch_is_formed_just_before_the_device_is_free():
    """Requests that arrive while a batch runs join one next batch, not one launched behind it at once."""
    engine = StreamEngine(step_s=0.005)
    sched = await _scheduler(engine, max_batch_size=8, max_queue_delay_us=0)
    for seed in range(4):  # the scheduler learns the device's time per step
        await sched.submit(_work(10, seed=seed))
    first = asyncio.create_task(sched.submit(_work(10, seed=10)))  # ~50 ms on the device
    later = []
    for delay in (0.005, 0.015, 0.015):
        await asyncio.sleep(delay)
        later.append(asyncio.create_task(sched.submit(_work(10, seed=len(later) + 11))))
    results = await asyncio.gather(first, *later)
    assert engine.sizes[4:] == [1, 3]  # launching at once would have given [1, 1, 2]
    for k, res in enumerate(results):
        want = engine.inner.forward(_work(10, seed=10 + k).x)
        np.testing.assert_allclose(res["output"], want.output, rtol=1e-6, atol=1e-7)
    # a full batch does not wait for the device
    first = asyncio.create_task(sched.submit(_work(10, seed=20)))
    await asyncio.sleep(0.005)
    full = [asyncio.create_task(sched.submit(_work(10, seed=21))) for _ in range(8)]
    for _ in range(30):  # the first batch runs ~50 ms; a busy host may wake this loop late
        if engine.sizes[-1] == 8:
            break
        await asyncio.sleep(0.001)
    assert engine.sizes[-1] == 8 and not first.done()  # launched while the first still runs
    await asyncio.gather(first, *full)
    await sched.stop()
    engine.close()


async def test_a_lone_short_batch_is_polled_from_the_loop_and_a_long_one_waited_on_a_worker_thread():
    # 20 ms on the "device" for 10 steps: long enough that a loop blocked in the wait shows, next to a busy CI
    # host's late wake-ups (5 ms seen under two busy-looping processes on 2 cores)
    engine = StreamEngine(step_s=0.002)
    sched = await _scheduler(engine, max_batch_size=8, max_queue_delay_us=0)
    sched.inline_wait_s = 0.1  # this machine's thread wake-ups (a busy CI host's), not a GPU's: wider than the server's
    for seed in range(4):  # the device clock learns the time per step
        await sched.submit(_work(10, seed=seed))
    main = threading.current_thread().name
    started = time.perf_counter()
    ticks = []

    async def ticker(seconds):
        while time.perf_counter() - started < seconds:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.0005)

    res, _ = await asyncio.gather(sched.submit(_work(10, seed=5)), ticker(0.03))
    lone = engine.events[-1]
    assert lone.waited_on is None and lone.queried >= 1  # polled from the loop, never handed to a thread
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.015  # and the loop kept running meanwhile
    np.testing.assert_allclose(res["output"], engine.inner.forward(_work(10, seed=5).x).output, rtol=1e-6, atol=1e-7)
    # the device turns slow (another model's work, say): the loop polls for a bounded time, then hands the wait over
    engine.step_s = 0.04  # 400 ms, predicted ~20 ms: polled until ~120 ms
    started, ticks = time.perf_counter(), []
    res, _ = await asyncio.gather(sched.submit(_work(10, seed=6)), ticker(0.42))
    assert engine.events[-1].waited_on not in (None, main)
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.05
    np.testing.assert_allclose(res["output"], engine.inner.forward(_work(10, seed=6).x).output, rtol=1e-6, atol=1e-7)
    # a batch with another behind it is not polled, even one predicted done within the bound: that is load, under
    # which a loop iteration is long (its delay would pass for device time in the clock's learning)
    engine.step_s, sched.inline_wait_s = 0.00001, 1.0
    held = len(engine.events)
    works = [_work(10, seed=8 + k) for k in range(9)]  # one more than a batch holds
    results = await asyncio.gather(*(sched.submit(w) for w in works))
    assert engine.sizes[-2:] == [8, 1] and engine.events[held].waited_on not in (None, main)
    for w, res in zip(works, results):
        np.testing.assert_allclose(res["output"], engine.inner.forward(w.x).output, rtol=1e-6, atol=1e-7)
    await sched.stop()
    engine.close()


class SlowLaunchEngine(StreamEngine):
    """Launching costs the host more than the device takes (host-bound, as small models on a GPU)."""

    launch_s = 0.06  # far above the device time, so that a loaded CI host's late wake-ups cannot hide the ratio

    def launch(self, *args, **kwargs):
        end = time.perf_counter() + self.launch_s
        while time.perf_counter() < end:
            pass
        return super().launch(*args, **kwargs)


async def test_a_host_bound_engine_forms_the_next_batch_when_the_last_ends():
    """Requests that arrive while a batch runs on a host-bound engine wait for it to end and go in one batch,
    instead of the first of them being launched alone at once (each launch costs the host a whole launch)."""
    engine = SlowLaunchEngine(step_s=0.002)  # ~20 ms on the device, 60 ms to launch
    sched = await _scheduler(engine, max_batch_size=64, max_queue_delay_us=0)
    for seed in range(8):  # the clock learns from the batches; a late wake-up on a busy host only delays that
        await sched.submit(_work(10, seed=seed))
        if seed >= 3 and sched._clock.host_bound():
            break
    assert sched._clock.host_bound()
    warmed = len(engine.sizes)
    works = [_work(10, seed=40 + k) for k in range(4)]
    tasks = [asyncio.create_task(sched.submit(works[0]))]
    await asyncio.sleep(0.001)  # returns once the launch (which holds the loop) has returned
    tasks.append(asyncio.create_task(sched.submit(works[1])))  # while the first batch runs on the device
    await asyncio.sleep(0.005)
    tasks += [asyncio.create_task(sched.submit(w)) for w in works[2:]]
    results = await asyncio.gather(*tasks)
    assert engine.sizes[warmed:] == [1, 3]  # forming at once after the launch gives [1, 1, 2]
    for w, res in zip(works, results):
        np.testing.assert_allclose(res["output"], engine.inner.forward(w.x).output, rtol=1e-6, atol=1e-7)
    await sched.stop()
    engine.close()


async def test_merge_into_a_lent_buffer_zeroes_the_padding_and_equals_a_fresh_merge():
    rng = np.random.default_rng(3)
    parts = [SequenceWork(rng.standard_normal((2, 7, 4)).astype(np.float32), np.array([7, 3])),
             SequenceWork(rng.standard_normal((1, 2, 4)).astype(np.float32), np.array([2])),
             SequenceWork(rng.standard_normal((3, 9, 4)).astype(np.float32), np.array([5, 4, 1]))]
    lent = []

    def buffer(shape):
        lent.append(np.full(shape, np.nan, np.float32))  # uninitialized memory: anything may be there
        return lent[-1]

    fresh, into = merge(parts), merge(parts, buffer)
    assert into.x is lent[0] and into.x.shape == fresh.x.shape == (6, 7, 4)
    np.testing.assert_array_equal(into.x, fresh.x)
    np.testing.assert_array_equal(into.lengths, fresh.lengths)
    assert merge(parts, lambda shape: None).x.shape == fresh.x.shape  # an engine without buffers


async def test_observe_many_equals_observing_one_by_one():
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.exposition import generate_latest

    from service.metrics import observe_many

    def exposition(record):
        reg = CollectorRegistry()
        h = Histogram("h_seconds", "h", ["model"], buckets=(0.001, 0.01, 0.1), registry=reg)
        record(h.labels(model="m"))
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(generate_latest(reg).decode())
                for s in f.samples if not s.name.endswith("_created")]

    values = [(0.0005, 3), (0.02, 1), (0.05, 4), (7.0, 2)]
    many = exposition(lambda h: [observe_many(h, v, n) for v, n in values])
    one_by_one = exposition(lambda h: [h.observe(v) for v, n in values for _ in range(n)])
    assert [m[:2] for m in many] == [o[:2] for o in one_by_one]
    assert [m[2] for m in many] == pytest.approx([o[2] for o in one_by_one], rel=1e-12)  # the sum's rounding
    assert ("h_seconds_count", {"model": "m"}, 10.0) in many


async def test_a_reloaded_copy_draining_leaves_the_new_copy_s_queue_depth_alone():
    # old and new copy of one version share the (model, version) series: during a reload the old copy drains
    # while the new one serves, and each batch the old copy took used to overwrite the new copy's queue depth
    from service.metrics import ServerMetrics

    metrics = ServerMetrics()
    depth = metrics.queue_depth.labels(model="m", version="1")
    old_engine, new_engine = GatedEngine(), GatedEngine()
    old = await _scheduler(old_engine, max_batch_size=1, max_queue_delay_us=0, metrics=metrics)
    old_blocker = await _hold(old_engine, old)
    old_waiting = [asyncio.create_task(old.submit(_work(3))) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert depth._value.get() == 2
    new = await _scheduler(new_engine, max_batch_size=1, max_queue_delay_us=0, metrics=metrics)
    old.release_gauges()  # what the registry does as the reload retires the old copy (test_registry covers that)
    stopping = asyncio.create_task(old.stop(drain=True))
    new_blocker = await _hold(new_engine, new)
    new_waiting = [asyncio.create_task(new.submit(_work(3))) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert depth._value.get() == 3
    old_engine.gate.set()  # the old copy takes its two waiting batches now
    await stopping
    await asyncio.gather(old_blocker, *old_waiting)
    assert depth._value.get() == 3  # was 0: the old copy's last take
    new_engine.gate.set()
    await asyncio.gather(new_blocker, *new_waiting)
    assert depth._value.get() == 0
    await new.stop()
