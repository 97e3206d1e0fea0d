"""Which result layouts the cuDNN engine downloads in one 2-D copy (service.engines.cudnn.transfer).

The predicate reads only shapes and strides, so NumPy arrays stand in for device arrays here; the
copies themselves are checked on the GPU (test_cudnn_copies_gpu.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from service.engines.cudnn.transfer import blocks_with_pitch

BUF = np.zeros((8, 12, 13), np.float32)   # a graph's [rows, steps, F] output buffer
SEQ = np.zeros((12, 8, 13), np.float32)   # a sequence-major [steps, rows, F] buffer


@pytest.mark.parametrize("view", [BUF, BUF[:5], BUF[:, :7], BUF[:5, :7], SEQ[:7, :5], BUF[::2], np.zeros((0, 3, 4))],
                         ids=["whole", "first rows", "first steps", "rows and steps", "seq-major rows",
                              "every other row", "empty"])
def test_blocks_at_a_fixed_pitch_go_in_one_copy(view):
    assert blocks_with_pitch(view)


@pytest.mark.parametrize("view", [BUF[:, :, :3], BUF.transpose(1, 0, 2), SEQ[:7, :5].transpose(1, 0, 2),
                                  BUF[0], BUF[:, ::2]],
                         ids=["cut features", "transposed", "seq-major rows as [B, T, F]", "2-D", "every other step"])
def test_other_layouts_do_not(view):
    assert not blocks_with_pitch(view)
