"""PyTorch loader: state dicts (.pt/.pth/.bin), TorchScript archives and .safetensors files.

``load_torch`` reads the file (:mod:`.torch_files`), finds its recurrent modules
by tensor names (:mod:`.torch_modules`), takes the one asked for, and returns
one :class:`RecurrentLayer` per torch layer. Choosing a module:

- no ``select``: the file must hold exactly one recurrent module; with several,
  the error lists them (prefix, cell, sizes) and asks for ``--select``;
- ``select="encoder.rnn"``: the module whose tensors are ``encoder.rnn.weight_*``;
  ``<root>`` names a module saved at the top level;
- ``select="rnns.0,rnns.1"``: several modules stacked in that order (e.g. an
  nn.ModuleList of single-layer LSTMs). A prefix that holds several modules is
  refused rather than guessed, since an encoder and a decoder are not a stack.

When torch is installed the returned runner rebuilds the selected modules as
nn.LSTM/nn.GRU/nn.RNN (batch_first, float64 so that verification measures the
weight mapping, not fp32 rounding) and runs them on packed sequences.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConversionError
from .source import LoadedSource, SourceRunner, option_flags, unserved_note
from .torch_files import TensorFile, read_torch_file
from .torch_modules import ROOT, TorchRNN, describe_module, display, find_modules, normalize_cell
from .torchscript_check import archive_check
from .verify import ATOL, RTOL

_TORCH_CLASS = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN", "rnn_relu": "RNN"}


def load_torch(path: Path, select: str | None = None, cell: str | None = None, **options: Any) -> LoadedSource:
    """Read a PyTorch weight file into canonical layers; see the module docstring for ``select``."""
    if options:
        raise ConversionError(f"a PyTorch file takes no {option_flags(options)}; it takes --select and --cell")
    normalize_cell(cell)  # an unknown --cell fails before the file is read
    path = Path(path)
    tf = read_torch_file(path)
    modules = _select(tf, path, select, cell)
    layers = [layer for module in modules for layer in module.layers(tf)]
    notes = [note for module in modules for note in module.notes]
    if tf.checkpoint_key:
        notes.insert(0, "took the state dict from checkpoint" + "".join(f"['{k}']" for k in tf.checkpoint_key))
    owned = {name for module in modules for name in module.names.values()}
    unserved = _unserved_modules(tf, modules, owned)
    if unserved:
        # the check against torch rebuilds only the recurrent modules, and output shapes often match the whole
        # model's, so this note is the one place a user learns the served model is a part
        notes.append(unserved_note(" -> ".join(display(m.prefix) for m in modules), "file",
                                   f"tensors of {', '.join(unserved)}", "module"))
    notes += _state_like(tf, modules, owned)
    details = {"torch": {"file": tf.kind, "modules": [m.label() for m in modules]}}
    runner = _runner(modules, tf)
    if tf.kind == "TorchScript":
        scope = ""
        file_check = None if runner is None else archive_check(path, layers[0].input_size, not unserved, RTOL, ATOL,
                                                                   stack=[m.prefix for m in modules])
    else:
        kinds = sorted({f"nn.{_TORCH_CLASS[m.cell]}" for m in modules})
        scope = (f"the file's weights in rebuilt {' and '.join(kinds)} modules: a {tf.kind} holds no code, so what "
                 f"the model does around or between them is not checked")
        file_check = None
    return LoadedSource("torch", layers, [display(m.prefix) for m in modules], notes, runner=runner, ragged_ok=True,
                        details=details, file_check=file_check, check_scope=scope)


def _select(tf: TensorFile, path: Path, select: str | None, cell: str | None) -> list[TorchRNN]:
    prefixes = find_modules(tf)
    if not prefixes:
        sample = ", ".join(f"'{n}'" for n in list(tf.shapes)[:5]) or "none"
        raise ConversionError(
            f"no recurrent weights in '{path.name}' ({len(tf.shapes)} tensors, e.g. {sample}): expected names of "
            f"nn.LSTM/nn.GRU/nn.RNN parameters (weight_ih_l0, weight_hh_l0, ...) or of their cells (weight_ih, "
            f"weight_hh). Save the state dict of the model that contains the recurrent layer")
    if select is None or not select.strip():
        if len(prefixes) == 1:
            return [describe_module(tf, prefixes[0], cell)]
        raise ConversionError(f"'{path.name}' holds {len(prefixes)} recurrent modules: {_candidates(tf, prefixes)}; "
                              f"pass --select PREFIX to choose one")
    chosen = []
    parts = [p.strip().rstrip(".") for p in select.split(",")]
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        # stacking a module on itself is a typo far more often than weight sharing, and a stored model
        # holds each layer once
        raise ConversionError(f"--select names {', '.join(repr(p) for p in twice)} more than once; name each "
                              f"recurrent module once, in the order the model stacks them")
    for part in parts:
        prefix = "" if part == ROOT else part
        if prefix in prefixes:
            chosen.append(describe_module(tf, prefix, cell))
            continue
        inside = [p for p in prefixes if p.startswith(prefix + ".")]
        if inside:
            raise ConversionError(
                f"--select '{part}' holds {len(inside)} recurrent modules: {_candidates(tf, inside)}; pass one of "
                f"them, or several separated by commas to stack them in that order")
        if part in tf.shapes:
            parent = part.rpartition(".")[0]
            hint = f" '{display(parent)}'" if parent in prefixes else ""
            raise ConversionError(f"--select '{part}' names a tensor, not a module; pass the module prefix{hint}")
        has_tensors = any(n.startswith(prefix + ".") for n in tf.shapes)
        what = "has tensors but no recurrent weights" if has_tensors else "matches no tensor in the file"
        raise ConversionError(f"--select '{part}' {what}; recurrent modules in '{path.name}': "
                              f"{_candidates(tf, prefixes)}")
    return chosen


def _state_like(tf: TensorFile, modules: list[TorchRNN], owned: set[str]) -> list[str]:
    """Notes for the file's other tensors shaped like an initial state of the first module ([L*D, (B,) Ho or H]): a
    learned h0 the model starts from, which a served model starts from zeros without. ``owned``: the served
    modules' tensors."""
    first = modules[0]
    rows, widths = first.num_layers * first.directions, {first.output_size, first.hidden_size}
    notes = []
    for name, shape in tf.shapes.items():
        if name not in owned and len(shape) in (2, 3) and shape[0] == rows and shape[-1] in widths:
            notes.append(f"tensor '{name}' {list(shape)} has the shape of an initial state of "
                         f"'{display(first.prefix)}': if the model starts from it, send it as h_0 (c_0 for an LSTM's "
                         f"cell state) with each request, since rnnserve starts from zeros")
    return notes


def _unserved_modules(tf: TensorFile, modules: list[TorchRNN], owned: set[str]) -> list[str]:
    """The modules (by prefix, '<root>' for top-level tensors) that hold the file's other tensors; tensors beside a
    served module's weights by their own names. ``owned``: the served modules' tensors."""
    served = {module.prefix for module in modules}
    # beside a served module's own weights (a step counter, a learned state) the tensor is named, not its module
    others = dict.fromkeys(name if name.rpartition(".")[0] in served else display(name.rpartition(".")[0])
                           for name in tf.shapes if name not in owned)
    return [f"'{other}'" for other in others]


def _candidates(tf: TensorFile, prefixes: list[str]) -> str:
    out = []
    for prefix in prefixes:
        try:
            out.append(describe_module(tf, prefix).label())
        except ConversionError as exc:
            out.append(f"'{display(prefix)}' (unreadable: {exc.message})")
    return "; ".join(out)


def _runner(modules: list[TorchRNN], tf: TensorFile) -> SourceRunner | None:
    try:
        import torch
    except ImportError:
        return None
    nets = []
    for module in modules:
        kwargs = dict(input_size=module.input_size, hidden_size=module.hidden_size, num_layers=module.num_layers,
                      bias=module.bias, batch_first=True, bidirectional=module.bidirectional, dtype=torch.float64)
        if module.cell == "lstm":
            net = torch.nn.LSTM(proj_size=module.proj_size, **kwargs)
        elif module.cell == "gru":
            net = torch.nn.GRU(**kwargs)
        else:
            net = torch.nn.RNN(nonlinearity=module.cell.removeprefix("rnn_"), **kwargs)
        net.load_state_dict({k: torch.from_numpy(v) for k, v in module.torch_state_dict(tf).items()})
        nets.append(net.eval())

    def run(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        steps = x.shape[1]
        lens = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
        seq = torch.from_numpy(np.asarray(x, dtype=np.float64))
        with torch.no_grad():
            for net in nets:
                packed = pack_padded_sequence(seq, lens, batch_first=True, enforce_sorted=False)
                seq, _ = pad_packed_sequence(net(packed)[0], batch_first=True, total_length=steps)
        return seq.numpy()

    return run
