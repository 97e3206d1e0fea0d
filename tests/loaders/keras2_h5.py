"""Test helpers: write .h5 files the way Keras 2 / tf.keras 2 did (with h5py), and the
Keras 2 cell equations in NumPy to compute their expected output independently.

Layout per keras 2.2 ``engine/saving.py`` and tf.keras ``hdf5_format.py``: attributes
``keras_version``, ``backend``, ``model_config`` (full models); ``model_weights`` (or
the root, for ``save_weights``) carries ``layer_names``; each layer group carries
``weight_names`` and holds each dataset at its variable name (slashes nest groups).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np


@dataclass
class K2Layer:
    """A layer to write: its name, class, config, and (weight_name, array) pairs."""

    name: str
    class_name: str
    config: dict[str, Any]
    weights: list[tuple[str, np.ndarray]] = field(default_factory=list)


def write_h5(path: Path, layers: list[K2Layer], version: str, full: bool, sequential_list: bool = False,
             functional: bool = False) -> Path:
    """Write a legacy Keras 2 .h5 file: a full model (``full``) or a save_weights file."""
    with h5py.File(path, "w") as f:
        if full:
            f.attrs["keras_version"] = version.encode()
            f.attrs["backend"] = b"tensorflow"
            confs = []
            prev = "input_1"
            for layer in layers:
                entry = {"class_name": layer.class_name, "config": {"name": layer.name, **layer.config}}
                if functional:
                    entry["name"] = layer.name
                    entry["inbound_nodes"] = [[[prev, 0, 0, {}]]]
                    prev = layer.name
                confs.append(entry)
            if functional:
                inp = {"class_name": "InputLayer", "name": "input_1", "inbound_nodes": [],
                       "config": {"name": "input_1", "batch_input_shape": [None, None, 7]}}
                model = {"class_name": "Model", "config": {"name": "model_1", "layers": [inp, *confs],
                                                           "input_layers": [["input_1", 0, 0]],
                                                           "output_layers": [[prev, 0, 0]]}}
            elif sequential_list:
                model = {"class_name": "Sequential", "config": confs}  # Keras 2.1 wrote a bare list
            else:
                model = {"class_name": "Sequential", "config": {"name": "sequential_1", "layers": confs}}
            f.attrs["model_config"] = json.dumps(model).encode()
            root = f.create_group("model_weights")
        else:
            root = f
        root.attrs["layer_names"] = np.array([layer.name.encode() for layer in layers])
        root.attrs["backend"] = b"tensorflow"
        root.attrs["keras_version"] = version.encode()
        for layer in layers:
            g = root.create_group(layer.name)
            g.attrs["weight_names"] = np.array([n.encode() for n, _ in layer.weights])
            for n, arr in layer.weights:
                g.create_dataset(n, data=np.asarray(arr, dtype=np.float32))
    return path


# ---------------------------------------------------------------- Keras 2 equations

def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def hard_sigmoid_k2(a):
    return np.clip(0.2 * a + 0.5, 0.0, 1.0)


def run_lstm(x, kernel, rec, bias, rec_act=sigmoid, act=np.tanh):
    """Keras LSTM on one sequence x [T, I]; gates i, f, c, o; returns [T, u]."""
    u = rec.shape[0]
    h, c, out = np.zeros(u), np.zeros(u), []
    for xt in x:
        z = xt @ kernel + h @ rec + bias
        i, f, g, o = rec_act(z[:u]), rec_act(z[u:2 * u]), act(z[2 * u:3 * u]), rec_act(z[3 * u:])
        c = f * c + i * g
        h = o * act(c)
        out.append(h)
    return np.array(out)


def run_gru(x, kernel, rec, bias, reset_after, rec_act=sigmoid, act=np.tanh):
    """Keras GRU on one sequence; gates z, r, h; bias (2, 3u) when reset_after else (3u,)."""
    u = rec.shape[0]
    b_in, b_rec = (bias[0], bias[1]) if reset_after else (bias, np.zeros(3 * u))
    h, out = np.zeros(u), []
    for xt in x:
        xz = xt @ kernel + b_in
        if reset_after:
            hr = h @ rec + b_rec
            z, r = rec_act(xz[:u] + hr[:u]), rec_act(xz[u:2 * u] + hr[u:2 * u])
            hh = act(xz[2 * u:] + r * hr[2 * u:])
        else:
            z = rec_act(xz[:u] + h @ rec[:, :u])
            r = rec_act(xz[u:2 * u] + h @ rec[:, u:2 * u])
            hh = act(xz[2 * u:] + (r * h) @ rec[:, 2 * u:])
        h = z * h + (1 - z) * hh
        out.append(h)
    return np.array(out)


def run_cudnn_lstm(x, kernel, rec, bias):
    """Keras 2 CuDNNLSTM: bias (8u,) = input half ‖ recurrent half, cuDNN's sigmoid/tanh."""
    u = rec.shape[0]
    return run_lstm(x, kernel, rec, bias[:4 * u] + bias[4 * u:])


def run_cudnn_gru(x, kernel, rec, bias):
    """Keras 2 CuDNNGRU: bias (6u,) = [z r h] input ‖ [z r h] recurrent, reset applied after the matmul."""
    return run_gru(x, kernel, rec, bias.reshape(2, -1), reset_after=True)


def run_ragged(fn, x, lengths, width):
    """Apply a per-sequence function to each sequence at its own length; zeros past it."""
    out = np.zeros((x.shape[0], x.shape[1], width))
    for i, n in enumerate(lengths):
        out[i, :n] = fn(x[i, :n])
    return out
