"""Find nn.LSTM / nn.GRU / nn.RNN modules (and their cells) in a state dict by tensor names and shapes.

A state dict holds no module types, so a recurrent module is recognised by its
parameter names (``weight_ih_l{k}``, ``weight_hh_l{k}``, ``bias_ih_l{k}``,
``bias_hh_l{k}``, ``weight_hr_l{k}``, ``_reverse``; cells: ``weight_ih``,
``weight_hh``, ``bias_ih``, ``bias_hh``) and its cell and sizes by the shape of
``weight_hh``: [G*H, Ho] with G = 4 (LSTM), 3 (GRU) or 1 (RNN). Without a
projection Ho = H, so G = rows / columns; with one, ``weight_hr`` [Ho, H] gives H.
The RNN nonlinearity (tanh or relu) is not stored in a state dict: TorchScript
keeps it, otherwise tanh is assumed unless ``--cell rnn_relu`` says so.

PyTorch's gate order is the canonical one (layouts.md section 2), so weights map
to :class:`LayerWeights` as they are.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConversionError
from ..packing import LayerWeights
from .layers import RecurrentLayer
from .torch_files import TensorFile

_LEAF = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh|weight_hr)(?:_l(\d+)(_reverse)?)?$")
_CELLS_BY_GATES = {4: "lstm", 3: "gru", 1: "rnn_tanh"}
_CELL_ALIASES = {"lstm": "lstm", "gru": "gru", "rnn": "rnn_tanh", "rnn_tanh": "rnn_tanh", "tanh": "rnn_tanh",
                 "rnn_relu": "rnn_relu", "relu": "rnn_relu"}
_MODES = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}
_TORCH_CLASS = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}
ROOT = "<root>"


def display(prefix: str) -> str:
    """How a module prefix is shown to users ('' is the state dict's top level)."""
    return prefix or ROOT


def normalize_cell(cell: str | None) -> str | None:
    """Map --cell spellings (lstm, gru, rnn, rnn_tanh, rnn_relu, tanh, relu) to a canonical cell."""
    if cell is None:
        return None
    key = cell.strip().lower()
    if key not in _CELL_ALIASES:
        raise ConversionError(f"--cell '{cell}' is not known; use one of lstm, gru, rnn_tanh, rnn_relu")
    return _CELL_ALIASES[key]


def _split(name: str) -> tuple[str, str]:
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def find_modules(tf: TensorFile) -> list[str]:
    """Prefixes of every module whose direct tensors include recurrent weights, in file order."""
    found: dict[str, None] = {}
    for name in tf.shapes:
        prefix, leaf = _split(name)
        m = _LEAF.match(leaf)
        if m and m.group(1).startswith("weight"):
            found.setdefault(prefix)
    return list(found)


@dataclass
class TorchRNN:
    """One recurrent module of the file: its cell and sizes, and the names of its tensors."""

    prefix: str
    is_cell: bool            # nn.LSTMCell / GRUCell / RNNCell (no layer suffix)
    cell: str
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    bidirectional: bool
    bias: bool
    names: dict[tuple[int, int, str], str]     # (layer, direction, weight_ih|...) -> tensor name
    notes: list[str] = field(default_factory=list)

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def output_size(self) -> int:
        return self.proj_size or self.hidden_size

    def label(self) -> str:
        """e.g. "'encoder.rnn' (nn.LSTM: input 7, hidden 13, 2 layers, bidirectional)"."""
        kind = f"nn.{_TORCH_CLASS[self.cell]}{'Cell' if self.is_cell else ''}"
        if self.cell == "rnn_relu":
            kind += " relu"
        parts = [f"input {self.input_size}", f"hidden {self.hidden_size}"]
        if self.proj_size:
            parts.append(f"proj {self.proj_size}")
        if not self.is_cell:
            parts.append(f"{self.num_layers} layer{'s' if self.num_layers > 1 else ''}")
        if self.bidirectional:
            parts.append("bidirectional")
        if not self.bias:
            parts.append("no bias")
        return f"'{display(self.prefix)}' ({kind}: {', '.join(parts)})"

    def torch_state_dict(self, tf: TensorFile) -> dict[str, np.ndarray]:
        """Float64 weights under nn.LSTM/GRU/RNN names (cells become a 1-layer stack)."""
        out = {}
        for (k, d, what), name in self.names.items():
            out[f"{what}_l{k}{'_reverse' if d else ''}"] = tf.array(name)
        return out

    def layers(self, tf: TensorFile) -> list[RecurrentLayer]:
        """One RecurrentLayer per torch layer, directions [forward, reverse], in canonical form."""
        g = 4 if self.cell == "lstm" else 3 if self.cell == "gru" else 1
        zeros = np.zeros(g * self.hidden_size)
        result = []
        for k in range(self.num_layers):
            dirs = []
            for d in range(self.directions):
                get = lambda what: tf.array(self.names[(k, d, what)])  # noqa: E731
                dirs.append(LayerWeights(
                    w=get("weight_ih"), r=get("weight_hh"),
                    bw=get("bias_ih") if self.bias else zeros, br=get("bias_hh") if self.bias else zeros,
                    proj=get("weight_hr") if self.proj_size else None))
            name = display(self.prefix) if self.is_cell else f"{display(self.prefix)} layer {k}"
            in_k = self.input_size if k == 0 else self.directions * self.output_size
            result.append(RecurrentLayer(name, self.cell, in_k, self.hidden_size, dirs, self.proj_size))
        return result


_HINT = ("weight norm, weight drop and custom cells cannot be converted as they are: save the plain "
         "nn.LSTM/nn.GRU/nn.RNN weights (e.g. after torch.nn.utils.remove_weight_norm)")


def describe_module(tf: TensorFile, prefix: str, cell: str | None = None) -> TorchRNN:
    """Read the cell, sizes and tensor names of the module at ``prefix``; ConversionError naming the tensor at fault."""
    pfx = f"{prefix}." if prefix else ""
    where = f"module '{display(prefix)}'"
    parametrized = [n for n in tf.shapes if n.startswith(pfx + "parametrizations.")]
    if parametrized:
        raise ConversionError(
            f"{where} has parametrized weights ('{parametrized[0]}'): remove the parametrization before saving "
            f"(torch.nn.utils.parametrize.remove_parametrizations(module, name)) so the plain weights are stored")
    table: dict[tuple[int, int], dict[str, str]] = {}
    suffixed = set()
    for name in tf.shapes:
        parent, leaf = _split(name)
        if parent != prefix:
            continue
        m = _LEAF.match(leaf)
        if m is None and not leaf.startswith(("weight", "bias")):
            continue  # not a weight (a step counter, a learned initial state): the loader's note names it
        if m is None:
            raise ConversionError(f"tensor '{name}' in {where} is not a parameter of nn.LSTM/nn.GRU/nn.RNN or their "
                                  f"cells (weight_ih_l<k>, weight_hh_l<k>, bias_ih_l<k>, bias_hh_l<k>, weight_hr_l<k>, "
                                  f"with _reverse; cells: weight_ih, weight_hh, bias_ih, bias_hh); {_HINT}")
        what, layer, rev = m.groups()
        suffixed.add(layer is not None)
        if layer is None and what == "weight_hr":
            raise ConversionError(f"tensor '{name}' in {where}: cells (nn.LSTMCell) have no projection; {_HINT}")
        table.setdefault((int(layer or 0), 1 if rev else 0), {})[what] = name
    if len(suffixed) > 1:
        raise ConversionError(f"{where} mixes cell names (weight_ih) with layer names (weight_ih_l0); "
                              f"select one module with --select")
    is_cell = suffixed == {False}
    num_layers = max(k for k, _ in table) + 1
    directions = 2 if any(d for _, d in table) else 1
    has = {what for entry in table.values() for what in entry}
    bias, proj = "bias_ih" in has or "bias_hh" in has, "weight_hr" in has
    required = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else []) + (["weight_hr"] if proj else [])
    names: dict[tuple[int, int, str], str] = {}
    for k in range(num_layers):
        for d in range(directions):
            for what in required:
                name = table.get((k, d), {}).get(what)
                if name is None:
                    missing = pfx + (what if is_cell else f"{what}_l{k}{'_reverse' if d else ''}")
                    raise ConversionError(f"{where} has no tensor '{missing}' (the file is incomplete, or the "
                                          f"module is not an nn.LSTM/nn.GRU/nn.RNN)")
                names[(k, d, what)] = name

    def shape(k: int, d: int, what: str, ndim: int) -> tuple[int, ...]:
        s = tf.shapes[names[(k, d, what)]]
        if len(s) != ndim:
            raise ConversionError(f"tensor '{names[(k, d, what)]}' has shape {list(s)}; expected {ndim} dimensions")
        return s

    rows, cols = shape(0, 0, "weight_hh", 2)
    if proj:
        out_size, hidden = shape(0, 0, "weight_hr", 2)
        if (rows, cols) != (4 * hidden, out_size) or not 0 < out_size < hidden:
            raise ConversionError(
                f"tensor '{names[(0, 0, 'weight_hh')]}' has shape {[rows, cols]} but an LSTM with the projection "
                f"'{names[(0, 0, 'weight_hr')]}' of shape {[out_size, hidden]} needs {[4 * hidden, out_size]}")
        gates = 4
    else:
        if cols == 0 or rows % cols or rows // cols not in _CELLS_BY_GATES:
            raise ConversionError(
                f"cannot tell the cell from '{names[(0, 0, 'weight_hh')]}' of shape {[rows, cols]}: nn.LSTM, nn.GRU "
                f"and nn.RNN have 4H, 3H or H rows for H columns")
        gates, hidden, out_size = rows // cols, cols, cols
    chosen, notes = _choose_cell(tf, prefix, gates, cell, names[(0, 0, "weight_hh")], (rows, cols), hidden)
    input_size = shape(0, 0, "weight_ih", 2)[1]
    if input_size < 1:
        raise ConversionError(f"tensor '{names[(0, 0, 'weight_ih')]}' has shape {list(tf.shapes[names[(0, 0, 'weight_ih')]])}: "
                              f"an input size of 0 features; save the model with at least one input feature")
    for k in range(num_layers):
        in_k = input_size if k == 0 else directions * out_size
        for d in range(directions):
            expected = {"weight_ih": (gates * hidden, in_k), "weight_hh": (gates * hidden, out_size),
                        "bias_ih": (gates * hidden,), "bias_hh": (gates * hidden,), "weight_hr": (out_size, hidden)}
            for what in required:
                name = names[(k, d, what)]
                if tf.shapes[name] != expected[what]:
                    why = (f"; layer {k} reads the {in_k} features of layer {k - 1}"
                           if what == "weight_ih" and k else "")
                    raise ConversionError(
                        f"tensor '{name}' has shape {list(tf.shapes[name])}, expected {list(expected[what])} for "
                        f"{_TORCH_CLASS[chosen]} with hidden size {hidden}{why}: inconsistent shapes in {where}")
    return TorchRNN(prefix, is_cell, chosen, input_size, hidden, out_size if proj else 0, num_layers,
                    directions == 2, bias, names, notes)


def _choose_cell(tf: TensorFile, prefix: str, gates: int, cell: str | None, hh_name: str,
                 hh_shape: tuple[int, int], hidden: int) -> tuple[str, list[str]]:
    from_shape = _CELLS_BY_GATES[gates]
    mode = _MODES.get(tf.modes.get(prefix, ""))
    wanted = normalize_cell(cell)
    if gates == 1:
        if wanted is not None and wanted.startswith("rnn_"):
            if mode is not None and mode != wanted:
                raise ConversionError(f"--cell {wanted} contradicts the TorchScript module '{display(prefix)}', "
                                      f"which is {mode}; drop --cell")
            return wanted, []
        if wanted is None:
            if mode is not None:
                return mode, []
            return "rnn_tanh", [f"'{display(prefix)}' is an Elman RNN; the file does not store its nonlinearity, "
                                f"so tanh is assumed: pass --cell rnn_relu if the model uses nonlinearity='relu' "
                                f"(the check against torch rebuilds the module under the same assumption, so it "
                                f"cannot catch a wrong one)"]
    elif wanted is None or wanted == from_shape:
        return from_shape, []
    is_what = {"lstm": "an LSTM (4H rows)", "gru": "a GRU (3H rows)", "rnn_tanh": "an RNN (H rows)"}[from_shape]
    raise ConversionError(f"--cell {wanted} does not match '{hh_name}' of shape {list(hh_shape)}: with hidden size "
                          f"{hidden} that is {is_what}; drop --cell or fix it")
