"""Map one Keras recurrent layer (raw Keras weights + config) to a canonical RecurrentLayer.

Per layouts.md section 7: kernels are transposed; Keras GRU gates z, r, h become
canonical r, z, n; Keras LSTM (i, f, c, o) already matches i, f, g, o. A single Keras
bias goes to ``bw`` with zeros in ``br`` (only the sum matters, except for GRU
reset_after, whose two bias rows map to ``bw`` and ``br``). GRU reset_after=False is
the ``reset_before`` variant; go_backwards on a unidirectional layer is ``reverse``;
gate activations other than the defaults become the ``activations`` variant.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConversionError
from ..packing import LayerWeights
from .keras_files import KerasLayer
from .layers import RecurrentLayer

_GATES = {"LSTM": 4, "CuDNNLSTM": 4, "GRU": 3, "CuDNNGRU": 3, "SimpleRNN": 1}
_GRU_TO_CANON = (1, 0, 2)   # canonical r, z, n taken from Keras blocks z, r, h


def activation(value: Any, keras3: bool, where: str) -> dict[str, Any]:
    """A Keras activation (name or serialized function) as {"name", "alpha", "beta"} with ONNX meaning.

    Keras 2's hard_sigmoid is clip(0.2x + 0.5); Keras 3's is clip(x/6 + 0.5).
    """
    if isinstance(value, dict):  # Keras 3 serializes functions as {"class_name": "function", "config": "tanh"}
        value = value.get("config") if isinstance(value.get("config"), str) else value.get("class_name")
    name = "linear" if value is None else str(value).lower()
    table = {
        "sigmoid": ("sigmoid", 0.0, 0.0), "tanh": ("tanh", 0.0, 0.0), "relu": ("relu", 0.0, 0.0),
        "linear": ("affine", 1.0, 0.0), "softsign": ("softsign", 0.0, 0.0), "softplus": ("softplus", 0.0, 0.0),
        "elu": ("elu", 1.0, 0.0),
        "hard_sigmoid": ("hard_sigmoid", 1.0 / 6.0, 0.5) if keras3 else ("hard_sigmoid", 0.2, 0.5),
    }
    if keras3:
        table["leaky_relu"] = ("leaky_relu", 0.2, 0.0)
    if name not in table:
        raise ConversionError(
            f"{where} uses activation '{name}', which rnnserve cannot compute; supported Keras activations: "
            f"{', '.join(sorted(table))}"
        )
    n, a, b = table[name]
    return {"name": n, "alpha": a, "beta": b}


def _blocks(mat: np.ndarray, order: tuple[int, ...], u: int) -> np.ndarray:
    return np.concatenate([mat[k * u:(k + 1) * u] for k in order], axis=0)


def canonical_weights(cls: str, w: dict[str, np.ndarray], where: str,
                      reset_after: bool | None = None) -> tuple[LayerWeights, int, int, bool]:
    """(weights in canonical order, input size, units, reset_after) for one direction.

    A GRU's bias shape tells its form (``reset_after``); a GRU without bias (``use_bias=False``) is told by
    ``reset_after``, its config's value, since the two forms compute differently with zero biases too."""
    gates = _GATES[cls]
    kernel, rec = w.get("kernel"), w.get("recurrent_kernel")
    if kernel is None or rec is None:
        raise ConversionError(f"{where}: the file lacks its kernel or recurrent_kernel")
    kernel, rec = np.asarray(kernel, np.float64), np.asarray(rec, np.float64)
    if kernel.ndim != 2 or rec.ndim != 2 or rec.shape[1] != gates * rec.shape[0] or kernel.shape[1] != rec.shape[1]:
        raise ConversionError(f"{where}: kernel {kernel.shape} and recurrent_kernel {rec.shape} do not fit a "
                              f"{cls} ({gates} gates); the layer type in the file is not what its weights hold")
    u, n_in = rec.shape[0], kernel.shape[0]
    wt, rt = kernel.T, rec.T
    bias = w.get("bias")
    zeros = np.zeros(gates * u)
    if bias is None and cls == "GRU":
        if reset_after is None:
            raise ConversionError(f"{where} has no bias, and the file's config does not say reset_after, which "
                                  f"decides what the layer computes; convert the whole saved model (.keras), "
                                  f"whose config says it")
        wt, rt = _blocks(wt, _GRU_TO_CANON, u), _blocks(rt, _GRU_TO_CANON, u)
        return LayerWeights(wt, rt, zeros, zeros), n_in, u, bool(reset_after)
    bias = zeros if bias is None else np.asarray(bias, np.float64)
    reset_after = False
    if cls in ("LSTM", "SimpleRNN"):
        if bias.shape != (gates * u,):
            raise ConversionError(f"{where}: bias has shape {bias.shape}, expected {(gates * u,)}")
        return LayerWeights(wt, rt, bias, zeros), n_in, u, False
    if cls == "CuDNNLSTM":
        if bias.shape != (8 * u,):
            raise ConversionError(f"{where}: CuDNNLSTM bias has shape {bias.shape}, expected {(8 * u,)}")
        return LayerWeights(wt, rt, bias[:4 * u], bias[4 * u:]), n_in, u, False
    wt, rt = _blocks(wt, _GRU_TO_CANON, u), _blocks(rt, _GRU_TO_CANON, u)
    if bias.shape == (2, 3 * u) or (cls == "CuDNNGRU" and bias.shape == (6 * u,)):
        bias = bias.reshape(2, 3 * u)
        bw, br, reset_after = _blocks(bias[0], _GRU_TO_CANON, u), _blocks(bias[1], _GRU_TO_CANON, u), True
    elif bias.shape == (3 * u,) and cls == "GRU":
        bw, br = _blocks(bias, _GRU_TO_CANON, u), zeros
    else:
        raise ConversionError(f"{where}: {cls} bias has shape {bias.shape}; expected (2, {3 * u}) (reset_after=True)"
                              f" or ({3 * u},) (reset_after=False)" + (f" or ({6 * u},)" if cls == "CuDNNGRU" else ""))
    return LayerWeights(wt, rt, bw, br), n_in, u, reset_after


def direction_activations(cls: str, cfg: dict[str, Any] | None, keras3: bool, recurrent_default: str,
                          where: str) -> list[dict[str, Any]]:
    """[f, g, h] (LSTM), [f, g] (GRU) or [f] (RNN) for one direction."""
    if cls.startswith("CuDNN"):
        cfg = {}  # cuDNN's equations: sigmoid gates, tanh candidate
    cfg = cfg or {}
    act = activation(cfg.get("activation", "tanh"), keras3, where)
    if cls == "SimpleRNN":
        return [act]
    rec = activation(cfg.get("recurrent_activation", "sigmoid" if cls.startswith("CuDNN") else recurrent_default),
                     keras3, where)
    return [rec, act, act] if _GATES[cls] == 4 else [rec, act]


def to_recurrent_layer(layer: KerasLayer, keras3: bool, recurrent_default: str, cell: str | None) -> RecurrentLayer:
    """Canonical RecurrentLayer for ``layer``; ``cell`` (from --cell) must agree with the layer."""
    where = f"layer '{layer.name}' ({'Bidirectional ' if layer.bidirectional else ''}{layer.class_name})"
    if layer.wrapper and layer.wrapper.get("merge_mode", "concat") != "concat":
        raise ConversionError(
            f"{where} merges its directions with merge_mode={layer.wrapper.get('merge_mode')!r}; rnnserve serves "
            f"concatenated directions only (merge_mode='concat'). If it is the last layer, rebuild the wrapper with "
            f"merge_mode='concat' around the same weights (model.get_layer(...).set_weights) and merge the two halves "
            f"of each answer on the client as {layer.wrapper.get('merge_mode')!r} does; else --select only the layers "
            f"before it"
        )
    if layer.wrapper and len(layer.weights) != 2:
        raise ConversionError(f"{where}: expected forward and backward weights, found {len(layer.weights)} sets")
    cfgs = layer.configs or [None] * len(layer.weights)
    dirs, acts, sizes, resets = [], [], set(), set()
    for d, w in enumerate(layer.weights):
        cls = layer.class_name
        cfg = cfgs[d] or {}
        lw, n_in, u, reset_after = canonical_weights(cls, w, where, cfg.get("reset_after"))
        if "reset_after" in cfg and cls == "GRU" and bool(cfg["reset_after"]) != reset_after:
            raise ConversionError(f"{where}: config says reset_after={cfg['reset_after']} but the bias shape "
                                  f"{np.shape(w.get('bias'))} says otherwise; the file is inconsistent")
        if cfg.get("time_major"):
            raise ConversionError(f"{where} has time_major=True; rnnserve reads batch-major sequences only")
        dirs.append(lw)
        sizes.add((n_in, u))
        resets.add(reset_after)
        acts.append(direction_activations(cls, cfg, keras3, recurrent_default, where))
    if len(sizes) != 1 or len(resets) != 1:
        raise ConversionError(f"{where}: the forward and backward layers differ in size or GRU form; "
                              f"rnnserve needs both directions alike")
    (n_in, u), reset_after = sizes.pop(), resets.pop()
    base = {"LSTM": "lstm", "CuDNNLSTM": "lstm", "GRU": "gru", "CuDNNGRU": "gru"}.get(layer.class_name)
    variant: dict[str, Any] = {}
    if base is None:  # SimpleRNN: the activation picks the cuDNN mode when it can
        names = {a[0]["name"] for a in acts}
        plain = len(names) == 1 and names <= {"tanh", "relu"} and all(a[0]["alpha"] == 0 for a in acts)
        base = f"rnn_{names.pop()}" if plain else "rnn_tanh"
        if not plain:
            variant["activations"] = acts
    else:
        defaults = ["sigmoid", "tanh", "tanh"][:len(acts[0])]
        if any([a["name"] for a in d_acts] != defaults for d_acts in acts):
            variant["activations"] = acts
        if base == "gru" and not reset_after:
            variant["reset_before"] = True
    if cell is not None and cell != base:
        raise ConversionError(f"--cell {cell} does not match {where}, which is a '{base}' layer; "
                              f"drop --cell or --select other layers")
    if not layer.bidirectional and cfgs[0] and cfgs[0].get("go_backwards"):
        variant["reverse"] = True
    if layer.bidirectional:
        if cfgs[0] and cfgs[0].get("go_backwards"):
            raise ConversionError(f"{where}: its forward layer has go_backwards=True; rnnserve cannot serve a "
                                  f"Bidirectional wrapper whose forward direction reads backwards")
        if layer.configs and not cfgs[1].get("go_backwards", True):
            raise ConversionError(f"{where}: its backward layer has go_backwards=False; rnnserve cannot serve it")
    return RecurrentLayer(layer.name, base, n_in, u, dirs, variant=variant)
