"""Keras / TensorFlow loader: .keras archives, legacy .h5 models and weights-only .h5 files.

Files are read with zipfile and h5py (:mod:`.keras_files`); Keras itself is needed
only to verify a conversion (:mod:`.keras_runner`). Layers are mapped to canonical
form in :mod:`.keras_mapping`.

Decisions the file cannot always settle:

* ``--select a,b`` takes layers by name, in model order (in the order given when the
  file does not record the order, i.e. a Keras 3 ``.weights.h5``). Without it every
  recurrent layer is taken; they must form one chain.
* A weights-only file has no config. Layer types come from the weight shapes (GRU
  bias (2, 3u): reset_after=True; (3u,): False); directions are concatenated; nothing
  reads backwards; SimpleRNN uses tanh unless ``--cell rnn_relu``; the recurrent
  activation is Keras's default for the writing version (hard_sigmoid before Keras
  2.3, sigmoid after) unless ``recurrent_activation=`` overrides it. Each assumption
  is added to the notes that ``convert`` prints.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

from ..errors import ConversionError
from .keras_files import TRANSPARENT, KerasFile, KerasLayer, read_keras_file
from .keras_mapping import to_recurrent_layer
from .keras_runner import keras_missing, keras_runner
from .source import LoadedSource, unserved_note

OPTIONS = ("recurrent_activation",)
_SUPPORTED = ("LSTM, GRU, SimpleRNN, CuDNNLSTM, CuDNNGRU, keras.layers.RNN of one LSTMCell, GRUCell or SimpleRNNCell "
              "(a StackedRNNCells: rebuild it as one RNN layer per cell, return_sequences=True but the last, and copy "
              "the weights over), and Bidirectional wrappers of them")


def load_keras(path: Path, select: str | None = None, cell: str | None = None, **options: Any) -> LoadedSource:
    """Read a Keras file; return its selected recurrent layers in canonical form and a Keras runner."""
    path = Path(path)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConversionError(f"unknown Keras option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    override = options.get("recurrent_activation")
    if override is not None and override not in ("sigmoid", "hard_sigmoid"):
        raise ConversionError(f"recurrent_activation must be 'sigmoid' or 'hard_sigmoid', got '{override}'")
    kfile = read_keras_file(path)
    recurrent = [layer for layer in kfile.layers if layer.is_recurrent and layer.weights]
    wanted = None if select is None else {s.strip() for s in select.split(",")}
    for layer in kfile.layers:
        if layer.is_recurrent and not layer.weights and (wanted is None or layer.name in wanted):
            raise ConversionError(
                f"layer '{layer.name}' is a {layer.class_name} but '{path.name}' holds no kernel, recurrent_kernel "
                f"and bias for it; the file may be truncated, or written by a Keras version rnnserve does not "
                f"read (Keras 1): save it again with Keras 2 or 3"
            )
    if not recurrent:
        others = [f"{layer.class_name} '{layer.name}'" if layer.class_name != "?" else f"'{layer.name}'"
                  for layer in kfile.layers]
        raise ConversionError(
            f"'{path.name}' has no recurrent layer rnnserve can convert (found: {', '.join(others) or 'no layers'}); "
            f"rnnserve converts {_SUPPORTED}"
        )
    notes: list[str] = []
    chosen = _select(kfile, recurrent, select, path.name, notes)
    for layer in chosen:
        if layer.calls > 1:
            # served once, the check rebuilding it once too: it verified and answered differently from Keras
            raise ConversionError(
                f"layer '{layer.name}' is called {layer.calls} times in the model (one set of weights applied "
                f"{layer.calls} times); rnnserve serves each layer once: build the model with a layer per call "
                f"(e.g. two {layer.class_name} layers holding the same weights) and convert that")
    _check_chain(kfile, chosen, explicit=select is not None)
    for k, layer in enumerate(chosen):
        if layer.state_from:
            notes.append(f"layer '{layer.name}' starts from a state the model computes (its initial_state comes from "
                         f"{', '.join(map(repr, dict.fromkeys(layer.state_from)))}): rnnserve starts it from zeros unless the request "
                         f"sends that state as h_0{' and c_0' if layer.class_name == 'LSTM' else ''} (rows of layer "
                         f"{k} of the stack)")
    if kfile.has_config:
        _note_what_is_not_served(kfile, chosen, notes)
    default = _recurrent_default(kfile, override, notes)
    if not kfile.has_config:
        _note_weights_only(kfile, chosen, cell, notes, explicit=select is not None)
    layers = [to_recurrent_layer(layer, kfile.keras3, default, cell) for layer in chosen]
    def rebuilt(why: str) -> None:
        source.check_scope = (f"Keras layers rebuilt from the weights as rnnserve read them, not the saved model: "
                              f"Keras could not load the file ({why})")

    runner = keras_runner(path, kfile, chosen, layers, rebuilt)
    tolerance = _reduced_precision(chosen, notes)
    details = {"keras_file": kfile.kind}
    if kfile.keras_version:
        details["keras_version"] = kfile.keras_version
    # a weights-only file holds no model: the check runs Keras layers built under the assumptions noted above
    scope = "" if kfile.has_config else ("Keras layers rebuilt from the file's weights under the assumptions "
                                         "noted; a weights-only file does not hold the model they came from")
    source = LoadedSource("keras", layers, [layer.name for layer in chosen], notes, runner, ragged_ok=True,
                          details=details, unchecked_reason=keras_missing() if runner is None else "",
                          check_tolerance=tolerance, check_scope=scope)
    return source


# Keras dtype policies that compute in less than float32, and the check's (rtol, atol) for them
_REDUCED = {"float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}


def _reduced_precision(chosen: list[KerasLayer], notes: list[str]) -> tuple[float, float] | None:
    """The check's tolerance where a selected layer computes in float16 or bfloat16 (a mixed-precision model),
    with a note; None for float32 layers. The weights convert exactly either way; only Keras's own outputs
    carry the rounding, so a float32 check would fail on a correct conversion."""
    found = {}
    for layer in chosen:
        for cfg in layer.configs or []:
            policy = (cfg or {}).get("dtype")
            name = policy.get("config", {}).get("name") if isinstance(policy, dict) else policy
            compute = str(name or "").removeprefix("mixed_")
            if compute in _REDUCED:
                found.setdefault(compute, (layer.name, name))
    if not found:
        return None
    compute, (layer, policy) = next(iter(found.items()))
    rtol, atol = _REDUCED[compute]
    notes.append(f"layer '{layer}' computes in {compute} in Keras (dtype policy '{policy}'); rnnserve serves it in "
                 f"float32 from the same weights, so outputs differ from Keras's by {compute} rounding (checked "
                 f"within {atol:g} + {rtol:g}*|x|)")
    return rtol, atol


MASK_OPS = frozenset({"NotEqual", "Any"})


def _note_what_is_not_served(kfile: KerasFile, chosen: list[KerasLayer], notes: list[str]) -> None:
    """Say where the served model differs from the file's whole model: layers around the recurrent stack, masking,
    and a backwards last layer's output order. The check against Keras runs the stack alone, so it cannot tell."""
    names = {layer.name for layer in chosen}
    masked = any(layer.class_name == "Masking" for layer in kfile.layers)
    # a functional model with Masking stores the mask's computation as op layers (NotEqual, Any): not the user's
    plumbing = MASK_OPS if masked else frozenset()
    others = [f"{layer.class_name} '{layer.name}'" for layer in kfile.layers
              if layer.name not in names and layer.class_name not in TRANSPARENT | plumbing]
    if others:
        notes.append(unserved_note(_stack(chosen), "model", ", ".join(others), "layer"))
    masked_embedding = [layer.name for layer in kfile.layers if layer.class_name == "Embedding"
                        and ((layer.configs or [None])[0] or {}).get("mask_zero")]
    if masked_embedding:
        notes.append(f"Embedding {', '.join(map(repr, masked_embedding))} has mask_zero=True: Keras skips the steps "
                     f"whose token is 0; send each sequence's length ('lengths') instead, with the padding at the end")
    stateful = [layer.name for layer in chosen if ((layer.configs or [None])[0] or {}).get("stateful")]
    if stateful:
        notes.append(f"{', '.join(map(repr, stateful))} {'is' if len(stateful) == 1 else 'are'} stateful=True: Keras "
                     f"carries the state from one call to the next; rnnserve answers each request from zeros (or its "
                     f"h_0/c_0) unless the requests form a stream (sequence_id: see the README, Streaming)")
    if masked:
        notes.append("Masking is served as per-sequence lengths: send each sequence's length ('lengths', or ragged "
                     "instances to /v1 predict) rather than masked padding; a masked step inside a sequence is not "
                     "skipped as Keras skips it")
    last = chosen[-1]
    cfg = (last.configs or [None])[0] or {}
    if not last.bidirectional and cfg.get("go_backwards") and cfg.get("return_sequences"):
        notes.append(f"layer '{last.name}' has go_backwards=True: the served 'output' is in the input's time order "
                     f"(step t read steps t..T-1), where Keras returns it reversed; 'output_last' is Keras's last step")


def _stack(chosen: list[KerasLayer]) -> str:
    return "the recurrent stack " + " -> ".join(layer.name for layer in chosen)


def _describe(layers: list[KerasLayer]) -> str:
    return ", ".join(f"'{layer.name}' ({'Bidirectional ' if layer.bidirectional else ''}{layer.class_name})"
                     for layer in layers)


def _select(kfile: KerasFile, recurrent: list[KerasLayer], select: str | None, fname: str,
            notes: list[str]) -> list[KerasLayer]:
    if select is None:
        if kfile.order_known:
            return recurrent
        return _infer_order(recurrent, notes)
    wanted = [s.strip() for s in select.split(",") if s.strip()]
    if not wanted:
        raise ConversionError("--select is empty; name one or more layers, e.g. --select " + recurrent[0].name)
    by_name = {layer.name: layer for layer in kfile.layers}
    for name in wanted:
        layer = by_name.get(name)
        if layer is None:
            raise ConversionError(f"--select names '{name}', which is not a layer of '{fname}'; its recurrent "
                                  f"layers are {_describe(recurrent)}")
        if not (layer.is_recurrent and layer.weights):
            kind = f"a {layer.class_name} layer" if layer.class_name != "?" else "not a layer rnnserve can read"
            looks_rnn = re.search(r"(RNN|LSTM|GRU|Recurrent|Cell)", layer.class_name or "", re.I)
            why = (f"a {layer.class_name}, a recurrent layer type rnnserve cannot convert (it converts "
                   f"{_SUPPORTED})") if looks_rnn else f"{kind}, not a recurrent layer"
            raise ConversionError(f"--select names '{name}', which is {why}; the recurrent layers of '{fname}' "
                                  f"are {_describe(recurrent)}")
    if len(set(wanted)) != len(wanted):
        raise ConversionError(f"--select names a layer twice: {select}")
    if kfile.order_known:
        return [layer for layer in kfile.layers if layer.name in wanted]
    return [by_name[name] for name in wanted]


def _infer_order(recurrent: list[KerasLayer], notes: list[str]) -> list[KerasLayer]:
    """Order the layers of a Keras 3 weights file, which records no order, by chaining their sizes."""
    def width(layer: KerasLayer) -> tuple[int, int]:
        k, r = layer.weights[0]["kernel"], layer.weights[0]["recurrent_kernel"]
        return k.shape[0], len(layer.weights) * r.shape[0]

    def creation(layer: KerasLayer) -> tuple[str, int]:
        # Keras 3 names a container's layers <class>, <class>_1, ... in model order
        m = re.match(r"(.*?)(?:_(\d+))?$", layer.where.rsplit("/", 1)[-1])
        return m.group(1), int(m.group(2) or 0)

    def in_class_order(perm: tuple[KerasLayer, ...]) -> bool:
        seen: dict[str, int] = {}
        for layer in perm:
            cls, k = creation(layer)
            if k < seen.get(cls, -1):
                return False
            seen[cls] = k
        return True

    if len(recurrent) == 1:
        return recurrent
    chains = []
    if len(recurrent) <= 7:
        for perm in itertools.permutations(recurrent):
            if all(width(b)[0] == width(a)[1] for a, b in zip(perm, perm[1:])) and in_class_order(perm):
                chains.append(perm)
    names = _describe(recurrent)
    if len(chains) != 1:
        why = "no order of them forms a chain" if not chains else "more than one order fits their sizes"
        raise ConversionError(
            f"this weights-only file does not record the order of its layers and {why} (recurrent layers: "
            f"{names}); pass --select with the layers in model order"
        )
    notes.append("the weights file does not record layer order; the order was inferred from layer sizes: "
                 + ", ".join(layer.name for layer in chains[0]))
    return list(chains[0])


def _check_chain(kfile: KerasFile, chosen: list[KerasLayer], explicit: bool) -> None:
    """Each chosen layer must read the previous one's full output sequence, in time order."""
    def refuse(reason: str) -> None:
        hint = ("select a consecutive chain of recurrent layers" if explicit else
                f"the recurrent layers {_describe(chosen)} do not form one chain; pass --select with a "
                f"consecutive chain, e.g. --select {chosen[0].name}")
        raise ConversionError(f"{reason}: {hint}")

    by_name = {layer.name: layer for layer in kfile.layers}
    for a, b in zip(chosen, chosen[1:]):
        if b.upstream is not None and b.upstream != a.name:
            src = by_name.get(b.upstream)
            what = "the model input" if b.upstream == "" else (
                f"'{b.upstream}' ({src.class_name})" if src else f"'{b.upstream}'")
            refuse(f"layer '{b.name}' reads {what}, not the output of '{a.name}'")
        cfg = (a.configs or [None])[0] or {}
        if cfg and not cfg.get("return_sequences", False):
            refuse(f"layer '{a.name}' has return_sequences=False, so '{b.name}' does not read its output sequence")
        if cfg.get("go_backwards") and not a.bidirectional:
            refuse(f"layer '{a.name}' has go_backwards=True, so Keras hands '{b.name}' its outputs in reversed "
                   f"time order, which rnnserve's reverse blocks do not do")
        if a.wrapper and a.wrapper.get("merge_mode", "concat") != "concat":
            continue  # its width is not its directions' sum; the layer's mapping refuses it, naming its merge_mode
        wa = a.weights[0]["recurrent_kernel"].shape[0] * len(a.weights)
        wb = b.weights[0]["kernel"].shape[0]
        if wa != wb:
            refuse(f"layer '{b.name}' takes {wb} features but '{a.name}' produces {wa}")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3]) or (0,)


def _recurrent_default(kfile: KerasFile, override: str | None, notes: list[str]) -> str:
    """Keras's default recurrent_activation for files without a config (hard_sigmoid before Keras 2.3)."""
    if kfile.has_config:
        if override is not None:
            notes.append(f"recurrent_activation={override} was ignored: the file's model config records each "
                         f"layer's activations")
        return "sigmoid"
    if override is not None:
        notes.append(f"recurrent_activation={override} as requested (the weights-only file does not record it)")
        return override
    if kfile.keras3:
        notes.append("weights-only Keras 3 file: recurrent_activation assumed to be Keras 3's default 'sigmoid'; "
                     "if the model used another, pass --recurrent-activation")
        return "sigmoid"
    version = kfile.keras_version or "unknown"
    if kfile.keras_version and _version_tuple(kfile.keras_version) < (2, 3):
        extra = (" (tf.keras in TF 2.0/2.1 also wrote this version but defaulted to 'sigmoid')"
                 if "tf" in kfile.keras_version else "")
        notes.append(f"weights-only file from Keras {version}: recurrent_activation assumed to be that version's "
                     f"default 'hard_sigmoid' (clip(0.2x+0.5, 0, 1)){extra}; if the model used 'sigmoid', pass "
                     f"--recurrent-activation sigmoid")
        return "hard_sigmoid"
    notes.append(f"weights-only file from Keras {version}: recurrent_activation assumed to be 'sigmoid' (the "
                 f"default since Keras 2.3); if the model used 'hard_sigmoid', pass --recurrent-activation "
                 f"hard_sigmoid")
    return "sigmoid"


# default names of layers that change no values at inference (an Input, dropout and noise, masking, reshapes)
_INERT = ("input", "dropout", "spatial_dropout", "gaussian_noise", "gaussian_dropout", "alpha_dropout", "masking",
          "reshape", "permute")


def _note_weights_only(kfile: KerasFile, chosen: list[KerasLayer], cell: str | None, notes: list[str],
                       explicit: bool) -> None:
    """Record what was inferred from shapes; apply --cell to SimpleRNN layers (their activation). Refuse a stack
    of several recurrent layers beside other weighted layers unless --select named it: the file cannot say
    whether those sit between them."""
    names = {layer.name for layer in chosen}
    others = [f"'{layer.name}'" for layer in kfile.layers if layer.name not in names and layer.holds_weights]
    # layers that change values without weights (an Add of a skip connection, an Activation) may sit between too;
    # the file names every layer, weighted or not, by class-derived names when the model did not name them
    between = others + [f"'{layer.name}'" for layer in kfile.layers if layer.name not in names
                        and not layer.holds_weights and not layer.name.startswith(_INERT)]
    if between and len(chosen) > 1 and not explicit:
        raise ConversionError(
            f"this weights-only file does not record how its layers connect: {', '.join(between)} may sit between "
            f"the recurrent layers {_describe(chosen)}, which would then be served as one stack without it (and "
            f"the check, rebuilt from the same file, cannot tell). Convert the model's .keras or full .h5 save, "
            f"whose config says; or pass --select with the recurrent layers if nothing lies between them")
    descs = []
    for layer in chosen:
        w = layer.weights[0]
        desc = f"'{layer.name}' {'Bidirectional ' if layer.bidirectional else ''}{layer.class_name}"
        if layer.class_name == "GRU":
            desc += f" reset_after={w.get('bias') is not None and w['bias'].ndim == 2} (from the bias shape)"
        if layer.class_name == "SimpleRNN":
            act = "relu" if cell == "rnn_relu" else "tanh"
            layer.configs = [{"activation": act} for _ in layer.weights]
            desc += f" activation={act}" + ("" if cell else " (assumed; pass --cell rnn_relu for relu)")
        else:
            desc += (" activation=tanh (assumed: the file does not record it, and no option changes it; a model "
                     "with another must be converted from its .keras or full .h5 save)")
        if layer.bidirectional:
            desc += " merge_mode=concat (assumed)"
        descs.append(desc)
    notes.append("weights-only file (no model config): layer types inferred from weight shapes: "
                 + "; ".join(descs) + "; go_backwards=False assumed for every layer (the check rebuilds the "
                 "layers under the same assumptions, so it cannot catch a wrong one)")
    if others:
        notes.append(unserved_note(_stack(chosen), "file", f"weights of {', '.join(others)}", "layer"))
