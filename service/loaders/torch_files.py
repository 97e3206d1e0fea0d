"""Read the tensors of a PyTorch file: a torch.save state dict, a TorchScript archive or safetensors.

The kind is told from the file's first bytes, not its extension, so a renamed file
is either read correctly or refused with what it really is. Nothing in the file is
executed: state dicts go through ``torch.load(weights_only=True)``, TorchScript
through ``torch.jit.load`` (which runs no Python), safetensors through the
``safetensors`` library with the NumPy framework, so they need no torch at all.

Tensors are kept as the file gives them and turned into float64 NumPy arrays only
when asked for (:meth:`TensorFile.array`): a large checkpoint with a small RNN
inside costs no more than the RNN.
"""
from __future__ import annotations

import pickle
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import ConversionError, require_module

# Keys under which training code usually nests the state dict in a checkpoint.
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network")

_SAVE_STATE_DICT = ("save the weights only: torch.save(model.state_dict(), 'model.pt'), "
                    "or a TorchScript archive: torch.jit.save(torch.jit.script(model), 'model.pt')")


@dataclass
class TensorFile:
    """The named tensors of one file, their shapes, and how to read one as float64."""

    kind: str                                  # "state dict" | "TorchScript" | "safetensors"
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    reader: Callable[[str], np.ndarray]
    # TorchScript keeps nn.RNN's mode ("RNN_TANH", "RNN_RELU", "LSTM", "GRU") per module prefix.
    modes: dict[str, str] = field(default_factory=dict)
    checkpoint_key: list[str] = field(default_factory=list)

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float64 array; refuses integer and other non-float tensors."""
        if not _is_float(self.dtypes[name]):
            raise ConversionError(
                f"tensor '{name}' has dtype {self.dtypes[name]}; recurrent weights must be floating point")
        return np.asarray(self.reader(name), dtype=np.float64)


def _is_float(dtype: str) -> bool:
    d = dtype.lower()
    return any(k in d for k in ("float", "half", "bf16", "f16", "f32", "f64")) and "complex" not in d


def read_torch_file(path: Path) -> TensorFile:
    """Open ``path`` as whichever PyTorch weight file it is; ConversionError naming the problem otherwise."""
    size = path.stat().st_size
    if size == 0:
        raise ConversionError(f"'{path.name}' is empty (0 bytes); save the model again")
    with open(path, "rb") as f:
        head = f.read(16)
    if _looks_like_safetensors(head, size):
        return _read_safetensors(path)
    if path.suffix.lower() == ".safetensors":
        raise ConversionError(f"'{path.name}' is not a valid safetensors file (bad header); "
                              f"it is truncated or corrupt, or not safetensors: save it again")
    if head.startswith(b"PK"):
        names = _zip_names(path)
        if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
            return _read_torchscript(path)
        if any(n.endswith("data.pkl") for n in names):
            return _read_state_dict(path, mmap=True)
        if "config.json" in names and any(n.endswith(".weights.h5") for n in names):
            raise ConversionError(f"'{path.name}' is a Keras .keras archive, not a PyTorch file; "
                                  f"convert it with --format keras (and a .keras extension)")
        raise ConversionError(f"'{path.name}' is a zip archive but not a PyTorch file (no data.pkl); "
                              f"{_SAVE_STATE_DICT}")
    if head[:1] == b"\x80":  # pickle protocol 2+: torch.save's legacy (non-zip) format
        return _read_state_dict(path, mmap=False)
    raise ConversionError(f"'{path.name}' is not a PyTorch file: {_what_is_it(path, head)}. "
                          f"Expected a torch.save state dict, a TorchScript archive or a .safetensors file")


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 8 + n <= size


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            # torch.load does not check the members' CRCs, so a flipped byte in the weights would convert (and
            # verify: the check reads the same bytes) into a model that is silently wrong
            bad = z.testzip()
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
        raise ConversionError(
            f"'{path.name}' is a truncated or corrupt zip archive ({exc}); save the model again") from exc
    if bad is not None:
        raise ConversionError(f"'{path.name}' is corrupt: its member '{bad}' fails the zip's checksum (CRC); "
                              f"save the model again")
    return names


def _what_is_it(path: Path, head: bytes) -> str:
    if head.startswith(b"\x89HDF"):
        return "it is an HDF5 file (Keras .h5?); use --format keras"
    if head[:1] == b"\x08":  # protobuf field 1 (ir_version), as every ONNX model starts
        if _is_onnx(path):
            return "it is an ONNX model; convert it with --format onnx (and a .onnx extension)"
    return f"it starts with bytes {head[:8]!r}, which is neither zip, pickle nor safetensors (truncated or corrupt?)"


def _is_onnx(path: Path) -> bool:
    """Whether ``path`` parses as an ONNX model with a graph or opsets (False when it does not parse)."""
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - any parse failure means: not ONNX
        return False
    return bool(model.graph.node or model.opset_import)


def _read_safetensors(path: Path) -> TensorFile:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConversionError(
            f"'{path.name}' is a truncated or corrupt safetensors file ({exc}); save it again") from exc
    whole: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if dtypes[name] == "BF16":  # NumPy has no bfloat16; our own reader widens it to float32 exactly
            if not whole:
                from ..repository.safetensors_io import load_tensors

                whole.update(load_tensors(path)[0])
            return whole[name]
        with safe_open(str(path), framework="np") as f:
            return f.get_tensor(name)

    return TensorFile("safetensors", shapes, dtypes, read)


def _torch():
    return require_module("torch", "torch", "reading a PyTorch .pt/.pth file (safetensors files need no torch)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _read_state_dict(path: Path, mmap: bool) -> TensorFile:
    torch = _torch()
    try:  # mmap (zip format only): a large checkpoint is not read into memory for the few tensors we take
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found and found.group(1) == "torch.ScriptObject":
            # what a quantized module's state dict holds: the advice below (save the state dict) is what was done
            raise _quantized(path, "holds TorchScript objects (torch.ScriptObject), as the state dict of a quantized "
                                   "model does") from exc
        if found:
            raise ConversionError(
                f"'{path.name}' holds pickled Python objects, not only tensors (it contains {found.group(1)}); "
                f"rnnserve does not run code from model files. {_SAVE_STATE_DICT[0].upper()}{_SAVE_STATE_DICT[1:]}"
            ) from exc
        reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
        raise ConversionError(
            f"'{path.name}' could not be read: truncated or corrupt, or not a state dict of tensors "
            f"({reason.group(1).strip() if reason else _first_line(exc)}); {_SAVE_STATE_DICT}") from exc
    except Exception as exc:  # torch raises RuntimeError, EOFError, ... for damaged files
        raise ConversionError(f"'{path.name}' could not be read: truncated or corrupt ({_first_line(exc)}); "
                              f"save the model again") from exc
    tensors, keys = _unwrap_checkpoint(obj, torch, path)
    return _torch_tensor_file("state dict", tensors, torch, keys=keys)


def _read_torchscript(path: Path) -> TensorFile:
    torch = _torch()
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise ConversionError(f"'{path.name}' could not be read as a TorchScript archive: truncated or corrupt "
                              f"({_first_line(exc)}); save it again with torch.jit.save") from exc
    modes: dict[str, str] = {}
    for name, sub in module.named_modules():
        kind = _script_type(sub)
        if ".quantized." in kind and kind.rpartition(".")[2] in _RECURRENT_CLASSES:
            raise _quantized(path, f"is a quantized model (its '{name}' is {kind.removeprefix('__torch__.')})")
        try:
            mode = getattr(sub, "mode", None)
            if mode is None and getattr(sub, "nonlinearity", None) in ("tanh", "relu"):
                mode = f"RNN_{sub.nonlinearity.upper()}"  # scripted nn.RNNCell
        except Exception:  # a traced module has no such attributes; scripted nn.RNN keeps them as constants
            mode = None
        if isinstance(mode, str):
            modes[name] = mode
    tensors = dict(module.state_dict())
    _traced_rnn_modes(module, tensors, modes)
    return _torch_tensor_file("TorchScript", tensors, torch, modes=modes)


_RECURRENT_CLASSES = ("LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell")


def _script_type(module: Any) -> str:
    """A scripted or traced module's class, as TorchScript names it (mangling removed)."""
    try:
        name = module._c._type().qualified_name()
    except Exception:  # noqa: BLE001 - private API: without it, the checks that need it are skipped
        return ""
    return re.sub(r"\.___torch_mangle_\d+", "", name)


def _quantized(path: Path, what: str) -> ConversionError:
    return ConversionError(
        f"'{path.name}' {what}: torch.ao.quantization.quantize_dynamic packs a recurrent layer's weights (int8 or "
        f"float16) into objects that hold no plain tensors, and rnnserve serves float weights. Save the state dict "
        f"of the model from before quantizing, and convert that (rnnserve can store it as float16 with --dtype "
        f"float16)")


def _traced_rnn_modes(module: Any, tensors: dict[str, Any], modes: dict[str, str]) -> None:
    """A traced archive keeps no ``mode`` attribute, but its graph calls ``aten::rnn_relu`` or ``aten::rnn_tanh``
    on each Elman RNN's weights: each call's weight list names the module (``GetAttr`` chains from the archive's
    root), so each module gets its own nonlinearity (without this, a traced ReLU RNN was served as tanh)."""
    try:
        nodes = list(module.inlined_graph.nodes())
    except Exception:  # noqa: BLE001 - no graph to read: the assumption and its note stand
        return
    for node in nodes:
        kind = {"aten::rnn_relu": "RNN_RELU", "aten::rnn_tanh": "RNN_TANH"}.get(node.kind())
        if kind is None:
            continue
        params = list(node.inputs())[2].node()  # rnn_*(input, hx, params, ...): params is a ListConstruct
        for weight in params.inputs():
            path, value = [], weight
            while value.node().kind() == "prim::GetAttr":
                path.append(value.node().s("name"))
                value = value.node().input()
            name = ".".join(reversed(path))
            if name in tensors:
                modes.setdefault(name.rpartition(".")[0], kind)
                break


def _unwrap_checkpoint(obj: Any, torch: Any, path: Path) -> tuple[dict[str, Any], list[str]]:
    """The state dict inside ``obj``: {"state_dict": ...}-style checkpoints unwrap, nested dicts flatten with '.'."""
    if not isinstance(obj, Mapping):
        raise ConversionError(f"'{path.name}' holds a {type(obj).__name__}, not a state dict; {_SAVE_STATE_DICT}")
    keys: list[str] = []
    while not any(isinstance(v, torch.Tensor) for v in obj.values()):
        inner = next((k for k in CHECKPOINT_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            break
        keys.append(inner)
        obj = obj[inner]
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", obj)
    return flat, keys


def _torch_tensor_file(kind: str, tensors: dict[str, Any], torch: Any, modes: dict[str, str] | None = None,
                       keys: list[str] | None = None) -> TensorFile:
    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            return t.detach().to("cpu", torch.float64).numpy()
        except Exception as exc:  # quantized, sparse or meta tensors
            raise ConversionError(
                f"tensor '{name}' cannot be read as a dense float tensor ({_first_line(exc)})") from exc

    shapes = {n: tuple(int(s) for s in t.shape) for n, t in tensors.items()}
    dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()}
    return TensorFile(kind, shapes, dtypes, read, modes or {}, keys or [])

