"""Read Keras files into a list of layers with their raw Keras-form weights, without Keras.

Four layouts are read (paths observed on files written by Keras 3.15 and, for Keras
2 / tf.keras, taken from ``hdf5_format.py`` / ``engine/saving.py``):

* ``.keras`` archive (Keras 3): a zip of ``config.json``, ``metadata.json`` and
  ``model.weights.h5``. In the h5, a layer lives at ``layers/<snake_case class>[_k]``
  and its ``vars`` group carries the layer name as attribute ``name``; an RNN's
  variables are ``cell/vars/0`` (kernel), ``1`` (recurrent_kernel), ``2`` (bias), a
  Bidirectional's under ``forward_layer/cell/vars`` and ``backward_layer/cell/vars``.
* Keras 3 weights-only ``.weights.h5`` (``model.save_weights``): the same tree, no config.
* legacy full model ``.h5`` (Keras 2, tf.keras, or Keras 3 ``model.save('x.h5')``):
  attributes ``model_config``, ``keras_version``, ``backend``; group ``model_weights``
  with ``layer_names``; each layer group lists its datasets in ``weight_names``
  (``lstm_1/kernel:0``, ``lstm/lstm_cell/kernel:0``, ``bi/forward_gru/gru_cell/bias``).
* legacy weights-only ``.h5`` (Keras 2 ``save_weights``): the same layer groups at the root.
"""
from __future__ import annotations

import io
import json
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConversionError
from .source import what_file_is

RECURRENT = ("LSTM", "GRU", "SimpleRNN", "CuDNNLSTM", "CuDNNGRU")
# Layers that pass a sequence through unchanged at inference time.
TRANSPARENT = {"InputLayer", "Masking", "Dropout", "SpatialDropout1D", "GaussianNoise", "GaussianDropout",
               "AlphaDropout", "ActivityRegularization", "Identity"}
_MODELS = {"Sequential", "Functional", "Model"}
_ROLES = ("kernel", "recurrent_kernel", "bias")


@dataclass
class KerasLayer:
    """One layer of a Keras model as stored in the file.

    ``class_name`` is the recurrent class (``LSTM``, ``GRU``, ...) also for a
    Bidirectional wrapper, whose ``bidirectional`` is then true. ``configs`` holds one
    layer config per direction (None when the file has no config); ``weights`` one
    dict {kernel, recurrent_kernel[, bias]} per direction. ``upstream`` names the
    non-transparent layer whose output this one reads ("" for the model input, None
    when the file does not say).
    """

    name: str
    class_name: str
    bidirectional: bool = False
    configs: list[dict[str, Any]] | None = None
    wrapper: dict[str, Any] | None = None
    weights: list[dict[str, np.ndarray]] = field(default_factory=list)
    upstream: str | None = None
    where: str = ""
    holds_weights: bool = False  # weights-only files: the layer stores weights (read only for recurrent layers)
    calls: int = 1  # times the model calls the layer (its inbound nodes): shared weights when more than one
    state_from: list[str] = field(default_factory=list)  # layers feeding its call beyond its input: initial_state
    container: str = ""  # the class the file names (RNN for keras.layers.RNN(LSTMCell(n)), read as an LSTM)
    inner: list[KerasLayer] | None = None  # a nested model's layers (config_layers flattens them into the list)
    output: str = ""  # a nested model's output layer

    @property
    def is_recurrent(self) -> bool:
        return self.class_name in RECURRENT


@dataclass
class KerasFile:
    """A Keras file's layers in model order (``order_known`` false: only per-class order)."""

    kind: str                 # "keras" | "h5-model" | "h5-weights" | "keras3-weights"
    keras_version: str        # "" when the file does not record it
    layers: list[KerasLayer]
    has_config: bool
    order_known: bool = True

    @property
    def keras3(self) -> bool:
        return self.kind in ("keras", "keras3-weights") or self.keras_version.startswith("3")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value[()])
    return str(value)


def _open_h5(source: Any, what: str):
    import h5py

    try:
        return h5py.File(source, "r")
    except (OSError, ValueError) as exc:
        raise ConversionError(
            f"{what} is not a readable HDF5 file ({exc}); the file may be truncated or corrupt: "
            f"save it again with model.save(...) or model.save_weights(...)"
        ) from exc


def read_keras_file(path: Path) -> KerasFile:
    """Read ``path`` (a .keras zip or an HDF5 file) into a :class:`KerasFile`."""
    head = path.read_bytes()[:8]
    if head.startswith(b"PK"):
        return _read_archive(path)
    if head.startswith(b"\x89HDF"):
        h5 = _open_h5(path, f"'{path.name}'")
        try:
            return _read_h5(h5, path.name)
        except KeyError as exc:
            raise ConversionError(f"'{path.name}' is missing an expected HDF5 entry ({exc}); the file may be "
                                  f"truncated or corrupt: save it again") from exc
        finally:
            h5.close()
    other = what_file_is(path)
    if other is not None:
        raise ConversionError(f"'{path.name}' is not a Keras file but {other[1]}; convert it with --format {other[0]}")
    raise ConversionError(
        f"'{path.name}' is neither a .keras archive (zip) nor an HDF5 file; the file may be truncated or corrupt. "
        f"Save the model with model.save('model.keras') or model.save('model.h5')"
    )


# ---------------------------------------------------------------- .keras archives and Keras 3 h5

def _read_archive(path: Path) -> KerasFile:
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            missing = [n for n in ("config.json", "model.weights.h5") if n not in names]
            if missing:
                torch_save = any(n.endswith("/data.pkl") or n == "data.pkl" or n.endswith("/constants.pkl")
                                 for n in names)
                raise ConversionError(
                    f"'{path.name}' is a zip but not a Keras 3 .keras archive: it lacks {', '.join(missing)}. "
                    + ("It holds a PyTorch save: convert it with --format torch" if torch_save
                       else "Save the model with model.save('model.keras')")
                )
            config = json.loads(zf.read("config.json"))
            meta = json.loads(zf.read("metadata.json")) if "metadata.json" in names else {}
            weights = zf.read("model.weights.h5")
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise ConversionError(f"'{path.name}' is not a valid .keras archive ({exc}); the file may be truncated "
                              f"or corrupt: save it again with model.save('model.keras')") from exc
    except json.JSONDecodeError as exc:
        raise ConversionError(f"'{path.name}': config.json is not valid JSON ({exc}); save the model again") from exc
    layers = config_layers(config, path.name, nested=True)
    h5 = _open_h5(io.BytesIO(weights), f"model.weights.h5 inside '{path.name}'")
    try:
        groups = _keras3_groups(h5, path.name)
        by_name = {name: g for name, g in groups}
        fallback = _snake_names(layers)
        for layer in layers:
            if not layer.is_recurrent:
                continue
            group = by_name.get(layer.name)
            if group is None and fallback.get(layer.name):
                group = h5["layers"].get(fallback[layer.name])
            if group is None:
                raise ConversionError(f"'{path.name}': no weights for layer '{layer.name}' in model.weights.h5; "
                                      f"the archive may be corrupt: save the model again")
            layer.weights, layer.where = _keras3_weights(group, layer.bidirectional, layer.name)
    except KeyError as exc:
        raise ConversionError(f"'{path.name}': model.weights.h5 lacks {exc}; the archive may be corrupt") from exc
    finally:
        h5.close()
    return KerasFile("keras", str(meta.get("keras_version", "3")), layers, has_config=True)


def _keras3_groups(h5, fname: str) -> list[tuple[str, Any]]:
    """(layer name, group) for every child of ``layers/``, named from its ``vars`` attribute."""
    if "layers" not in h5:
        raise ConversionError(f"'{fname}': the weights file has no 'layers' group; is this a Keras 3 model?")
    return _named_groups(h5["layers"])


def _named_groups(layers: Any) -> list[tuple[str, Any]]:
    """(layer name, group) for every child of a ``layers`` group, and of a nested model's own ``layers`` below it."""
    out = []
    for key in layers:
        group = layers[key]
        name = _text(group["vars"].attrs["name"]) if "vars" in group and "name" in group["vars"].attrs else key
        if "layers" in group and "cell" not in group:  # a nested model: its layers, not itself
            out += _named_groups(group["layers"])
        else:
            out.append((name, group))
    return out


def _snake_names(layers: list[KerasLayer]) -> dict[str, str]:
    """Fallback for files whose ``vars`` lack the name attribute: Keras 3's container naming."""
    used: dict[str, int] = {}
    out = {}
    for layer in layers:
        cls = layer.wrapper["class_name"] if layer.wrapper else (layer.container or layer.class_name)
        base = re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", cls)).lower()
        k = used.get(base, 0)
        used[base] = k + 1
        out[layer.name] = base if k == 0 else f"{base}_{k}"
    return out


def _weight_array(dataset: Any) -> np.ndarray:
    """A stored weight as an array; Keras writes bfloat16 variables as 2-byte opaque data (``|V2``), which are the
    top half of a float32's bits (a layer with ``dtype="bfloat16"`` crashed the converter)."""
    arr = np.asarray(dataset)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:
        return (np.frombuffer(arr.tobytes(), np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(arr.shape)
    return arr


def _keras3_vars(group, where: str) -> dict[str, np.ndarray]:
    if "cell" not in group or "vars" not in group["cell"]:
        raise ConversionError(f"{where}: no 'cell/vars' group; rnnserve reads LSTM, GRU and SimpleRNN layers")
    var = group["cell"]["vars"]
    arrays = [_weight_array(var[k]) for k in sorted(var, key=int)]
    if len(arrays) not in (2, 3):
        raise ConversionError(f"{where}: expected kernel, recurrent_kernel and bias, found {len(arrays)} variables")
    return dict(zip(_ROLES, arrays))


def _keras3_weights(group, bidirectional: bool, name: str) -> tuple[list[dict[str, np.ndarray]], str]:
    if bidirectional:
        return ([_keras3_vars(group["forward_layer"], f"layer '{name}' (forward)"),
                 _keras3_vars(group["backward_layer"], f"layer '{name}' (backward)")], group.name)
    return [_keras3_vars(group, f"layer '{name}'")], group.name


_CELL_CLASSES = {"lstm_cell": "LSTM", "gru_cell": "GRU", "simple_rnn_cell": "SimpleRNN"}


def _has_arrays(group) -> bool:
    """Whether an HDF5 group holds a dataset anywhere below it."""
    import h5py

    found = []
    group.visititems(lambda _, item: found.append(True) if isinstance(item, h5py.Dataset) else None)
    return bool(found)


def _read_keras3_weights(h5, fname: str) -> KerasFile:
    """Keras 3 ``save_weights`` file: no config, layer order known only within a class."""
    layers = []
    for name, group in _keras3_groups(h5, fname):
        bidir = "forward_layer" in group
        inner = group["forward_layer"] if bidir else group
        cls = ""
        if "cell" in inner:
            cell_name = _text(inner["cell"]["vars"].attrs.get("name", "")) if "vars" in inner["cell"] else ""
            cls = _CELL_CLASSES.get(re.sub(r"_\d+$", "", cell_name), "")
        layer = KerasLayer(name, cls or "?", bidirectional=bidir, where=group.name, holds_weights=_has_arrays(group))
        if "cell" in inner:
            layer.weights, layer.where = _keras3_weights(group, bidir, name)
            if not cls:
                layer.class_name = shape_class(layer.weights[0], name)
        layers.append(layer)
    return KerasFile("keras3-weights", "", layers, has_config=False, order_known=False)


# ---------------------------------------------------------------- legacy h5 (Keras 2, tf.keras, Keras 3)

def _read_h5(h5, fname: str) -> KerasFile:
    attrs = h5.attrs
    version = _text(attrs["keras_version"]) if "keras_version" in attrs else ""
    if version.startswith("1."):
        raise ConversionError(f"'{fname}' was written by Keras {version}; rnnserve reads files from Keras 2 and "
                              f"later: load it in Keras 2 and save it again")
    if "model_weights" in h5:
        root, kind = h5["model_weights"], "h5-model"
        version = version or (_text(root.attrs["keras_version"]) if "keras_version" in root.attrs else "")
    elif "layer_names" in attrs:
        root, kind = h5, "h5-weights"
    elif "layers" in h5:
        return _read_keras3_weights(h5, fname)
    else:
        raise ConversionError(
            f"'{fname}' is an HDF5 file but not a Keras model or weights file (no 'model_weights' group, no "
            f"'layer_names' attribute, no 'layers' group); save it with model.save('model.h5')"
        )
    config = None
    if kind == "h5-model" and "model_config" in attrs:
        try:
            config = json.loads(_text(attrs["model_config"]))
        except json.JSONDecodeError as exc:
            raise ConversionError(f"'{fname}': the model_config attribute is not valid JSON ({exc})") from exc
    names = [_text(n) for n in root.attrs["layer_names"]]
    if config is not None:
        layers = config_layers(config, fname)
    else:
        layers = [KerasLayer(n, "?") for n in names]
    for layer in layers:
        if layer.name not in root:
            continue
        group = root[layer.name]
        layer.holds_weights = _has_arrays(group)
        weights = _legacy_weights(group, layer.name)
        if not weights or all("recurrent_kernel" not in w for w in weights):
            continue
        layer.weights, layer.where = weights, group.name
        if config is None:
            layer.bidirectional = len(weights) == 2
            layer.class_name = shape_class(weights[0], layer.name)
    return KerasFile(kind, version, layers, has_config=config is not None)


def _legacy_weights(group, name: str) -> list[dict[str, np.ndarray]]:
    """Per-direction {role: array} from a layer group's ``weight_names`` attribute."""
    wnames = [_text(n) for n in group.attrs.get("weight_names", [])]
    # a Bidirectional with its own backward_layer names that layer as the user did ('lstm_1', not 'backward_lstm'):
    # its two sub-layers are then told apart by their prefixes, forward first (the order Keras saves them in)
    prefixes = list(dict.fromkeys(wn.rsplit("/", 1)[0] for wn in wnames if "/" in wn))
    by_order = len(prefixes) == 2 and not any("backward_" in p for p in prefixes)
    dirs: dict[int, dict[str, np.ndarray]] = {}
    for wn in wnames:
        parts = wn.split("/")
        role = parts[-1].split(":")[0]
        if by_order:
            d = prefixes.index(wn.rsplit("/", 1)[0])
        else:
            d = 1 if any(p.startswith("backward_") for p in parts[:-1]) else 0
        if role not in _ROLES:
            return []  # not an RNN layer of a known form (Dense, Embedding, Keras 1 names, ...)
        dirs.setdefault(d, {})[role] = _weight_array(group[wn])
    return [dirs[d] for d in sorted(dirs)]


def shape_class(w: dict[str, np.ndarray], name: str) -> str:
    """The recurrent class implied by the weight shapes (for files without config)."""
    k, rk = w.get("kernel"), w.get("recurrent_kernel")
    if k is None or rk is None or k.ndim != 2 or rk.ndim != 2 or rk.shape[0] == 0 or rk.shape[1] % rk.shape[0]:
        return "?"
    gates, u = rk.shape[1] // rk.shape[0], rk.shape[0]
    bias = w.get("bias")
    if gates == 4:
        return "CuDNNLSTM" if bias is not None and bias.shape == (8 * u,) else "LSTM"
    if gates == 3:
        return "CuDNNGRU" if bias is not None and bias.shape == (6 * u,) else "GRU"
    return "SimpleRNN" if gates == 1 else "?"


# ---------------------------------------------------------------- model configs (Keras 2 and 3)

def config_layers(config: dict[str, Any], fname: str, nested: bool = False) -> list[KerasLayer]:
    """Layers of a Sequential/Functional config in order, with per-direction configs and upstream names.

    ``nested``: a model inside the model (a Sequential encoder called in a Functional model) gives its own layers
    in its place, its first ones fed from what fed the model and what reads the model reading its output layer
    (Keras 3 archives, whose weights file keeps such a model's layers under its group); else it is refused."""
    cls = config.get("class_name", "")
    body = config.get("config", {})
    entries = body if isinstance(body, list) else body.get("layers", [])  # Keras 2.1 Sequential: a bare list
    if cls not in _MODELS and not entries:
        entries = [config]  # a single layer saved on its own
    functional = cls not in ("Sequential",) and any("inbound_nodes" in e for e in entries)
    entries = [_linear_as_identity(e) if isinstance(e, dict) else e for e in entries]
    layers: list[KerasLayer] = []
    by_name: dict[str, dict] = {}
    prev = ""
    for e in entries:
        ecls = e.get("class_name", "?")
        cfg = e.get("config", {}) if isinstance(e.get("config"), dict) else {}
        name = e.get("name") or cfg.get("name") or ecls
        by_name[name] = e
        if ecls in _MODELS:
            if not nested:
                raise ConversionError(
                    f"'{fname}' contains the nested model '{name}'; rnnserve reads nested models from .keras "
                    f"archives, and flat Sequential or Functional models from .h5 files: save the model as .keras, or "
                    f"save '{name}' on its own (e.g. model.get_layer('{name}').save('{name}.keras')) and convert that"
                )
            layer = KerasLayer(name, ecls, inner=config_layers(e, fname, nested))
            layer.output = _model_output(e, layer.inner or [])
        else:
            layer = _layer(_custom(e) + ecls, cfg, name)
            layer.state_from = _inbound_names(e)[1:]
        layer.container = ecls
        layer.calls = max(1, len(e.get("inbound_nodes") or []))
        if not functional:
            layer.upstream = prev
            if ecls not in TRANSPARENT:
                prev = name
        layers.append(layer)
    if functional:
        for layer in layers:
            layer.upstream = _trace_upstream(by_name, by_name[layer.name])
    return _flatten(layers, fname)


def _layer(ecls: str, cfg: dict[str, Any], name: str) -> KerasLayer:
    """One layer entry (not a model) as a KerasLayer: a Bidirectional wrapper as its inner class with a config per
    direction, an RNN of one cell as the layer it equals."""
    if ecls == "RNN":
        ecls, cfg = _cell_layer(cfg)
    if ecls != "Bidirectional":
        return KerasLayer(name, ecls, False, [dict(cfg)])
    inner = _cell_entry(cfg.get("layer", {}))
    back = _cell_entry(cfg.get("backward_layer") or {}) or None
    configs = [dict(inner.get("config", {}))]
    if back:
        inner_cls, back_cls = inner.get("class_name", "?"), back.get("class_name", inner.get("class_name"))
        if back_cls != inner_cls:
            raise ConversionError(
                f"layer '{name}' (Bidirectional) has a {inner_cls} forward and a {back_cls} backward layer; "
                f"rnnserve serves both directions of one cell type: make backward_layer a {inner_cls} too")
        configs.append(dict(back.get("config", {})))
    else:
        configs.append({**configs[0], "go_backwards": not configs[0].get("go_backwards", False)})
    return KerasLayer(name, inner.get("class_name", "?"), True, configs,
                      wrapper={"class_name": "Bidirectional", **{k: v for k, v in cfg.items()
                                                                if k not in ("layer", "backward_layer")}})


def _linear_as_identity(entry: dict[str, Any]) -> dict[str, Any]:
    """``Activation("linear")`` as the ``Identity`` layer it is (a no-op, often where a normalisation layer is
    switched off by configuration): it was refused between two recurrent layers as breaking the chain."""
    cfg = entry.get("config")
    if entry.get("class_name") == "Activation" and isinstance(cfg, dict) and cfg.get("activation") == "linear":
        return {**entry, "class_name": "Identity"}
    return entry


def _model_output(entry: dict[str, Any], inner: list[KerasLayer]) -> str:
    """The layer whose output a nested model returns: a Functional one's (first) output layer, a Sequential one's
    last layer that is not transparent (its input layer when there is none)."""
    outputs = (entry.get("config") or {}).get("output_layers") if isinstance(entry.get("config"), dict) else None
    if outputs:
        first = outputs[0] if isinstance(outputs[0], list) else outputs
        if first and isinstance(first[0], str):
            return first[0]
    shown = [layer.name for layer in inner if layer.container not in TRANSPARENT]
    return shown[-1] if shown else ""


def _flatten(layers: list[KerasLayer], fname: str) -> list[KerasLayer]:
    """Nested models' layers in their places: what fed a model feeds its first layers, what read it reads its
    output layer (a model's input layer is the ``""`` upstream inside it)."""
    models = {layer.name: layer for layer in layers if layer.inner is not None}
    if not models:
        return layers
    out: list[KerasLayer] = []
    for layer in layers:
        if layer.inner is None:
            out.append(layer)
            continue
        for inner in layer.inner:
            if inner.upstream == "" and inner.container != "InputLayer":
                inner.upstream = layer.upstream
            out.append(inner)
    for layer in out:
        while layer.upstream in models:
            layer.upstream = models[layer.upstream].output or models[layer.upstream].upstream
        layer.state_from = [models[n].output if n in models else n for n in layer.state_from]
    names = [layer.name for layer in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConversionError(f"'{fname}' has layers named alike inside and outside a nested model ({', '.join(twice)}); "
                              f"rename them (layer names must be unique across the whole model) and save it again")
    return out


_CELLS = {"LSTMCell": "LSTM", "GRUCell": "GRU", "SimpleRNNCell": "SimpleRNN"}


def _cell_layer(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``keras.layers.RNN`` of one LSTMCell, GRUCell or SimpleRNNCell as the layer it equals (``RNN(LSTMCell(n))``
    computes what ``LSTM(n)`` does, and stores its weights where LSTM does): the layer class and a config holding
    the cell's settings and the RNN's. Other cells (custom ones, StackedRNNCells) give ``RNN(<cell class>)``, which
    is no recurrent class rnnserve converts, so only selecting it is refused."""
    cell = cfg.get("cell") if isinstance(cfg.get("cell"), dict) else {}
    cell_cls = _custom(cell) + str(cell.get("class_name", "?"))
    if cell_cls not in _CELLS:
        return f"RNN({cell_cls})", cfg
    cell_cfg = cell.get("config") if isinstance(cell.get("config"), dict) else {}
    return _CELLS[cell_cls], {**cell_cfg, **{k: v for k, v in cfg.items() if k != "cell"}}


def _custom(entry: dict[str, Any]) -> str:
    """"custom " for a class the model's own code defines (Keras 3 records its module and registered name), which
    may compute anything under a built-in's name; "" for Keras's own classes and files that do not say."""
    module, registered = entry.get("module"), entry.get("registered_name")
    if isinstance(module, str) and module:  # Keras's own ops layers have a registered name too, and module keras.*
        return "" if module.startswith("keras") else "custom "
    return "custom " if registered else ""  # registered with register_keras_serializable: "package>Name"


def _cell_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A Bidirectional's inner layer entry, an RNN of one cell read as the layer it equals, a custom class named
    as such (not converted)."""
    if _custom(entry):
        return {**entry, "class_name": "custom " + str(entry.get("class_name", "?"))}
    if entry.get("class_name") != "RNN":
        return entry
    cls, cfg = _cell_layer(entry.get("config") if isinstance(entry.get("config"), dict) else {})
    return {**entry, "class_name": cls, "config": cfg}


def _trace_upstream(by_name: dict[str, dict], entry: dict) -> str | None:
    seen = set()
    src = _first_inbound(entry)
    while src:
        e = by_name.get(src)
        if e is None or e.get("class_name") not in TRANSPARENT or src in seen:
            return src
        seen.add(src)
        src = _first_inbound(e)
    return ""


def _first_inbound(entry: dict) -> str:
    """The layer name feeding ``entry``'s first call, in Keras 2 or Keras 3 config form."""
    names = _inbound_names(entry)
    return names[0] if names else ""


def _inbound_names(entry: dict) -> list[str]:
    """Every layer name feeding ``entry``'s first call, in order: its input first, then tensors such as an
    ``initial_state`` (Keras 3: the call's kwargs; Keras 2: more entries of the node)."""
    nodes = entry.get("inbound_nodes") or []
    if not nodes:
        return []
    found: list[str] = []

    def find(obj: Any) -> None:
        if isinstance(obj, dict):
            hist = obj.get("config", {}).get("keras_history") if isinstance(obj.get("config"), dict) else None
            if hist:
                found.append(str(hist[0]))
                return
            for v in obj.values():
                find(v)
        elif isinstance(obj, (list, tuple)):
            if obj and isinstance(obj[0], str) and len(obj) >= 3 and isinstance(obj[1], int):
                found.append(obj[0])  # Keras 2: [layer_name, node_index, tensor_index, kwargs]
                return
            for v in obj:
                find(v)

    node = nodes[0]
    if isinstance(node, dict):
        find(node.get("args", node))
        find((node.get("kwargs") or {}).get("initial_state"))
    else:
        find(node)
    return found
