"""MemoryBudget: how much working memory one engine call of a model may take.

``--max-request-bytes`` bounds what a request carries, not what it costs inside the
engine: a model with few input features and a wide bidirectional layer turns a 1 x T
input into T x 2H activations per layer (and cuDNN's workspace holds every gate's
input projection for every step). A request of a few MB could then exhaust host or
device memory; on the CPU the OS kills the process and every model with it.

So each loaded model version has a budget: the bytes one engine call may use, from
``max_batch_memory_mb`` (0, the default: a quarter of the memory of the machine or, for
the GPU engine, of the smaller of host and device memory). A batch's cost is
``rows x padded steps x`` :func:`step_bytes` (engines compute every row to the batch's
longest valid length). Validation refuses a request that alone is over it
(RESOURCE_EXHAUSTED, HTTP 413, saying what to send instead); the scheduler and the
front-ends' coalescing never grow a batch past it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TooLarge
from ..spec import RNNSpec

_MIB = 1024 * 1024
# cgroup v2, then v1: a container's limit is what the OS kills at, not the machine's RAM
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def step_bytes(spec: RNNSpec) -> int:
    """Estimated bytes of engine working memory per sequence per (padded) time step, in float32.

    Counts every layer's gate projections for every direction (G x H each: cuDNN's
    workspace holds them all for the whole call; measured on an H100, a 2-layer
    bidirectional LSTM took 88 % of an estimate that counted one layer's); for the layer
    that needs most, its input and a reversed copy, and its outputs twice (each
    direction's, and the directions joined); plus the model's input twice and its final
    output three times (the engine's result, its batch-major copy and the request's
    answer). Over what the NumPy engine holds at its peak and what the cuDNN engine takes
    from the device (tests/serving/test_memory_budget.py, on the CPU and the GPU).
    """
    gates = widest = 0
    for blk in spec.blocks:
        d = blk.directions
        gates += blk.num_layers * d * blk.gates * blk.hidden_size
        for layer in range(blk.num_layers):
            widest = max(widest, 2 * blk.layer_input_size(layer) + 2 * d * blk.output_size)
    return 4 * (2 * spec.input_size + gates + widest + 3 * spec.output_size)


def host_memory_bytes() -> int:
    """This machine's memory, or the container's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes one engine call of a model may use, and what one padded sequence-step costs."""

    limit_bytes: int
    step_bytes: int

    @classmethod
    def of(cls, spec: RNNSpec, max_batch_memory_mb: int, engine: Any = None) -> "MemoryBudget":
        """The budget for ``spec``: ``max_batch_memory_mb`` MiB, or when 0 a quarter of the engine's memory.

        ``engine.device_memory_bytes()`` (the GPU engine) counts too, when the engine has it.
        """
        if max_batch_memory_mb > 0:
            limit = max_batch_memory_mb * _MIB
        else:
            memory = host_memory_bytes()
            device = getattr(engine, "device_memory_bytes", None)
            if device is not None:
                memory = min(memory, int(device()))
            limit = memory // 4
        return cls(int(limit), step_bytes(spec))

    @property
    def max_steps(self) -> int:
        """Padded sequence-steps (rows x longest length) one engine call may hold; at least one."""
        return max(1, self.limit_bytes // self.step_bytes)

    def fits(self, rows: int, steps: int) -> bool:
        """Whether ``rows`` sequences padded to ``steps`` steps fit in one engine call."""
        return rows * steps <= self.max_steps

    def check(self, rows: int, steps: int, model: str) -> None:
        """TooLarge (saying what to send instead) unless a request of ``rows`` x ``steps`` fits alone."""
        if self.fits(rows, steps):
            return
        need = rows * steps * self.step_bytes
        limit = f"{self.limit_bytes / _MIB:,.{0 if self.limit_bytes % _MIB == 0 else 1}f}"
        raise TooLarge(
            f"{rows} sequence(s) of {steps} steps would need about {need / _MIB:,.1f} MiB of engine memory for model "
            f"'{model}' ({self.step_bytes:,} bytes per sequence step), over its max_batch_memory_mb of "
            f"{limit} MiB; send at most {self.max_steps:,} sequence steps per request "
            f"(sequences x longest length: fewer or shorter sequences), or raise max_batch_memory_mb in the "
            f"model's config.json (or --max-batch-memory-mb)"
        )
