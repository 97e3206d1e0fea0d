"""The canonical layout matches what cuDNN 9.19 reported (layouts.md 1.4) and packing round-trips."""
from __future__ import annotations

import numpy as np
import pytest

from service.errors import ConversionError
from service.packing import LayerWeights, block_layout, block_param_count, pack_block, unpack_block
from service.spec import BlockSpec, RNNSpec


def test_lstm_3_5_matrices_then_biases():
    # Measured on an H200: LSTM(3,5) matrices at floats 0-159, biases 160-199.
    spec = BlockSpec("lstm", 3, 5)
    entries = block_layout(spec)
    mats = [e for e in entries if e.kind == "matrix"]
    biases = [e for e in entries if e.kind == "bias"]
    assert [e.lin_id for e in mats] == list(range(8))
    assert mats[0].offset == 0 and mats[-1].offset + mats[-1].size == 160
    assert biases[0].offset == 160 and block_param_count(spec) == 200
    assert [e.shape for e in mats[:4]] == [(5, 3)] * 4 and [e.shape for e in mats[4:]] == [(5, 5)] * 4


def test_projection_is_id_8_after_recurrent_matrices():
    # in=3, h=5, p=2: ids 4-7 are [5,2], id 8 is [2,5], layer-1 input matrices are [5,2].
    spec = BlockSpec("lstm", 3, 5, num_layers=2, proj_size=2)
    entries = [e for e in block_layout(spec) if e.kind == "matrix"]
    layer0 = [e for e in entries if e.pseudo_layer == 0]
    assert [e.lin_id for e in layer0] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert layer0[4].shape == (5, 2) and layer0[8].shape == (2, 5)
    assert [e for e in entries if e.pseudo_layer == 1][0].shape == (5, 2)
    assert not any(e.lin_id == 8 for e in block_layout(spec) if e.kind == "bias")


def test_bidirectional_gru_layer1_reads_both_directions():
    spec = BlockSpec("gru", 4, 5, num_layers=2, bidirectional=True)
    p2 = [e for e in block_layout(spec) if e.kind == "matrix" and e.pseudo_layer == 2]
    assert p2[0].shape == (5, 10) and p2[3].shape == (5, 5)
    assert spec.pseudo_layers == 4


@pytest.mark.parametrize("cell,proj", [("lstm", 0), ("lstm", 4), ("gru", 0), ("rnn_tanh", 0), ("rnn_relu", 0)])
def test_pack_unpack_roundtrip(cell, proj):
    spec = BlockSpec(cell, 7, 13, num_layers=3, bidirectional=True, proj_size=proj)
    rng = np.random.default_rng(0)
    g, h, ho = spec.gates, spec.hidden_size, spec.output_size
    layers = [LayerWeights(rng.standard_normal((g * h, spec.layer_input_size(p // 2))),
                           rng.standard_normal((g * h, ho)), rng.standard_normal(g * h), rng.standard_normal(g * h),
                           rng.standard_normal((ho, h)) if proj else None) for p in range(6)]
    flat = pack_block(spec, layers, dtype=np.float64)
    assert flat.shape == (block_param_count(spec),)
    back = unpack_block(spec, flat)
    for a, b in zip(layers, back):
        np.testing.assert_array_equal(a.w, b.w)
        np.testing.assert_array_equal(a.r, b.r)
        np.testing.assert_array_equal(a.bw, b.bw)
        np.testing.assert_array_equal(a.br, b.br)
        if proj:
            np.testing.assert_array_equal(a.proj, b.proj)
    # gate k of weight_ih is linLayerID k: a row-major [H, in] block
    for e in block_layout(spec)[:g]:
        np.testing.assert_array_equal(flat[e.offset:e.offset + e.size].reshape(e.shape),
                                      layers[0].w[e.lin_id * h:(e.lin_id + 1) * h])


def test_pack_rejects_wrong_shapes_and_nan():
    spec = BlockSpec("gru", 3, 4)
    good = LayerWeights(np.zeros((12, 3)), np.zeros((12, 4)), np.zeros(12), np.zeros(12))
    with pytest.raises(ConversionError, match=r"input matrix has shape \(12, 5\), expected \(12, 3\)"):
        pack_block(spec, [LayerWeights(np.zeros((12, 5)), good.r, good.bw, good.br)])
    bad = np.zeros(12)
    bad[3] = np.nan
    with pytest.raises(ConversionError, match="NaN"):
        pack_block(spec, [LayerWeights(good.w, good.r, bad, good.br)])
    with pytest.raises(ConversionError, match="1 \\(layer, direction\\) pairs but 2"):
        pack_block(spec, [good, good])
    with pytest.raises(ConversionError, match="no projection matrix"):
        pack_block(BlockSpec("lstm", 3, 4, proj_size=2),
                   [LayerWeights(np.zeros((16, 3)), np.zeros((16, 2)), np.zeros(16), np.zeros(16))])


def test_causal_means_every_block_reads_forward():
    fwd = BlockSpec("lstm", 4, 8, num_layers=2)
    assert RNNSpec((fwd,)).causal
    assert RNNSpec((fwd, BlockSpec("gru", 8, 6))).causal
    assert not RNNSpec((fwd, BlockSpec("gru", 8, 6, bidirectional=True))).causal
    assert not RNNSpec((BlockSpec("gru", 4, 6, variant={"reverse": True}),)).causal


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("layers,bidirectional,proj", [(1, False, 0), (3, True, 0), (2, False, 3), (4, True, 2)])
def test_the_closed_form_count_is_what_the_layout_spans(cell, layers, bidirectional, proj):
    spec = BlockSpec(cell, 7, 5, layers, bidirectional, proj if cell == "lstm" else 0)
    last = block_layout(spec)[-1]
    assert block_param_count(spec) == last.offset + last.size


def test_counting_a_huge_layer_count_costs_nothing():
    # a corrupt file's spec said 10^12 layers: counting built the layout, minutes and gigabytes for a 2 KB tensor
    spec = BlockSpec("lstm", 1, 32, 10**12)
    assert block_param_count(spec) > 10**15
