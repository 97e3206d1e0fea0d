"""Test helper: torch.nn.LSTM/GRU/RNN modules and the same weights as an rnnserve PackedModel."""
from __future__ import annotations

import numpy as np
import torch

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


def packed_from_torch(mod, cell: str) -> PackedModel:
    """``mod``'s weights (float64) in rnnserve's canonical packed layout, one block."""
    sd = {k: v.detach().double().numpy() for k, v in mod.state_dict().items()}
    d = 2 if mod.bidirectional else 1
    spec = BlockSpec(cell, mod.input_size, mod.hidden_size, mod.num_layers, mod.bidirectional,
                     getattr(mod, "proj_size", 0))
    layers = []
    for layer in range(mod.num_layers):
        for direction in range(d):
            s = f"_l{layer}" + ("_reverse" if direction else "")
            layers.append(LayerWeights(sd["weight_ih" + s], sd["weight_hh" + s], sd["bias_ih" + s], sd["bias_hh" + s],
                                       sd.get("weight_hr" + s)))
    return PackedModel(RNNSpec((spec,)), [pack_block(spec, layers, np.float64)])
