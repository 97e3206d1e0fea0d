"""copy_sequences: the GIL-holding row copy of the scheduler's merge equals NumPy's assignment."""
from __future__ import annotations

import numpy as np
import pytest

from service.scheduler.rowcopy import copy_sequences


@pytest.mark.parametrize("b, ts, t, steps, row", [
    (1, 7, 7, 7, 0),      # whole rows on both sides: one copy
    (3, 7, 7, 7, 2),
    (3, 5, 9, 5, 1),      # shorter request in a longer batch
    (2, 9, 6, 6, 4),      # client padding past the batch's longest valid length
    (4, 9, 9, 3, 0),
    (1, 1, 1, 1, 5),
    (7, 5, 11, 5, 3),     # many rows of a merged message: one NumPy copy
])
def test_copy_sequences_matches_numpy(b: int, ts: int, t: int, steps: int, row: int) -> None:
    rng = np.random.default_rng(b * 100 + ts)
    src = rng.standard_normal((b, ts, 5)).astype(np.float32)
    dst = rng.standard_normal((row + b + 2, t, 5)).astype(np.float32)
    want = dst.copy()
    want[row:row + b, :steps] = src[:, :steps]
    copy_sequences(dst, row, src, steps)
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("src", [
    np.arange(2 * 6 * 3, dtype=np.float64).reshape(2, 6, 3),                       # other dtype
    np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6)[:, :, ::2],             # not contiguous
])
def test_copy_sequences_falls_back_to_numpy(src: np.ndarray) -> None:
    dst = np.zeros((3, 6, 3), np.float32)
    want = dst.copy()
    want[1:3, :4] = src[:, :4]
    copy_sequences(dst, 1, src, 4)
    np.testing.assert_array_equal(dst, want)


def test_many_rows_copy_the_same_on_a_worker_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(9)
    src = rng.standard_normal((7, 5, 3)).astype(np.float32)
    dst = np.zeros((9, 8, 3), np.float32)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(copy_sequences, dst, 1, src, 5).result()
    want = np.zeros_like(dst)
    want[1:8, :5] = src
    np.testing.assert_array_equal(dst, want)
