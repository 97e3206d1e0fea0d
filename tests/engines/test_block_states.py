"""Per-block state buffers of the cuDNN engine (service.engines.cudnn.block_states), with NumPy standing
in for CuPy: the views are the right rows of the whole arrays, and a block spanning a whole array gets
the array itself."""
from __future__ import annotations

import numpy as np

from service.engines.cudnn.block_states import block_views, new_states
from service.spec import BlockSpec, RNNSpec


def _spec(*blocks: BlockSpec) -> RNNSpec:
    return RNNSpec(tuple(blocks))


def test_one_block_uses_the_whole_arrays():
    spec = _spec(BlockSpec("lstm", 5, 6, 2))
    h0, c0 = np.zeros((2, 3, 6)), np.zeros((2, 3, 6))
    (h, c), = block_views(spec, h0, c0)
    assert h is h0 and c is c0
    hy, cy, hys, cys = new_states(np, spec, np.float32, 3, True, True)
    assert hys[0] is hy and cys[0] is cy and hy.shape == (2, 3, 6)
    assert block_views(spec, None, None) is None


def test_blocks_get_their_rows():
    spec = _spec(BlockSpec("lstm", 5, 6, 1, bidirectional=True), BlockSpec("gru", 12, 6, 2))
    h0 = np.arange(4 * 3 * 6, dtype=np.float32).reshape(4, 3, 6)
    c0 = np.arange(2 * 3 * 6, dtype=np.float32).reshape(2, 3, 6)
    (h_a, c_a), (h_b, c_b) = block_views(spec, h0, c0)
    np.testing.assert_array_equal(h_a, h0[0:2])
    np.testing.assert_array_equal(h_b, h0[2:4])
    assert c_a is c0 and c_b is None  # only the LSTM block has c rows, and it has them all
    h_a[...] = -1  # views: writing a block's rows writes the whole array
    assert np.all(h0[0:2] == -1) and np.all(h0[2:4] >= 0)
    hy, cy, hys, cys = new_states(np, spec, np.float32, 3, True, True)
    assert hys[0].shape == hys[1].shape == (2, 3, 6) and np.shares_memory(hys[1], hy)
    assert cys[0] is cy and cys[1] is None
    assert block_views(spec, h0, None)[0][1] is None


def test_different_widths_get_their_own_buffers():
    spec = _spec(BlockSpec("lstm", 5, 7, 1), BlockSpec("gru", 7, 3, 2))
    hy, cy, hys, cys = new_states(np, spec, np.float16, 4, False, True)
    assert hy is None and cys[0] is cy
    assert hys[0].shape == (1, 4, 7) and hys[1].shape == (2, 4, 3) and hys[1].dtype == np.float16
