"""Run the selected Keras layers with Keras itself, to verify a conversion.

For files Keras 3 wrote (``.keras``, or ``.h5`` with keras_version 3.x) the model is
loaded with ``keras.saving.load_model`` and its selected layers are re-created from
their own configs (``return_sequences=True``, so every step comes back) with Keras's
loaded weights. Files from Keras 2 / tf.keras (whose ``hard_sigmoid`` and CuDNN
layers Keras 3 would misread) and weights-only files are rebuilt as Keras 3 layers
from what the loader read. Sequences run one at a time at their own length, so a
ragged batch needs no mask, and a go_backwards layer's time-reversed output is
flipped back to rnnserve's order.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .keras_files import KerasFile, KerasLayer
from .layers import RecurrentLayer
from .source import SourceRunner
from .verify import last_line


def keras_available() -> bool:
    """True when Keras and a backend for it are installed (Keras is not imported here)."""
    if importlib.util.find_spec("keras") is None:
        return False
    backend = os.environ.get("KERAS_BACKEND")
    modules = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}
    if backend:
        return importlib.util.find_spec(modules.get(backend, backend)) is not None
    return any(importlib.util.find_spec(m) is not None for m in modules.values())


def keras_missing() -> str:
    """Why Keras cannot run here, saying what to install; "" when it can."""
    if importlib.util.find_spec("keras") is None:
        return "keras is not installed (pip install 'rnnserve[keras]' and one of its backends: torch, tensorflow or jax)"
    if keras_available():
        return ""
    backend = os.environ.get("KERAS_BACKEND")
    if backend:
        return (f"keras is installed but not its backend {backend!r} (KERAS_BACKEND): install it, or set "
                f"KERAS_BACKEND to an installed one (torch, tensorflow or jax)")
    return ("keras is installed but none of its backends is: install one (torch, tensorflow or jax), e.g. "
            "pip install 'rnnserve[keras,torch]'")


def _import_keras():
    import sys

    if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND") \
            and importlib.util.find_spec("tensorflow") is None and importlib.util.find_spec("torch") is not None:
        os.environ["KERAS_BACKEND"] = "torch"  # Keras defaults to TensorFlow; use the backend that is here
    import keras

    return keras


def keras_runner(path: Path, kfile: KerasFile, chosen: list[KerasLayer], layers: list[RecurrentLayer],
                 rebuilt: Callable[[str], None] = lambda why: None) -> SourceRunner | None:
    """A runner x [B, T, I], lengths [B] -> output [B, T, D*Ho], or None without Keras. ``rebuilt(why)`` is told
    when Keras cannot load a file it wrote and the layers are rebuilt from what the loader read instead."""
    if not keras_available():
        return None
    cache: dict[str, Any] = {}
    reverse_last = bool(layers[-1].variant.get("reverse"))
    width = layers[-1].output_width

    def run(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        keras = _import_keras()
        if "model" not in cache:
            cache["model"] = _build(keras, path, kfile, chosen, layers, rebuilt)
        model = cache["model"]
        b, t, _ = x.shape
        out = np.zeros((b, t, width), dtype=np.float32)
        for i in range(b):
            n = int(lengths[i])
            y = np.asarray(keras.ops.convert_to_numpy(model(np.ascontiguousarray(x[i:i + 1, :n]), training=False)))
            out[i, :n] = y[0, ::-1] if reverse_last else y[0]
        return out

    return run


def _build(keras, path: Path, kfile: KerasFile, chosen: list[KerasLayer], layers: list[RecurrentLayer],
           rebuilt: Callable[[str], None]):
    if kfile.kind == "keras" or (kfile.kind == "h5-model" and kfile.keras3):
        try:
            return _from_saved_model(keras, path, chosen, layers[0].input_size)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:
            # custom objects or layers Keras cannot load: rebuild from what the loader read, and say so (the
            # check is then as good as the loader's reading, which it was silently taken for)
            rebuilt(f"{type(exc).__name__}: {last_line(exc)}")
    return _from_weights(keras, chosen, layers)


def _sequences_config(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(cfg)
    for key in ("layer", "backward_layer"):
        if isinstance(cfg.get(key), dict):
            inner = dict(cfg[key])
            inner["config"] = {**inner.get("config", {}), "return_sequences": True, "return_state": False,
                               "stateful": False}
            cfg[key] = inner
    if "return_sequences" in cfg:
        cfg.update(return_sequences=True, return_state=False, stateful=False)
    return cfg


def _from_saved_model(keras, path: Path, chosen: list[KerasLayer], input_size: int):
    model = keras.saving.load_model(str(path), compile=False)
    inp = keras.Input((None, input_size))
    y, pairs = inp, []
    for kl in chosen:
        src = _find_layer(model, kl.name)
        clone = type(src).from_config(_sequences_config(src.get_config()))
        y = clone(y)
        pairs.append((clone, src.get_weights()))
    for clone, weights in pairs:
        clone.set_weights(weights)
    return keras.Model(inp, y)


def _find_layer(model: Any, name: str) -> Any:
    """The layer named ``name`` in ``model`` or in a model nested in it (ValueError when there is none)."""
    try:
        return model.get_layer(name)
    except ValueError:
        for layer in getattr(model, "layers", []):
            if hasattr(layer, "get_layer"):
                try:
                    return _find_layer(layer, name)
                except ValueError:
                    continue
        raise


def _activation(keras, act: dict[str, Any]):
    name, alpha, beta = act["name"], float(act.get("alpha") or 0.0), float(act.get("beta") or 0.0)
    if name in ("sigmoid", "tanh", "relu", "softsign", "softplus"):
        return name
    if name == "elu" and alpha == 1.0:
        return "elu"
    if name == "affine":
        return lambda t: t * alpha + beta
    if name == "hard_sigmoid":
        return lambda t: keras.ops.clip(t * alpha + beta, 0.0, 1.0)
    if name == "leaky_relu":
        return lambda t: keras.ops.leaky_relu(t, negative_slope=alpha)
    raise ValueError(f"no Keras form for activation {act}")


def _keras_weights(cls: str, w: dict[str, np.ndarray]) -> list[np.ndarray]:
    out = [w["kernel"], w["recurrent_kernel"]]
    bias = w.get("bias")
    if bias is not None:
        u = w["recurrent_kernel"].shape[0]
        if cls == "CuDNNLSTM":
            bias = bias[:4 * u] + bias[4 * u:]   # LSTM uses only the sum
        elif cls == "CuDNNGRU":
            bias = bias.reshape(2, 3 * u)         # == GRU(reset_after=True)
        out.append(bias)
    return [np.asarray(a, dtype=np.float32) for a in out]


def _from_weights(keras, chosen: list[KerasLayer], layers: list[RecurrentLayer]):
    inp = keras.Input((None, layers[0].input_size))
    y, pairs = inp, []
    for kl, rl in zip(chosen, layers):
        n_dirs = len(rl.directions)
        acts = rl.variant.get("activations")
        made = []
        for d in range(n_dirs):
            a = acts[d] if acts else None
            kw: dict[str, Any] = dict(units=rl.hidden_size, return_sequences=True, use_bias="bias" in kl.weights[d],
                                      go_backwards=(d == 1) or bool(rl.variant.get("reverse")))
            if rl.cell == "lstm":
                kw.update(recurrent_activation=_activation(keras, a[0]) if a else "sigmoid",
                          activation=_activation(keras, a[1]) if a else "tanh")
                made.append(keras.layers.LSTM(**kw))
            elif rl.cell == "gru":
                kw.update(recurrent_activation=_activation(keras, a[0]) if a else "sigmoid",
                          activation=_activation(keras, a[1]) if a else "tanh",
                          reset_after=not rl.variant.get("reset_before"))
                made.append(keras.layers.GRU(**kw))
            else:
                act = _activation(keras, a[0]) if a else rl.cell[len("rnn_"):]
                made.append(keras.layers.SimpleRNN(activation=act, **kw))
        ys = [made[0](y)]
        if n_dirs == 2:
            # what Bidirectional(merge_mode="concat") computes on a whole sequence, without the wrapper: it copies
            # its layers through their configs, which cannot hold the lambdas of hard_sigmoid and the like
            ys.append(keras.ops.flip(made[1](y), axis=1))
        y = keras.layers.Concatenate()(ys) if n_dirs == 2 else ys[0]
        for layer, w in zip(made, kl.weights):
            pairs.append((layer, _keras_weights(kl.class_name, w)))
    for layer, weights in pairs:
        layer.set_weights(weights)
    return keras.Model(inp, y)
