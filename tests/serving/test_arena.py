"""Request arrays through a front-end's shared-memory arena (service.dataplane.arena): placed, read in place by
the engine process, freed when answered, and on the socket whenever the arena cannot take them."""
from __future__ import annotations

import asyncio
import os
import pickle

import numpy as np
import pytest
import pytest_asyncio

from service import create_engine
from service.dataplane import arena as arenas
from service.dataplane.remote import DataPlaneServer, RemoteDataPlane
from service.dataplane.types import InferRequest, InferTensor, RequestedOutput
from service.repository import load_model
from service.wire import placing, wire
from serving_support import lstm_dataplane

needs_shm = pytest.mark.skipif(not os.path.isdir(arenas.SHM_DIR), reason="no /dev/shm on this machine")


@needs_shm
def test_places_are_handed_out_first_fit_and_merged_when_freed():
    arena = arenas.Arena.create(4096)
    try:
        a = np.arange(100, dtype=np.float32)  # 400 bytes -> 448 with alignment
        offsets = [arena.put(a) for _ in range(9)]
        assert offsets == [448 * k for k in range(9)]
        assert arena.put(a) is None  # 4096 - 9 * 448 = 64 bytes left
        arena.release([(offsets[1], a.nbytes), (offsets[3], a.nbytes)])
        assert arena.put(np.zeros(200, np.float32)) is None  # 800 bytes: no single free place is that large
        arena.release([(offsets[2], a.nbytes)])  # 1, 2 and 3 join into one
        assert arena.put(np.zeros(300, np.float32)) == offsets[1]
        arena.release([(offsets[1], 1200)] + [(offsets[k], a.nbytes) for k in (0, 4, 5, 6, 7, 8)])
        assert arena.free_bytes == 4096 and arena._free == [(0, 4096)]
    finally:
        arena.close()


@needs_shm
def test_an_array_pickled_while_placing_is_read_in_place_by_the_engine_side():
    arena = arenas.Arena.create(1 << 16)
    try:
        arenas.attach(arena.path, arena.size)
        assert not os.path.exists(arena.path)  # the engine side removed the file once mapped
        big = np.random.default_rng(0).standard_normal((2, 100, 8)).astype(np.float32)
        small = np.arange(5, dtype=np.int64)
        with placing(arenas.Placing(arena)) as placement:
            data = pickle.dumps((wire(big), wire(small), wire(big[:, ::2])), protocol=5)
        assert [n for _, n in placement.places] == [big.nbytes, big.nbytes // 2]  # the small one stays inline
        got_big, got_small, got_strided = pickle.loads(data)
        np.testing.assert_array_equal(got_big, big)
        np.testing.assert_array_equal(got_small, small)
        np.testing.assert_array_equal(got_strided, big[:, ::2])
        # in place: what the front-end writes there is what the engine side reads
        arena._buffer[placement.places[0][0]:placement.places[0][0] + 4] = np.frombuffer(np.float32(7.0).tobytes(), np.uint8)
        assert got_big.reshape(-1)[0] == 7.0
        arena.release(placement.places)
        assert arena.free_bytes == arena.size
    finally:
        arenas.detach(arena.path)
        arena.close()


def test_no_shared_memory_means_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(arenas, "SHM_DIR", str(tmp_path / "missing"))
    assert arenas.Arena.create(1 << 20) is None
    assert "travel on the socket instead" in caplog.text and "--frontend-shm-mb 0" in caplog.text
    assert arenas.Arena.create(0) is None


@pytest_asyncio.fixture
async def engine_side(tmp_path):
    """The engine process's side in this process: a DataPlane on the reference engine behind its socket."""
    async with lstm_dataplane(tmp_path, seed=8, max_batch_size=8) as dp:
        server = DataPlaneServer(dp, str(tmp_path / "engine.sock"))
        await server.start()
        try:
            yield tmp_path, server
        finally:
            await server.stop()


def _request(x: np.ndarray, outputs: tuple[str, ...]) -> InferRequest:
    return InferRequest("lstm", "", "", [InferTensor("input", "FP32", list(x.shape), x)],
                        [RequestedOutput(n, {}) for n in outputs], {})


@needs_shm
@pytest.mark.asyncio
@pytest.mark.parametrize("arena_bytes", [1 << 22, 40_000], ids=["roomy", "mostly-full"])
async def test_concurrent_requests_through_the_arena_equal_the_engine(engine_side, arena_bytes):
    """48 concurrent requests of 2..6 KB inputs: with room they all go through shared memory; with an arena that
    holds one message (8 merged sequences) at a time the others go on the socket. Every answer equals the engine's, and every place is
    free again once all are answered."""
    repo, _ = engine_side
    remote = RemoteDataPlane(str(repo / "engine.sock"), arena_bytes=arena_bytes)
    await remote.connect()
    try:
        arena = remote._arena
        assert arena is not None and not os.path.exists(arena.path)
        placed = []
        put = arena.put
        arena.put = lambda a: placed.append(put(a)) or placed[-1]
        rng = np.random.default_rng(9)
        xs = [rng.standard_normal((1 + k % 2, int(rng.integers(130, 190)), 4)).astype(np.float32) for k in range(48)]
        outs = [("output", "h_n", "c_n") if k % 3 else ("output_last",) for k in range(48)]
        answers = await asyncio.gather(*(remote.infer(_request(x, o)) for x, o in zip(xs, outs)))
        engine = create_engine(load_model(repo / "lstm"), "cpu")
        for x, names, answer in zip(xs, outs, answers):
            got = {t.name: t.data for t in answer.outputs}
            want = engine.forward(x)
            assert set(got) == set(names)
            if "output" in names:
                np.testing.assert_allclose(got["output"], want.output, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(got["c_n"], want.c_n, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_allclose(got["output_last"], want.output[:, -1], rtol=1e-5, atol=1e-6)
        taken = [p for p in placed if p is not None]
        assert taken, "no request went through shared memory"
        if arena_bytes < 1 << 20:
            assert None in placed  # and some did not fit
        assert arena.free_bytes == arena.size and not remote._held
    finally:
        await remote.close()


@needs_shm
@pytest.mark.asyncio
async def test_a_front_end_whose_arena_the_engine_cannot_map_sends_on_the_socket(engine_side, monkeypatch):
    repo, _ = engine_side

    def refuse(path, size):
        os.unlink(path)
        raise OSError("mapping refused (test)")

    monkeypatch.setattr(arenas, "attach", refuse)
    remote = RemoteDataPlane(str(repo / "engine.sock"), arena_bytes=1 << 20)
    await remote.connect()
    try:
        assert remote._arena is None
        x = np.random.default_rng(2).standard_normal((1, 200, 4)).astype(np.float32)
        answer = await remote.infer(_request(x, ("output_last",)))
        want = create_engine(load_model(repo / "lstm"), "cpu").forward(x)
        np.testing.assert_allclose(answer.outputs[0].data, want.output[:, -1], rtol=1e-5, atol=1e-6)
    finally:
        await remote.close()


@needs_shm
@pytest.mark.asyncio
async def test_a_call_that_cannot_be_sent_gives_its_places_back(engine_side):
    repo, _ = engine_side
    remote = RemoteDataPlane(str(repo / "engine.sock"), arena_bytes=1 << 20)
    await remote.connect()
    try:
        big = wire(np.ones((4, 100, 4), np.float32))
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            remote._send("submit", big, lambda: None)  # the array is placed, then the lambda cannot be pickled
        assert remote._arena.free_bytes == remote._arena.size and not remote._pending and not remote._held
    finally:
        await remote.close()


@needs_shm
def test_an_attached_arena_is_announced_to_device_engines_until_detached(monkeypatch):
    from service.engines import shared_host

    monkeypatch.setattr(shared_host, "_watchers", [])  # this test's watcher only, gone after it
    seen = []

    def on_add(key, buffer):
        seen.append(("add", key, len(buffer)))

    shared_host.watch(on_add, lambda key: seen.append(("remove", key)))
    arena = arenas.Arena.create(1 << 16)
    try:
        arenas.attach(arena.path, arena.size)
        assert seen == [("add", arena.path, arena.size)]
    finally:
        arenas.detach(arena.path)
        arenas.detach(arena.path)  # again: announced once, withdrawn once
        arena.close()
    assert seen == [("add", arena.path, arena.size), ("remove", arena.path)]
