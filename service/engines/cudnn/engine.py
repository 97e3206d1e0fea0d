"""CudnnEngine: cuDNN 9 RNN inference (cudnnRNNForward, FWD_MODE_INFERENCE) through ctypes and CuPy.

IO is padded (PADDED_IO_ENABLED) with per-sequence lengths (a host int32 array
for the data descriptors, a device copy for ``devSeqLengths``) and zeros written
past each length. The engine contract's [B, T, F] arrays go to cuDNN as they are
(CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED) or, where the autotuner measured it
faster, transposed once to [T, B, F] (SEQ_MAJOR_UNPACKED); the output of that path
is a transposed view of a [T, B, F] buffer, as PyTorch's batch_first output is. States go
from the contract's [B, L*D, Ho] to cuDNN's [L*D, B, Ho] and back. Blocks run one
after another on the device; only the caller's inputs and the final outputs cross
the bus.

Output dtypes: float32, except that an engine computing in float16 returns
float16 when ``x`` is float16 (no conversion at all on that path). bfloat16
results are returned as float32, since NumPy and CuPy have no bfloat16 dtype.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ...errors import EngineUnavailable, InvalidInput, NoCudaDevice
from ...repository import PackedModel
from ..base import BlockState, Engine, EngineOutput, Launched, check_block_states, check_forward_args
from ..state_pool import PooledRows, StatePool
from . import library as L
from .autotune import AlgoTable, Group, batch_buckets, plan
from .block import AlgorithmRejected
from .block_states import block_views, new_states, read_slots, write_slots
from .copies import last_steps, seq_major, swap01
from .fused import FusedCalls, forward_cols
from .graphs import SETUP_LOCK, GraphRuns
from .host_rows import HostRows, host_rows
from .mapped import mapped_host
from .shape_buckets import GraphShapes
from .transfer import download_results
from .tuning import tolerance, tune_layouts, tune_table
from .warmup import warm_paths

OUTPUT_DEVICES = ("host", "device")
LAYOUTS = ("batch_major", "seq_major")



def import_cupy():
    """CuPy and the number of CUDA GPUs; NoCudaDevice or EngineUnavailable saying what is missing."""
    # Without the NVIDIA driver's control device there is no GPU to miss: that is a CPU machine,
    # where a missing CuPy or CUDA runtime is expected. With it, the same failures are faults.
    cpu_machine = not os.path.exists("/dev/nvidiactl")
    try:
        import cupy as cp
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        raise (NoCudaDevice if cpu_machine else EngineUnavailable)(
            f"the cuDNN engine needs CuPy (pip install 'rnnserve[gpu]'), which could not be imported: {exc}"
        ) from exc
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise (NoCudaDevice if cpu_machine else EngineUnavailable)(
            f"the cuDNN engine found no usable CUDA GPU: {exc}") from exc
    if count < 1:
        raise NoCudaDevice("the cuDNN engine found no CUDA GPU on this machine")
    return cp, count


class CudnnEngine(Engine):
    """Runs a PackedModel with cuDNN; options override the model's config.

    ``algorithm`` forces one algorithm name (``standard``, ``persist_static``,
    ``persist_dynamic``, ``persist_static_small_h``) wherever cuDNN accepts it, for
    tests and experiments; ``buckets`` replaces the power-of-two batch buckets;
    ``tune_steps`` is the first sequence length timed at load (the second is ``LONG_FACTOR`` times
    it; see autotune). ``blocking_sync``: wait for results
    asleep instead of spinning a core (the server sets it: its other processes and threads
    need the cores while the GPU computes; a spin wakes ~10 µs sooner). ``graph_memory_mb``: the
    budget of CUDA graphs for repeated equal-length calls (default: the model's config; 0: none;
    see :mod:`.graphs`). ``bucket_graphs``: replay graphs of bucketed shapes for calls whose
    shapes differ (see :mod:`.shape_buckets`); False runs every graph at the call's exact shape
    (tests that compare replays with plain calls bit for bit). ``fused``: run small calls from host inputs
    as one graph with their copies and state slot moves (see :mod:`.fused`); False: the general path
    (benchmarks compare the two).
    """

    name = "cudnn"
    skips_states = True
    computes_last = True  # forward(..., last_only=True): many-to-one outputs picked on the GPU
    launches = True  # launch(...): queue a forward call, wait for it elsewhere (see launch)
    concurrent_batches = 2  # the next batch is ready while the GPU runs and the loop answers the last

    def __init__(self, model: PackedModel, precision: str | None = None, allow_tf32: bool | None = None,
                 max_batch_size: int | None = None, autotune: bool = True, device_id: int = 0,
                 force_per_matrix_upload: bool = False, algorithm: str | None = None,
                 buckets: tuple[int, ...] | None = None, tune_steps: int = 50, layout: str | None = None,
                 blocking_sync: bool = False, graph_memory_mb: int | None = None, bucket_graphs: bool = True,
                 fused: bool = True) -> None:
        started = time.perf_counter()
        self.model = model
        self.spec = model.spec
        for k, blk in enumerate(self.spec.blocks):
            if not blk.is_cudnn:
                names = ", ".join(f"'{n}'" for n in blk.variant_names)
                raise EngineUnavailable(
                    f"block {k} uses variant {names} which cuDNN cannot run; serve it with device='cpu' or 'auto'"
                )
        cfg = model.config
        self.precision = precision or cfg.precision
        self.allow_tf32 = cfg.allow_tf32 if allow_tf32 is None else bool(allow_tf32)
        self.max_batch_size = int(max_batch_size or cfg.max_batch_size)
        if algorithm is not None and algorithm not in L.ALGO_BY_NAME:
            raise InvalidInput(f"algorithm '{algorithm}' is not known; use one of {', '.join(L.ALGO_BY_NAME)}")
        self._forced = None if algorithm is None else L.ALGO_BY_NAME[algorithm]
        if layout not in (None,) + LAYOUTS:
            raise InvalidInput(f"layout '{layout}' is not known; use one of {', '.join(LAYOUTS)}")
        self._layout = layout
        if not 0 <= int(device_id):
            raise InvalidInput(f"device_id must be >= 0, got {device_id}")

        from .descriptors import make_precision

        prec = make_precision(self.precision, self.allow_tf32)
        cp, count = import_cupy()
        if device_id >= count:
            raise EngineUnavailable(f"CUDA device {device_id} does not exist; this machine has {count}")
        self._cp = cp
        self._lib = L.get_library()

        from .block import BlockRunner, DeviceContext
        from .transfer import Converter, HostStaging

        self._uniform_h = self.spec.state_size is not None
        self._uniform_c = self.spec.cell_state_size is not None
        self._uniform_lengths: dict[tuple[int, int], tuple[tuple, np.ndarray, Any]] = {}
        self._plans: dict[tuple[int, int], list[Group]] = {}
        self._shapes = GraphShapes(None, False)  # until tuned (see below)
        SETUP_LOCK.acquire()  # see graphs.SETUP_LOCK; released once the engine is built or has failed
        try:
            self._ctx = DeviceContext(self._lib, int(device_id))
        except BaseException:
            SETUP_LOCK.release()
            raise
        self.device_id = int(device_id)
        self._lock = threading.Lock()
        self._runners: list[BlockRunner] = []
        self._graphs: GraphRuns | None = None
        self._fused: FusedCalls | None = None
        try:
            with self._ctx.device, self._ctx.stream:
                self._conv = Converter(cp, self.precision)
                self._staging = HostStaging(cp)
                self._mapped = mapped_host(cp, int(device_id))  # front-end arenas, readable by the device (see input_rows)
                self._blocking_sync = blocking_sync
                self._prec = self._build_runners(BlockRunner, prec, force_per_matrix_upload)
                steps = max(1, int(tune_steps))
                self._buckets = batch_buckets(self.max_batch_size, buckets)
                budget = cfg.cuda_graph_memory_mb if graph_memory_mb is None else int(graph_memory_mb)
                self._table = self._tune(autotune, steps, graph=budget > 0)
                self._tune_layouts(autotune, steps, budget << 20)
                warm_paths(self, steps)
                for runner in self._runners:  # (a forced PERSIST_DYNAMIC, for tests and benches, still builds)
                    runner.builds_allowed = self._forced == L.ALGO_PERSIST_DYNAMIC
                if budget > 0:  # after tuning and warm-up, whose calls are not uses of a shape
                    self._graphs = GraphRuns(cp, self._ctx, self._runners, self._prec.store, budget << 20)
                    if fused and self.precision != "bfloat16":  # bfloat16 stages float32, converts on the device
                        self._fused = FusedCalls(cp, self._ctx, self._runners, self.spec, self._prec.store,
                                                 self._graphs, blocking_sync)
                # untuned or forced: no timings to weigh padding with, or shapes a test wants exact
                self._shapes = GraphShapes(self._table, bucket_graphs and autotune and self._forced is None)
        except L.CudnnError as exc:
            self.close()
            raise EngineUnavailable(f"cuDNN cannot run model '{model.name or '?'}': {exc}") from exc
        except BaseException:
            self.close()
            raise
        finally:
            SETUP_LOCK.release()
        props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        name = props.get("name", b"?")
        self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
        self.load_ms = (time.perf_counter() - started) * 1000.0

    # -- load -------------------------------------------------------------------------------------

    def _build_runners(self, runner_cls, prec, force_per_matrix: bool):
        """Create every block's descriptors and weights; returns the precision cuDNN accepted.

        fp16/bf16 ask for tensor-op math first and fall back to cuDNN's default math type.
        """
        options = [prec]
        if prec.name != "float32":
            options.append(replace(prec, math_type=L.MATH_DEFAULT))
        for i, option in enumerate(options):
            try:
                for k, (blk, flat) in enumerate(zip(self.spec.blocks, self.model.weights)):
                    self._runners.append(runner_cls(self._ctx, k, blk, flat, option, force_per_matrix))
                return option
            except L.CudnnError:
                for runner in self._runners:
                    runner.close()
                self._runners = []
                if i == len(options) - 1:
                    raise
        raise AssertionError("unreachable")

    def _tune(self, autotune: bool, steps: int, graph: bool = False) -> AlgoTable:
        return tune_table(self._runners, self._conv, self._buckets, steps, self._forced, autotune,
                          tolerance(self.precision, self.allow_tf32), graph)

    def _tune_layouts(self, autotune: bool, steps: int, graph_bytes: int) -> None:
        if self._layout is not None or not autotune:
            forced = self._layout == "seq_major"
            self._table.layouts = {b: (forced, {"forced": self._layout} if self._layout else {})
                                   for b in self._buckets}
            return
        replay_ms = None
        if graph_bytes > 0:  # served calls replay graphs: time the layouts as replays, on graphs of their own
            timing = GraphRuns(self._cp, self._ctx, self._runners, self._prec.store, graph_bytes, logging.DEBUG)
            features = self.spec.input_size

            def replay_ms(n: int, t: int, algos: tuple[int, ...], seq_major: bool) -> float | None:
                return timing.replay_ms(n, t, self._uniform(n, t), algos, seq_major, features)
        try:
            tune_layouts(self._table, self._run_blocks, self._uniform, self._conv, self.spec.input_size, steps,
                         self._ctx.stream, replay_ms)
        finally:
            if replay_ms is not None:
                timing.close()

    # -- contract ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Engine facts for `rnnserve inspect`, including the algorithm per block and batch bucket."""
        return {
            "engine": self.name,
            "device": f"cuda:{self.device_id}",
            "gpu": self.gpu_name,
            "cudnn_version": self._lib.version,
            "cudnn_library": self._lib.path,
            "precision": self.precision,
            "math_type": self._prec.math_name,
            "allow_tf32": self.allow_tf32,
            "max_batch_size": self.max_batch_size,
            "buckets": list(self._buckets),
            "forced_algorithm": None if self._forced is None else L.ALGO_NAMES[self._forced],
            "weights_upload": [
                {"block": r.index, "bytes": r.weights.nbytes,
                 "mode": "single copy" if r.weights.single_copy else "per matrix",
                 "layout_mismatches": r.weights.mismatches[:5]}
                for r in self._runners
            ],
            "algorithms": self._table.describe(),
            "layouts": self._table.describe_layouts(),
            "cuda_graphs": None if self._graphs is None else self._graphs.describe(),
            "fused_calls": None if self._fused is None else self._fused.replays,
            "load_ms": round(self.load_ms, 1),
        }

    def algorithms_for(self, batch: int, steps: int) -> list[str]:
        """Per block, the algorithm an equal-length call of ``batch`` sequences of ``steps`` steps runs."""
        return [L.ALGO_NAMES[a] for a in self._table.algos_for(min(batch, self._table.biggest), steps)]

    def device_memory_bytes(self) -> int:
        """Total memory of the engine's GPU (what the model's memory budget is a share of)."""
        with self._cp.cuda.Device(self.device_id):
            return int(self._cp.cuda.runtime.memGetInfo()[1])

    def synchronize(self) -> None:
        """Wait for everything enqueued on the engine's stream (for timing device outputs)."""
        self._ctx.stream.synchronize()

    def close(self) -> None:
        """Free descriptors, the handle and device buffers."""
        with SETUP_LOCK:
            self._close()

    def _close(self) -> None:
        graphs = getattr(self, "_graphs", None)
        if graphs is not None:
            graphs.close()
            self._graphs = None
        self._fused = None
        for runner in getattr(self, "_runners", []):
            runner.close()
        self._runners = []
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.stream.synchronize()
            ctx.close()
            self._ctx = None

    def forward(self, x: Any, lengths: Any = None, h0: Any = None, c0: Any = None,
                output_device: str = "host", states_needed: bool = True, last_only: bool = False) -> EngineOutput:
        """Run the model; shapes as in :mod:`service.engines.base`.

        ``x``/``h0``/``c0`` may be NumPy (copied in through pinned memory) or CuPy
        (used in place when already C-contiguous in the engine's dtype).
        ``output_device="device"`` returns CuPy arrays without waiting for the GPU.
        ``states_needed=False``: h_n/c_n may come back None, which lets a causal model run a
        ragged batch padded to equal lengths when the plan finds that faster.
        ``last_only``: ``output`` is None and ``last`` holds the many-to-one outputs [B, D*Ho]
        (see :mod:`service.engines.base`), taken on the GPU: a batch then copies back B rows
        instead of B x T.
        """
        if output_device not in OUTPUT_DEVICES:
            raise InvalidInput(f"output_device must be 'host' or 'device', got '{output_device}'")
        if output_device == "host":
            launched = self.launch(x, lengths, h0, c0, states_needed, last_only)
            launched.wait()
            return launched.finish()
        self._ensure_open()
        with self._lock, self._ctx.device, self._ctx.stream:
            y, hy, cy, out_dtype = self._queue(self._check(x, lengths, h0, c0), lengths is None, h0, c0,
                                               states_needed, last_only, None)
            if self._graphs is not None and self._graphs.owns(y):
                y = y.copy()  # the caller keeps it past the graph's next replay
            out = self._outputs(y, hy, cy, out_dtype, output_device)
            return EngineOutput(None, out.h_n, out.c_n, last=out.output) if last_only else out

    def launch(self, x: Any, lengths: Any = None, h0: Any = None, c0: Any = None, states_needed: bool = True,
               last_only: bool = False, pooled: PooledRows | None = None) -> Launched:
        """Queue :meth:`forward` (host outputs) on the GPU and return without waiting for it.

        ``wait()`` on the result blocks until the outputs are on the host (it gives up the
        GIL: call it on another thread), then ``finish()`` returns the EngineOutput. The
        scheduler launches batches from its event loop and waits on a worker thread: the
        batch's host work then never waits for the GIL between its launches and copies,
        which a busy event loop made cost more than the work itself (H200 host: a batch of
        22 ragged requests, 1.2 ms alone, 2.4 ms with a busy event loop; bench/batch_path.py).
        Calls queue in order on the engine's stream, so a second launch may follow before
        the first is collected.

        ``pooled``: stream rows that start from, and leave their final states in, slots of
        this engine's :meth:`state_pool` (see :meth:`forward_pooled`); gathered and
        scattered on the GPU in the same stream, so a later launch reads what this one left.
        """
        self._ensure_open()
        with self._lock, self._ctx.device, self._ctx.stream:
            checked = self._check(x, lengths, h0, c0)
            launched = None if self._fused is None else self._fused.try_launch(
                checked, h0, c0, pooled, states_needed, last_only, self._table, self._shapes, self._uniform)
            if launched is not None:
                return launched
            y, hy, cy, out_dtype = self._queue(checked, lengths is None, h0, c0, states_needed, last_only, pooled)
            if pooled is not None and not states_needed:
                hy = cy = None  # computed for the pool, not read by the caller
            return self._download(y, hy, cy, out_dtype, last_only)

    def input_buffer(self, shape: tuple[int, int, int]) -> np.ndarray | None:
        """Pinned host memory for a batch's float32 ``x`` (see the base class): ``launch`` copies it to
        the GPU as it is. None when this engine stages float16 (the host copy converts then)."""
        if self._conv.staging_dtype(np.dtype(np.float32)) != np.float32:
            return None
        return self._staging.lend(shape, np.float32)

    def input_rows(self, xs: list[np.ndarray], t_max: int) -> HostRows | None:
        """A batch of the requests ``xs`` ([b, Ts, F] each) padded to ``t_max`` steps, left in the device-mapped
        front-end arenas they lie in (see :mod:`.mapped`): ``launch`` gathers the rows on the GPU. None when
        one of them lies elsewhere or this engine stages float16 (the caller merges on the host then)."""
        if self._conv.staging_dtype(np.dtype(np.float32)) != np.float32 or not len(self._mapped):
            return None
        return host_rows(self._mapped, xs, t_max, np.dtype(np.float32), self.device_id)

    def state_pool(self, max_slots: int, initial: int | None = None) -> StatePool:
        """Stream states on this engine's GPU, in its storage dtype (see :mod:`service.engines.state_pool`)."""
        self._ensure_open()
        with self._ctx.device, self._ctx.stream:
            return StatePool(self.spec, self._cp, self._prec.store, max_slots, initial)

    def forward_pooled(self, x: Any, lengths: Any, h0: Any, c0: Any, pooled: PooledRows,
                       states_needed: bool = True, last_only: bool = False) -> EngineOutput:
        """:meth:`launch` with ``pooled`` rows, waited for (see the base class)."""
        launched = self.launch(x, lengths, h0, c0, states_needed, last_only, pooled)
        launched.wait()
        return launched.finish()

    def _queue(self, checked, uniform_lengths, h0, c0, states_needed, last_only, pooled):
        """Inputs in, blocks run (and the many-to-one rows picked): (y, hy, cy, out_dtype) on the device.

        ``checked``: what :meth:`_check` returned; ``uniform_lengths``: the caller gave no lengths.
        """
        x, b, t, lens, out_dtype = checked
        # padding after a sequence cannot change it, but makes its final state invalid
        pad_ok = self.spec.causal and not states_needed and pooled is None
        index = None if pooled is None else pooled.index.ravel()
        x_d, h0_d, c0_d, lens_d, index_d = self._staging.upload_inputs(self._conv, x, h0, c0, lens, t,
                                                                       self._ctx.stream, index)
        states = block_views(self.spec, h0_d, c0_d)
        if pooled is not None:
            pooled.pool.reserve()
            states = read_slots(self._cp, self.spec, self._prec.store, states, b, pooled, index_d)
        y, hy, cy, hys, cys = self._run(x_d, b, t, lens, uniform_lengths, states, pad_ok,
                                        zero_padding=not last_only, ragged_lens=lens_d)
        if pooled is not None:
            write_slots(self._cp, hys, cys, b, pooled, index_d)
        if last_only:
            y = self._last(y, b, t, lens, lens_d)
        return y, hy, cy, out_dtype

    def forward_blocks(self, x: Any, lengths: Any = None,
                       states: Sequence[BlockState] | None = None) -> tuple[Any, list[BlockState]]:
        """Per-block states (see :mod:`service.engines.base`), for any mix of state widths.

        ``states`` may be NumPy or CuPy; the returned states are CuPy arrays in the
        engine's output dtype that stay on the GPU (what stateful streams keep between
        chunks); ``output`` is a host array as from :meth:`forward`.
        """
        launched = self.launch_blocks(x, lengths, states)
        launched.wait()
        return launched.finish()

    def launch_blocks(self, x: Any, lengths: Any = None, states: Sequence[BlockState] | None = None) -> Launched:
        """:meth:`forward_blocks` queued without waiting (see :meth:`launch`); ``finish()`` gives (output, states)."""
        x, b, t, lens, out_dtype = self._check(x, lengths, None, None)
        if states is not None:
            check_block_states(self.spec, states, b)
        cp, conv = self._cp, self._conv
        with self._lock, self._ctx.device, self._ctx.stream:
            x_d, _, _, lens_d, _ = self._staging.upload_inputs(conv, x, None, None, lens, t, self._ctx.stream)
            views = None
            if states is not None:
                views = [tuple(None if a is None else conv.to_store(seq_major(cp, a)) for a in st) for st in states]
            y, _, _, hys, cys = self._run(x_d, b, t, lens, lengths is None, views, ragged_lens=lens_d)
            finals = [tuple(None if a is None else swap01(cp, conv.from_store(a, out_dtype)) for a in st)
                      for st in zip(hys, cys)]
            launched = self._download(y, None, None, out_dtype, False)
            return Launched(launched.event, lambda: (launched.finish().output, finals))

    # -- forward pieces ---------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._ctx is None:
            raise EngineUnavailable("this cuDNN engine was closed")

    def _check(self, x, lengths, h0, c0):
        self._ensure_open()
        on_device = isinstance(x, self._cp.ndarray)
        if not on_device and not isinstance(x, HostRows):
            x = np.asarray(x)
        b, t, lens = check_forward_args(self.spec, x, lengths, h0, c0, self._cp if on_device else np)
        out_dtype = np.dtype(np.float16 if self.precision == "float16" and x.dtype == np.float16 else np.float32)
        return x, b, t, lens, out_dtype

    def _new_states(self, n):
        """Output states for ``n`` sequences (see :func:`.block_states.new_states`)."""
        return new_states(self._cp, self.spec, self._prec.store, n, self._uniform_h, self._uniform_c)

    def _run(self, x_d, b, t, lens, uniform_lengths, states, pad_ok=False, zero_padding=True, ragged_lens=None):
        """Plan and run one call; returns (y, hy, cy, hys, cys): whole states (or None) and per-block views.

        ``pad_ok``: the plan may run a ragged batch at the full ``t`` for every sequence; the
        outputs past each length are then zeroed (unless not ``zero_padding``: the caller reads
        none of them) and the final states are not valid (all None). ``ragged_lens``: ``lens``
        as int32 on the device, when the caller has uploaded them already.
        """
        cp = self._cp
        key = (b, t)
        groups = self._plans.get(key) if uniform_lengths else None
        if groups is None:
            groups = plan(self._table, b, t, lens, pad_ok)
            if uniform_lengths and len(self._plans) < 1024:
                self._plans[key] = groups
        g = groups[0] if len(groups) == 1 and groups[0].rows is None else None
        ragged = int(lens.min()) < t
        # A padded run (see the docstring). Equal lengths too where the plan may pad and no states come in: their
        # graph is then one of the step grid's, not one per length (single requests of 20..200 steps: 181 shapes)
        if g is not None and g.uniform and (ragged or (pad_ok and states is None)):
            lens_key, lens_host, lens_dev = self._uniform(b, t)
            shape = self._shapes.padded(b, t) if states is None else None
            y, _, _ = self._run_blocks(x_d, b, t, lens_key, lens_host, lens_dev, states, g.algos, g.seq_major,
                                       graph_shape=shape, finals=False)
            y = y[:, :t]  # a bucketed graph ran more steps
            if zero_padding and ragged:
                y = self._zero_past(y, t, lens, ragged_lens)
            return y, None, None, None, None
        if groups[0].padded:  # chunks, each run padded (see autotune.plan): no valid final states either
            y = self._run_groups(groups, x_d, b, t, states, None, None)
            if zero_padding:
                y = self._zero_past(y, t, lens, ragged_lens)
            return y, None, None, None, None
        hy, cy, hys, cys = self._new_states(b)
        if g is not None:
            if g.uniform:
                lens_key, lens_host, lens_dev = self._uniform(b, t)
            else:
                lens_host = lens.astype(np.int32)
                lens_key = (b, t, lens_host.tobytes())
                lens_dev = ragged_lens if ragged_lens is not None else cp.asarray(lens_host)
            y, _, _ = self._run_blocks(x_d, b, t, lens_key, lens_host, lens_dev, states, g.algos, g.seq_major,
                                       (hys, cys))
        else:
            y = self._run_groups(groups, x_d, b, t, states, hys, cys)
        return y, hy, cy, hys, cys

    def _zero_past(self, y, t, lens, lens_dev=None):
        """``y`` [b, t, F] with the steps past each row's length zeroed (a padded run computed them)."""
        cp = self._cp
        if lens_dev is None:
            lens_dev = cp.asarray(lens.astype(np.int32))
        y *= (cp.arange(t, dtype=cp.int32)[None, :] < lens_dev[:, None])[:, :, None]
        return y

    def _last(self, y, b, t, lens, lens_dev=None):
        """Each sequence's many-to-one output row [b, F] of ``y`` (storage dtype), on the device."""
        cols = forward_cols(self.spec, int(y.shape[2]))
        if int(lens.min()) == t:
            lens_dev = self._uniform(b, t)[2]
        elif lens_dev is None:
            lens_dev = self._cp.asarray(lens.astype(np.int32))
        return last_steps(self._cp, y, lens_dev, cols)

    def _uniform(self, n: int, t: int):
        hit = self._uniform_lengths.get((n, t))
        if hit is None:
            host = np.full(n, t, dtype=np.int32)
            if len(self._uniform_lengths) > 1024:
                self._uniform_lengths.clear()
            hit = self._uniform_lengths[(n, t)] = ((n, t, None), host, self._cp.asarray(host))
        return hit

    def _run_blocks(self, x, n, t, lens_key, lens_host, lens_dev, states, algos, seq_major=False, out=None,
                    graph_shape=None, finals=True):
        """All blocks on one batch; returns (y [n,t,F], hys, cys) in storage dtype.

        ``states`` is None (zeros) or per block (h [rows, n, Ho] | None, c [rows, n, H] | None);
        ``out`` is (hys, cys), per-block buffers for the final states (allocated when None).
        With ``seq_major`` the blocks run on [t, n, F] buffers and y is a transposed view of one.
        A CUDA graph replays the call where one exists, at ``graph_shape`` (a padded call's
        bucketed shape) or at the bucket rows of an equal-length call (see :mod:`.shape_buckets`);
        y then has at least ``t`` steps. ``finals`` False: nobody reads the final states (a padded
        run), so a replay copies none out and they may come back None.
        """
        cp, store = self._cp, self._prec.store
        hys, cys = out if out is not None else (None, None)
        if self._graphs is not None:
            if finals and hys is None:
                hys, cys = self._new_states(n)[2:]
            y = self._replay(x, n, t, lens_key, lens_host, lens_dev, states, algos, seq_major, hys, cys, graph_shape)
            if y is not None:
                return y, hys, cys
        if hys is None:
            hys, cys = self._new_states(n)[2:]
        inp = swap01(cp, x) if seq_major else x
        lens_ptr = lens_dev.data.ptr
        for k, (runner, algo) in enumerate(zip(self._runners, algos)):
            h_in, c_in = states[k] if states is not None else (None, None)
            y = cp.empty((t, n, runner.out_features) if seq_major else (n, t, runner.out_features), store)
            hx_p = h_in.data.ptr if h_in is not None else 0
            hy_p = hys[k].data.ptr
            cx_p = c_in.data.ptr if c_in is not None else 0
            cy_p = cys[k].data.ptr if cys[k] is not None else 0
            try:
                runner.forward(algo, n, t, lens_key, lens_host, lens_ptr, inp.data.ptr, y.data.ptr,
                               hx_p, hy_p, cx_p, cy_p, seq_major)
            except (L.CudnnError, AlgorithmRejected):
                if algo == L.ALGO_STANDARD:
                    raise
                # A persistent kernel refused a shape the autotuner did not time (e.g. an odd batch
                # inside a bucket): run STANDARD instead, which accepts every shape.
                runner.forward(L.ALGO_STANDARD, n, t, lens_key, lens_host, lens_ptr, inp.data.ptr, y.data.ptr,
                               hx_p, hy_p, cx_p, cy_p, seq_major)
            inp = y
        return (inp.transpose(1, 0, 2) if seq_major else inp), hys, cys

    def _replay(self, x, n, t, lens_key, lens_host, lens_dev, states, algos, seq_major, hys, cys, shape):
        """The call replayed as a CUDA graph (see :meth:`_run_blocks`), or None when the caller runs it."""
        if shape is None:
            shape = self._shapes.rows(n, t) if lens_key[-1] is None else (n, t)
        if shape != (n, t):
            lens_key, lens_host, lens_dev = self._uniform(*shape)
            algos = self._table.algos_for(*shape)
        y = self._graphs.run(x, shape[0], shape[1], lens_key, lens_host, lens_dev, states, algos, seq_major, hys, cys)
        return y if y is None or shape[0] == n else y[:n]

    def _run_groups(self, groups: list[Group], x, b, t, states, hys, cys):
        """Equal-length groups or padded chunks (see autotune.plan), each gathered, run and scattered back into
        hys/cys (None: chunks, whose final states are not valid)."""
        cp, store = self._cp, self._prec.store
        y = cp.zeros((b, t, self.spec.output_size), store)
        for g in groups:
            rows = g.rows if isinstance(g.rows, slice) else cp.asarray(g.rows)
            if isinstance(rows, slice) and g.steps == t:
                xg = x[rows]
            else:
                xg = cp.ascontiguousarray(x[rows, :g.steps])
            states_g = None if states is None else [
                tuple(None if a is None else cp.ascontiguousarray(a[:, rows]) for a in st) for st in states]
            lens_key, lens_host, lens_dev = self._uniform(g.n, g.steps)
            shape = self._shapes.padded(g.n, g.steps) if g.padded and states_g is None else None
            yg, hyg, cyg = self._run_blocks(xg, g.n, g.steps, lens_key, lens_host, lens_dev, states_g,
                                            g.algos, g.seq_major, graph_shape=shape, finals=not g.padded)
            if yg.shape[1] != g.steps:
                yg = yg[:, :g.steps]  # a graph of a bucketed shape ran more steps
            if g.steps == t:
                y[rows] = yg
            else:
                y[rows, :g.steps] = yg
            if hys is None:
                continue
            for k in range(len(hys)):
                hys[k][:, rows] = hyg[k]
                if cys[k] is not None:
                    cys[k][:, rows] = cyg[k]
        return y

    def _outputs(self, y, hy, cy, out_dtype, output_device) -> EngineOutput:
        """Results in the caller's dtype: CuPy arrays (``output_device="device"``) or host arrays, waited for."""
        if output_device == "host":
            launched = self._download(y, hy, cy, out_dtype, False)
            launched.wait()
            return launched.finish()
        cp, conv = self._cp, self._conv
        y = conv.from_store(y, out_dtype)
        hy = None if hy is None else conv.from_store(hy, out_dtype)
        cy = None if cy is None else conv.from_store(cy, out_dtype)
        h_n = None if hy is None else swap01(cp, hy)
        c_n = None if cy is None else swap01(cp, cy)
        return EngineOutput(y, h_n, c_n)

    def _download(self, y, hy, cy, out_dtype, last_only: bool) -> Launched:
        """Queue the results' copies to pinned host memory (see :func:`.transfer.download_results`)."""
        return download_results(self._cp, self._conv, self._ctx.stream, self._blocking_sync, y, hy, cy, out_dtype,
                                last_only)
