"""Front-end coalescing (service.dataplane.coalesce): merged requests answer as they would alone."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from service import create_engine
from service.dataplane import DataPlane
from service.dataplane.coalesce import MAX_IN_FLIGHT, Lane
from service.dataplane.view import Prepared
from service.errors import InvalidInput
from service.registry import ModelRegistry
from service.scheduler import SequenceWork
from serving_support import LSTM, make_model, write_config

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def dataplane(tmp_path):
    make_model(*LSTM, seed=5).save(tmp_path, "lstm", 1)
    write_config(tmp_path, "lstm", max_batch_size=6)
    dp = DataPlane(ModelRegistry(tmp_path, device="cpu"))
    await dp.start()
    try:
        yield dp
    finally:
        await dp.stop()


def _work(rng, batch: int, t: int, lengths: list[int], outputs: set[str], states: bool = False) -> SequenceWork:
    x = rng.standard_normal((batch, t, 4)).astype(np.float32)
    h0 = c0 = None
    if states:
        h0 = rng.standard_normal((batch, 2, 8)).astype(np.float32)
        c0 = rng.standard_normal((batch, 2, 8)).astype(np.float32)
    return SequenceWork(x, np.array(lengths, np.int64), h0, c0, frozenset(outputs))


class Recorder:
    """The lane's ``send``: records each message, then submits it to the real DataPlane."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.view = dataplane.model_view("lstm")
        self.sent: list[Prepared] = []

    def __call__(self, prepared: Prepared) -> asyncio.Future:
        self.sent.append(prepared)
        return self.dataplane.submit_prepared("lstm", "", self.view.generation, prepared)


def _metric(dataplane: DataPlane, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(dataplane.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def test_requests_merged_in_one_message_answer_as_alone(dataplane):
    rng = np.random.default_rng(0)
    works = [
        _work(rng, 1, 9, [9], {"output_last"}),
        _work(rng, 1, 3, [2], {"output", "h_n"}),  # client padding past its length
        _work(rng, 2, 7, [7, 4], {"output", "output_last", "h_n", "c_n"}, states=True),
        _work(rng, 1, 1, [1], {"c_n"}),
        _work(rng, 1, 5, [5], {"output"}, states=True),
    ]
    send = Recorder(dataplane)
    lane = Lane(send.view, send)
    futures = [lane.submit(Prepared(w, None, None)) for w in works]  # one loop iteration: one message
    results = await asyncio.gather(*futures)
    assert [p.requests for p in send.sent] == [5]
    engine = create_engine(make_model(*LSTM, seed=5), "cpu")
    for work, got in zip(works, results):
        want = engine.forward(work.x, work.lengths, work.h0, work.c0)
        assert set(got) == set(work.outputs)
        if "output" in got:
            assert got["output"].shape == work.x.shape[:2] + (8,)
            np.testing.assert_allclose(got["output"], want.output, rtol=1e-5, atol=1e-6)
        if "output_last" in got:
            last = want.output[np.arange(work.sequences), work.lengths - 1]
            np.testing.assert_allclose(got["output_last"], last, rtol=1e-5, atol=1e-6)
        for name in ("h_n", "c_n"):
            if name in got:
                np.testing.assert_allclose(got[name], getattr(want, name), rtol=1e-5, atol=1e-6)
    # the engine process counts requests, not messages
    assert _metric(dataplane, "rnnserve_requests_total", model="lstm", outcome="success") == 5
    assert _metric(dataplane, "rnnserve_request_duration_seconds_count", model="lstm") == 5


async def test_messages_respect_max_batch_size_and_the_in_flight_limit(dataplane):
    rng = np.random.default_rng(1)
    send = Recorder(dataplane)
    lane = Lane(send.view, send)
    works = [_work(rng, 1 + k % 2, 6, [6] * (1 + k % 2), {"output_last"}) for k in range(12)]  # 18 sequences
    futures = [lane.submit(Prepared(w, None, None)) for w in works]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    # max_batch_size 6 sequences per message, at most MAX_IN_FLIGHT messages before an answer
    assert len(send.sent) == MAX_IN_FLIGHT
    assert all(p.work.sequences <= 6 for p in send.sent)
    results = await asyncio.gather(*futures)
    assert sum(p.requests for p in send.sent) == 12
    assert all(p.work.sequences <= 6 for p in send.sent)
    assert [r["output_last"].shape[0] for r in results] == [w.sequences for w in works]


async def test_an_error_fails_every_merged_request_and_a_cancelled_one_is_not_sent(dataplane):
    view = dataplane.model_view("lstm")
    sent: list[Prepared] = []

    def failing(prepared: Prepared) -> asyncio.Future:
        sent.append(prepared)
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(InvalidInput("refused"))
        return fut

    rng = np.random.default_rng(2)
    lane = Lane(view, failing)
    futures = [lane.submit(Prepared(_work(rng, 1, 4, [4], {"output_last"}), None, None)) for _ in range(3)]
    futures[1].cancel()
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert [p.requests for p in sent] == [2]
    assert isinstance(outcomes[0], InvalidInput) and isinstance(outcomes[2], InvalidInput)
    assert isinstance(outcomes[1], asyncio.CancelledError)
