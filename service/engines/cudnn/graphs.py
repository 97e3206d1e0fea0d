"""CUDA graphs of equal-length cuDNN calls: one graph launch instead of a kernel launch per step.

cuDNN's STANDARD algorithm launches kernels for every step of every layer, so a call's
host time grows with T and often exceeds its GPU time (a 2-layer GRU, H=512, B=64,
T=100 in fp32: the GPU work took ~3 ms, the call ~5 ms of host launches, and PyTorch
pays the same). A captured graph replays every launch of the call from one host call.

A graph keeps the device pointers it was captured with, so each graph owns its buffers:
the input, the initial states, every block's output and the final states. The cuDNN
workspace is one buffer that every graph shares: replays run one after another on the
engine's stream, and the workspace holds nothing from one call to the next. (Each graph
had its own: ~20 MB apiece for the 2-layer H=256 stream model at t=10, so the 512 MB
budget held ~24 batch sizes, and 256 paced streams, whose batches take many sizes, kept
evicting and capturing again, 2-9 ms each on the engine process's thread; H100 host.)
A replay copies the caller's input and states in (device-to-device copies queued on the
engine's stream), launches the graph and copies the final states out; the output is
the graph's own buffer, valid until the next replay of the same graph on the stream,
which is later in stream order than anything the caller queued after this call (the
engine copies it when the caller keeps device outputs).

Only equal-length calls are captured (cuDNN reads ragged lengths from the host
descriptor at launch); a ragged batch that runs padded, and calls of nearby sizes, share
graphs of bucketed shapes (:mod:`.shape_buckets`), filling the first rows and steps of a
graph's buffers. A shape is captured on its ``MIN_USES``-th call, so one-off
shapes never pay the capture; graphs past the memory budget are dropped least recently
used first, and captures are rate-limited, and stop while the graphs so far are seldom
replayed, so that traffic whose shapes never settle (single ragged requests of every
length) does not keep the engine capturing. A shape whose capture fails is remembered and runs uncaptured from then on.

Fused calls (:mod:`.fused`: the copies and state moves around the blocks captured too) keep their graphs
here as well, under keys of their own, through :meth:`GraphRuns.find`, :meth:`~GraphRuns.admit` and
:meth:`~GraphRuns.keep`: one budget, one workspace, one rate limit for both.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import library as L
from .block import AlgorithmRejected
from .copies import swap01

log = logging.getLogger("rnnserve.engines.cudnn.graphs")

MIN_USES = 2
# Held while an engine is built (tuning captures graphs of its own) or closed, and while a graph is captured:
# a capture must not overlap another engine's load in this process (seen on an H100: a model's
# cuRAND launches failed while another model's tuning captured). A capture at serving time that
# finds a load in progress runs its call uncaptured instead of waiting.
SETUP_LOCK = threading.RLock()
CAPTURE_BURST = 64        # captures allowed at once ...
CAPTURES_PER_S = 20.0     # ... and refilled at this rate: traffic whose shapes never settle (more
                          # distinct shapes than the budget holds) must not spend its time capturing,
REPLAYS_PER_CAPTURE = 8   # and past the burst a capture needs this many replays per capture so far
_D2D = 3  # cudaMemcpyDeviceToDevice


def capture(cp: Any, stream: Any, enqueue: Callable[[], None]) -> Any:
    """A CUDA graph of the work ``enqueue()`` queues on ``stream``, uploaded and ready to launch.

    Thread-local capture mode: this thread may not make unsafe calls meanwhile (every buffer is
    allocated beforehand), other threads are not restricted.
    """
    stream.begin_capture(mode=getattr(cp.cuda.runtime, "streamCaptureModeThreadLocal", 1))
    try:
        enqueue()
    finally:
        graph = stream.end_capture()
    graph.upload(stream)
    return graph


def capture_errors(cp: Any) -> tuple[type[BaseException], ...]:
    """What a failed capture raises."""
    return L.CudnnError, cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError


@dataclass
class _Captured:
    graph: Any
    x: Any                      # [n, t, I] input, storage dtype
    states: list                # per block (h | None, c | None): the initial states copied in
    hys: list                   # per block final h [rows, n, Ho]
    cys: list                   # per block final c [rows, n, H] | None
    y: Any                      # the last block's output ([n, t, F], or a transposed view of [t, n, F])
    keep: list                  # every other buffer the graph writes or reads
    nbytes: int


class GraphRuns:
    """Captured graphs of one engine's equal-length calls, keyed by shape, algorithms and states given."""

    def __init__(self, cp: Any, ctx: Any, runners: Sequence[Any], store: Any, budget_bytes: int,
                 log_level: int = logging.INFO) -> None:
        self.cp = cp
        self.log_level = log_level  # of each capture's note (the autotuner's timing captures: DEBUG)
        self.ctx = ctx
        self.runners = list(runners)
        self.store = store
        self.budget = int(budget_bytes)
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._uses: dict[tuple, int] = {}
        self._failed: set[tuple] = set()
        self._tokens = float(CAPTURE_BURST)
        self._refilled = time.monotonic()
        self.bytes = 0  # the graphs' own buffers and the shared workspace
        self._workspace: Any = None
        self.captures = 0
        self.replays = 0
        self.evictions = 0
        self.capture_seconds = 0.0  # host time of captures: the calls that captured waited this long

    def run(self, x: Any, n: int, t: int, lens_key: tuple, lens_host: Any, lens_dev: Any, states: Any,
            algos: tuple[int, ...], seq_major: bool, hys: list | None, cys: list | None) -> Any | None:
        """Run the call as a graph and return its output, or None when the caller must run it itself.

        ``states``/``hys``/``cys`` as in the engine's ``_run_blocks``; the final states are copied
        into ``hys``/``cys`` (None: not wanted). ``x`` (and ``states``, ``hys``, ``cys``) may have fewer
        rows, and ``x`` fewer steps, than the graph (a call at a bucketed shape, see
        :mod:`.shape_buckets`): they fill the first rows and steps of the graph's buffers, and the
        rest holds what earlier calls left there (zeros at first), which only feeds rows and steps
        nobody reads.
        """
        if lens_key[-1] is not None or self.budget <= 0:
            return None
        mask = tuple((s[0] is not None, s[1] is not None) for s in states) if states is not None else None
        key = (n, t, algos, seq_major, mask, x.shape[2])
        got = self.find(key, lambda: self._capture(key, n, t, lens_key, lens_host, lens_dev, mask, algos,
                                                   seq_major, int(x.shape[2])))
        if got is None:
            return None
        stream = self.ctx.stream
        self._copy(got.x, x, stream)
        if states is not None:
            for (h_s, c_s), (h, c) in zip(got.states, states):
                if h_s is not None:
                    self._copy(h_s, h, stream)
                if c_s is not None:
                    self._copy(c_s, c, stream)
        got.graph.launch(stream)
        for k in range(len(hys) if hys is not None else 0):
            self._copy(hys[k], got.hys[k], stream)
            if cys[k] is not None:
                self._copy(cys[k], got.cys[k], stream)
        self.replays += 1
        return got.y

    def find(self, key: tuple, capture: Callable[[], Any]) -> Any | None:
        """The graph kept under ``key``, or the one ``capture()`` makes now (it calls :meth:`admit` and
        :meth:`keep`, or returns None), on the key's ``MIN_USES``-th call when captures are allowed;
        None: the caller runs uncaptured."""
        got = self._graphs.get(key)
        if got is not None:
            self._graphs.move_to_end(key)
            return got
        if key in self._failed:
            return None
        uses = self._uses.get(key, 0) + 1
        if uses < MIN_USES:
            if len(self._uses) > 8192:
                self._uses.clear()
            self._uses[key] = uses
            return None
        if not self._may_capture() or not SETUP_LOCK.acquire(blocking=False):
            return None
        try:
            got = capture()
        finally:
            SETUP_LOCK.release()
        self._uses.pop(key, None)
        return got

    def admit(self, key: tuple, nbytes: int, work: int) -> Any | None:
        """Room for a graph of ``nbytes`` buffers and ``work`` workspace bytes: the shared workspace, after
        evicting what the budget needs; None (and ``key`` never captured again) when it cannot fit."""
        have = 0 if self._workspace is None else self._workspace.nbytes
        need = max(work, 1)
        # grow by doubling (few growths, each dropping the graphs), but not past a quarter of the budget
        ws_bytes = have if have >= need else max(need, min(2 * have, self.budget // 4))
        if nbytes + ws_bytes > self.budget:
            self._failed.add(key)
            return None
        ws = self._shared_workspace(ws_bytes)
        self._evict(self.budget - nbytes)
        return ws

    def keep(self, key: tuple, got: Any, started: float, what: str) -> None:
        """Keep ``got`` (with ``nbytes`` and ``y``) under ``key``; ``started``: when its capture began."""
        self._graphs[key] = got
        self.bytes += got.nbytes
        self.captures += 1
        took = time.perf_counter() - started
        self.capture_seconds += took
        log.log(self.log_level, "captured a CUDA graph for %s in %.1f ms (%d graphs, %.1f of %.0f MB, %d evicted so far)",
                what, 1e3 * took, len(self._graphs), self.bytes / 2**20, self.budget / 2**20, self.evictions)

    def failed(self, key: tuple, what: str, exc: BaseException) -> None:
        """``key``'s capture failed: its calls run uncaptured from now on."""
        log.warning("CUDA graph capture of %s failed (%s: %s); this shape runs uncaptured", what,
                    type(exc).__name__, exc)
        self._failed.add(key)

    def _may_capture(self) -> bool:
        if self.captures >= CAPTURE_BURST and self.replays < REPLAYS_PER_CAPTURE * self.captures:
            return False  # the graphs so far are rarely replayed: these shapes do not repeat enough
        now = time.monotonic()
        self._tokens = min(float(CAPTURE_BURST), self._tokens + (now - self._refilled) * CAPTURES_PER_S)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def owns(self, a: Any) -> bool:
        """Whether ``a`` is (a view of) a graph's output buffer."""
        ptr = a.data.ptr
        return any(g.y.data.ptr == ptr for g in self._graphs.values())

    def close(self) -> None:
        self._graphs.clear()
        self._uses.clear()
        self._workspace = None
        self.bytes = 0

    def describe(self) -> dict:
        return {"graphs": len(self._graphs), "bytes": self.bytes, "budget_bytes": self.budget,
                "captures": self.captures, "replays": self.replays, "evictions": self.evictions,
                "capture_ms": round(1e3 * self.capture_seconds, 1), "failed_shapes": len(self._failed),
                "workspace_bytes": 0 if self._workspace is None else self._workspace.nbytes}

    def _copy(self, dst: Any, src: Any, stream: Any) -> None:
        if dst.shape != src.shape:
            # a call at a bucketed shape: the caller's [n, t, I] input or [R, n, W] states into the
            # first rows (and steps) of the graph's larger buffers, or its final states back out
            if dst.ndim != 3 or dst.shape[2] != src.shape[2]:
                raise ValueError(f"cannot copy {src.shape} into {dst.shape}")
            if not (src.flags.c_contiguous and dst.flags.c_contiguous):
                corner = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape))
                dst[corner] = src[corner]
                return
            width = min(dst.strides[0], src.strides[0])
            self.cp.cuda.runtime.memcpy2DAsync(dst.data.ptr, dst.strides[0], src.data.ptr, src.strides[0], width,
                                               min(dst.shape[0], src.shape[0]), _D2D, stream.ptr)
            return
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            dst[...] = src
            return
        if dst.nbytes:
            self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, _D2D, stream.ptr)

    def replay_ms(self, n: int, t: int, uniform: tuple, algos: tuple[int, ...], seq_major: bool,
                  features: int) -> float | None:
        """GPU ms of one replay of an equal-length call of ``n`` rows and ``t`` steps in this layout (input
        transpose included, launches not): what a served replay of that shape costs. Captured now on buffers
        of its own, which are dropped after; ``uniform``: (lens_key, lens_host, lens_dev) of the shape. None
        when it cannot be captured (then it is not replayed when served either)."""
        from .autotune import time_call

        key = ("timing", n, t, algos, seq_major, features)
        got = self._capture(key, n, t, *uniform, None, algos, seq_major, features)
        if got is None:
            return None
        stream = self.ctx.stream
        try:
            return time_call(lambda: got.graph.launch(stream), stream)
        finally:
            self._graphs.pop(key, None)
            self.bytes -= got.nbytes

    def _capture(self, key, n, t, lens_key, lens_host, lens_dev, mask, algos, seq_major,
                 features: int) -> _Captured | None:
        cp, store, stream = self.cp, self.store, self.ctx.stream
        started = time.perf_counter()
        try:
            x_s = cp.zeros((n, t, features), store)
            states, hys, cys, ys, keep = [], [], [], [], [lens_dev]
            for k, runner in enumerate(self.runners):
                blk = runner.spec
                rows = blk.pseudo_layers
                h_given, c_given = mask[k] if mask is not None else (False, False)
                states.append((cp.zeros((rows, n, blk.output_size), store) if h_given else None,
                               cp.zeros((rows, n, blk.hidden_size), store) if c_given else None))
                hys.append(cp.empty((rows, n, blk.output_size), store))
                cys.append(cp.empty((rows, n, blk.hidden_size), store) if blk.cell == "lstm" else None)
                ys.append(cp.empty((t, n, runner.out_features) if seq_major else (n, t, runner.out_features), store))
            inp0 = cp.empty((t, n, features), store) if seq_major else x_s
            work = max(r.work_size(a, n, t, lens_key, lens_host, seq_major) for r, a in zip(self.runners, algos))
            keep += [inp0, *ys]
            nbytes = sum(a.nbytes for a in keep[1:] + [x_s] + hys + [c for c in cys if c is not None]
                         + [a for pair in states for a in pair if a is not None])
            ws = self.admit(key, nbytes, work)
            if ws is None:
                return None
            keep.append(ws)

            def enqueue() -> None:
                if seq_major:
                    swap01(cp, x_s, out=inp0)
                inp = inp0
                for k, (runner, algo) in enumerate(zip(self.runners, algos)):
                    h_in, c_in = states[k]
                    runner.forward(algo, n, t, lens_key, lens_host, lens_dev.data.ptr, inp.data.ptr, ys[k].data.ptr,
                                   h_in.data.ptr if h_in is not None else 0, hys[k].data.ptr,
                                   c_in.data.ptr if c_in is not None else 0,
                                   cys[k].data.ptr if cys[k] is not None else 0, seq_major, workspace=ws.data.ptr)
                    inp = ys[k]

            enqueue()  # uncaptured first: descriptors, plans and kernels exist before the capture
            graph = capture(cp, stream, enqueue)
        except (*capture_errors(cp), ValueError, AlgorithmRejected) as exc:  # e.g. PERSIST_DYNAMIC not built
            # for this batch size: the caller runs the call uncaptured, where it falls back to STANDARD
            self.failed(key, f"n={n} t={t}", exc)
            return None
        y = ys[-1].transpose(1, 0, 2) if seq_major else ys[-1]
        got = _Captured(graph, x_s, states, hys, cys, y, keep, nbytes)
        self.keep(key, got, started, f"n={n} t={t}")
        return got

    def _shared_workspace(self, size: int) -> Any:
        """The workspace of every graph, ``size`` bytes when it has to grow (the caller doubles it).

        Growing drops the graphs captured with the old buffer (they are captured again when
        next used), so the budget counts one workspace.
        """
        if self._workspace is None or self._workspace.nbytes < size:
            self.evictions += len(self._graphs)
            self._graphs.clear()
            self._workspace = None
            self._workspace = self.cp.empty(size, self.cp.uint8)
            self.bytes = self._workspace.nbytes
        return self._workspace

    def _evict(self, room: int) -> None:
        while self._graphs and self.bytes > room:
            _, old = self._graphs.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
