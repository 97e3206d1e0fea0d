"""Test helper: torch.nn.LSTM/GRU/RNN modules, the same weights as an rnnserve PackedModel, and
the float64 torch answer an engine's float32 output is held to."""
from __future__ import annotations

import numpy as np
import torch

from service.loaders.verify import ATOL, RTOL
from service.packing import LayerWeights, pack_block
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec

MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}


def torch_module(cell: str, i: int, h: int, layers: int, bidir: bool, proj: int = 0, seed: int = 0):
    """A batch-first torch module of ``cell`` with seeded random weights."""
    torch.manual_seed(seed)
    kw = {"proj_size": proj} if proj else {}
    if cell.startswith("rnn"):
        kw["nonlinearity"] = cell[4:]
    return MODULES[cell](i, h, num_layers=layers, bidirectional=bidir, batch_first=True, **kw)


def packed_from_torch(mod, cell: str, variant: dict | None = None) -> PackedModel:
    """``mod``'s weights (float64) in rnnserve's canonical packed layout, one block.

    ``variant``: the block's variant (e.g. ``{"reset_before": True}``); the weights stay torch's,
    so the model then computes something torch does not."""
    sd = {k: v.detach().double().numpy() for k, v in mod.state_dict().items()}
    d = 2 if mod.bidirectional else 1
    spec = BlockSpec(cell, mod.input_size, mod.hidden_size, mod.num_layers, mod.bidirectional,
                     getattr(mod, "proj_size", 0), variant or {})
    layers = []
    for layer in range(mod.num_layers):
        for direction in range(d):
            s = f"_l{layer}" + ("_reverse" if direction else "")
            layers.append(LayerWeights(sd["weight_ih" + s], sd["weight_hh" + s], sd["bias_ih" + s], sd["bias_hh" + s],
                                       sd.get("weight_hr" + s)))
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, layers, np.float64)])


def run_torch(mod, cell: str, x: np.ndarray, lengths: np.ndarray, h0: np.ndarray | None, c0: np.ndarray | None,
              dtype: type = np.float64):
    """torch on a packed sequence, in ``dtype`` (float64 by default: the exact answer a float32 engine is held to).

    ``x`` [B, T, in]; ``h0``/``c0`` [B, L*D, H] (rnnserve's batch-major states) or None.
    Returns (output [B, T, D*Ho], h_n [B, L*D, Ho], c_n or None)."""
    mod = mod.double() if dtype == np.float64 else mod.float()
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.from_numpy(x.astype(dtype)), torch.as_tensor(lengths),
                                                     batch_first=True, enforce_sorted=False)
    state = None
    if h0 is not None:
        h = torch.from_numpy(h0.astype(dtype)).transpose(0, 1).contiguous()
        state = (h, torch.from_numpy(c0.astype(dtype)).transpose(0, 1).contiguous()) if cell == "lstm" else h
    with torch.no_grad():
        y, hn = mod(packed, state)
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
    if cell == "lstm":
        return y.numpy(), hn[0].transpose(0, 1).numpy(), hn[1].transpose(0, 1).numpy()
    return y.numpy(), hn.transpose(0, 1).numpy(), None


def assert_close(out, y: np.ndarray, hn: np.ndarray, cn: np.ndarray | None) -> None:
    """An EngineOutput matches (y, h_n, c_n) within the fp32 conversion tolerance."""
    np.testing.assert_allclose(out.output, y, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out.h_n, hn, rtol=RTOL, atol=ATOL)
    if cn is not None:
        np.testing.assert_allclose(out.c_n, cn, rtol=RTOL, atol=ATOL)
