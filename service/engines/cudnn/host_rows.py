"""A batch input left where its rows lie: device-mapped host memory, gathered on the GPU at upload.

:func:`host_rows` describes a batch [N, T, F] whose requests lie in mapped front-end arenas
(:mod:`.mapped`) as a table of row addresses instead of merging them into one host buffer;
the engine uploads the table with the batch's other small inputs and one kernel
(:func:`.copies.gather_rows`) writes the padded batch on the device. What reaches the engine
is exactly what :func:`service.scheduler.batching.merge` would have built: each request's rows
up to the batch's length (its own padding included), zeros after.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mapped import MappedHost

_MAX_UNIT = 16  # widest copy unit of the gather kernel (bytes)


@dataclass(eq=False)
class HostRows:
    """Batch input [N, T, F] as N rows in device-mapped host memory (see the module docstring).

    ``table`` int64 [2, N]: each row's device address and how many of its bytes are valid (the
    rest of the row is zeros); ``unit``: the copy width in bytes (divides every address, the valid
    bytes and the row); ``sources``: the arrays the rows lie in, kept alive until the batch is done.
    """

    shape: tuple[int, int, int]
    dtype: np.dtype
    table: np.ndarray
    unit: int
    sources: list[np.ndarray]

    @property
    def ndim(self) -> int:
        """3, as the [N, T, F] array it stands for (what input checks read)."""
        return 3


def host_rows(mapped: MappedHost, xs: list[np.ndarray], t_max: int, dtype: np.dtype, device: int
              ) -> HostRows | None:
    """The batch of requests ``xs`` (each [b, Ts, F]) padded to ``t_max`` steps, as HostRows; None unless every
    one is a C-contiguous ``dtype`` array in memory ``device`` can read (then the caller merges on the host)."""
    feat = int(xs[0].shape[2])
    step_bytes = feat * dtype.itemsize
    align = t_max * step_bytes | _MAX_UNIT
    addresses: list[int] = []
    valid: list[int] = []
    locate = mapped.device_address
    for x in xs:
        if x.dtype != dtype or not x.flags.c_contiguous or x.shape[2] != feat:
            return None
        b, t = x.shape[0], x.shape[1]
        address = locate(x.ctypes.data, x.nbytes, device)
        if address is None:
            return None
        pitch = t * step_bytes
        keep = (t if t < t_max else t_max) * step_bytes
        align |= address | pitch | keep
        addresses.extend(range(address, address + pitch * b, pitch))
        valid.extend((keep,) * b)
    n = len(addresses)
    table = np.array(addresses + valid, dtype=np.int64).reshape(2, n)
    unit = align & -align  # the largest power of two dividing every address and length, at most _MAX_UNIT
    return HostRows((n, t_max, feat), dtype, table, unit, list(xs))
