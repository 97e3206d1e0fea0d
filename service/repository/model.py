"""PackedModel: a converted model (spec, one canonical buffer per block, extras, provenance).

On disk it is ``REPO/<name>/<version>/model.safetensors``: tensors ``block{k}.weights``
(flat canonical buffer) and ``block{k}.<extra>`` (e.g. ``block0.peephole``), with the
spec and provenance as JSON in the string metadata. No pickle anywhere.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidInput, NotFound
from ..packing import block_param_count
from ..spec import RNNSpec
from .config import ModelConfig, load_config
from .files import looked_at
from .safetensors_io import bfloat16_bits_to_float32, float32_to_bfloat16_bits, load_tensors, save_tensors

FORMAT_VERSION = "1"
STORAGE_DTYPES = ("float32", "float16", "bfloat16")
MAX_VERSION = 10**18 - 1  # the most digits a version folder may have (see version_number)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: '$' also matches before a final newline


@dataclass
class PackedModel:
    """A model in cuDNN's canonical packed layout, ready to save or to hand to an engine."""

    spec: RNNSpec
    weights: list[np.ndarray]
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    storage_dtype: str = "float32"
    config: ModelConfig = field(default_factory=ModelConfig)
    name: str = ""
    version: int = 0

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.spec.blocks):
            raise InvalidInput(f"model has {len(self.spec.blocks)} blocks but {len(self.weights)} weight buffers")
        for k, (blk, w) in enumerate(zip(self.spec.blocks, self.weights)):
            need = block_param_count(blk)
            if np.asarray(w).shape != (need,):
                raise InvalidInput(f"block {k} buffer has shape {np.asarray(w).shape}, its spec needs ({need},)")
            if blk.variant.get("peephole") and f"block{k}.peephole" not in self.extras:
                raise InvalidInput(f"block {k} is an LSTM with peepholes but the model has no 'block{k}.peephole'")

    @property
    def parameter_count(self) -> int:
        """Parameters in all blocks and extras."""
        return sum(int(w.size) for w in self.weights) + sum(int(v.size) for v in self.extras.values())

    def block_extras(self, k: int) -> dict[str, np.ndarray]:
        """Extras of block k by short name (``peephole``, ...)."""
        prefix = f"block{k}."
        return {n[len(prefix):]: v for n, v in self.extras.items() if n.startswith(prefix)}

    def save(self, repository: str | Path, name: str, version: int = 1, dtype: str | None = None,
             replace: bool = True) -> Path:
        """Write ``repository/name/version/model.safetensors`` (and a default config.json if none); return it.

        ``replace`` False: refuse a version that already holds a model. A failed write leaves what was
        there before (the file is renamed into place) and raises InvalidInput naming the path.
        """
        if not _NAME_RE.fullmatch(name):
            raise InvalidInput(
                f"model name '{name}' is not allowed: use letters, digits, '_', '-', '.' (max 128), starting alphanumeric"
            )
        if not 1 <= int(version) <= MAX_VERSION:
            raise InvalidInput(f"version must be a whole number from 1 to {MAX_VERSION} (the versions a repository "
                               f"reads), got {version}")
        dtype = dtype or self.storage_dtype
        if dtype not in STORAGE_DTYPES:
            raise InvalidInput(f"dtype '{dtype}' is not supported; use one of {', '.join(STORAGE_DTYPES)}")
        tensors = {f"block{k}.weights": np.asarray(w, dtype=np.float32) for k, w in enumerate(self.weights)}
        tensors.update({n: np.asarray(v, dtype=np.float32) for n, v in self.extras.items()})
        tensors = {n: stored_weights(n, t, dtype) for n, t in tensors.items()}
        bf16 = frozenset(tensors) if dtype == "bfloat16" else frozenset()
        metadata = {
            "rnnserve.format_version": FORMAT_VERSION,
            "rnnserve.spec": self.spec.to_json(),
            "rnnserve.provenance": json.dumps(self.provenance, sort_keys=True),
            "rnnserve.dtype": dtype,
        }
        model_dir = Path(repository) / name
        vdir = model_dir / str(int(version))
        out = vdir / "model.safetensors"
        try:  # Python 3.11's exists() raises inside a folder the user cannot enter
            if not replace and out.exists():
                raise InvalidInput(f"'{out}' exists: version {int(version)} of '{name}' is converted already; pick "
                                   f"another --version, or pass --overwrite to replace it")
            for d, what, flag in ((Path(repository), "the repository", "--repository"),
                                  (model_dir, f"model '{name}'", "--name"),
                                  (vdir, f"version {int(version)}", "--version")):
                if d.exists() and not d.is_dir():  # the write's "Not a directory" named neither the file nor the fix
                    raise InvalidInput(f"'{d}' is a file where the folder of {what} goes; move it away, or pick "
                                       f"another {flag}")
            made = [d for d in (Path(repository), model_dir, vdir) if not d.exists()]
        except OSError as exc:
            raise InvalidInput(f"cannot write the model to '{out}': {exc.strerror or exc}; pick a --repository "
                               f"folder you can write to") from exc
        try:
            vdir.mkdir(parents=True, exist_ok=True)
            save_tensors(out, tensors, metadata, bfloat16=bf16)
            config = model_dir / "config.json"
            if not config.exists():
                # Only what differs from the server's defaults belongs here; see ModelConfig for every field.
                config.write_text("{}\n")
        except OSError as exc:
            for d in reversed(made):  # the folders this call made, innermost first, where nothing else came in
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise InvalidInput(f"cannot write the model to '{out}': {exc.strerror or exc}; pick a --repository "
                               f"folder you can write to") from exc
        return out


def stored_weights(name: str, weights: np.ndarray, dtype: str) -> np.ndarray:
    """``weights`` (float32) as they are stored in ``dtype`` (bfloat16: float32 holding the rounded values); refused with
    InvalidInput when a value does not fit (float16 tops out at 65504: a larger weight would be stored as inf)."""
    if dtype == "float16":
        with np.errstate(over="ignore"):  # a weight past float16's range is refused below, in words
            stored = weights.astype(np.float16)
    elif dtype == "bfloat16":
        stored = bfloat16_bits_to_float32(float32_to_bfloat16_bits(weights))
    else:
        return weights
    if not np.isfinite(stored).all():
        biggest = float(np.max(np.abs(weights)))
        raise InvalidInput(f"tensor '{name}' has a weight of magnitude {biggest:.4g}, past {dtype}'s range; "
                           f"store this model as float32 (--dtype float32)")
    return stored  # bfloat16: float32 holding the rounded values, which the writer stores exactly


def model_versions(model_dir: Path) -> list[int]:
    """Version numbers present under ``model_dir`` (folders named by integers holding model.safetensors)."""
    if not model_dir.is_dir():
        return []
    # a version folder the server may not enter is left out (unserved_folders says why), not the whole model
    return sorted(int(p.name) for p in model_dir.iterdir()
                  if version_number(p.name) is not None and looked_at((p / "model.safetensors").exists, None) is True)


def unserved_folders(model_dir: Path) -> list[str]:
    """Names of the folders under ``model_dir`` that hold no servable version, each with why (for errors that
    say why a model has no version: '01' and 'v2' look like versions to the person who made them)."""
    if not model_dir.is_dir():
        return []
    found = []
    for p in sorted(model_dir.iterdir(), key=lambda p: p.name):
        folder = looked_at(p.is_dir, None)
        if folder is None:  # a link into a folder the server may not enter
            found.append(f"'{p.name}' (cannot be read: give the server's user read and execute permission on it)")
            continue
        if not folder:
            continue
        if version_number(p.name) is None:
            found.append(f"'{p.name}' (not a version number: 1, 2, ... without leading zeros)")
        elif (present := looked_at((p / "model.safetensors").exists, None)) is None:
            found.append(f"'{p.name}' (cannot be read: give the server's user read and execute permission on it)")
        elif not present:
            found.append(f"'{p.name}' (no model.safetensors)")
    return found


def version_number(name: str) -> int | None:
    """The version a folder ``name`` holds: a whole number from 1 in ASCII digits without leading zeros, else None
    (``str.isdigit`` also takes '²' and other scripts' digits, which ``int`` refuses; '007' would be read as 7
    while its files live in a folder that version 7 does not name)."""
    if (name.isascii() and name.isdigit() and len(name) <= len(str(MAX_VERSION))
            and not name.startswith("0")):
        return int(name)
    return None


def resolve_model_path(path: str | Path) -> tuple[Path, int]:
    """Turn ``REPO/NAME`` (latest version) or ``REPO/NAME/V`` into (model_dir, version)."""
    path = Path(path)
    if path.is_file() and path.name == "model.safetensors":
        path = path.parent
    if version_number(path.name) is not None and (path / "model.safetensors").exists():
        return path.parent, int(path.name)
    versions = model_versions(path)
    if not versions:
        others = model_versions(path.parent) if version_number(path.name) is not None else []
        if others:  # REPO/NAME/V where the model has other versions
            raise NotFound(f"model '{path.parent.name}' has no version {path.name} (have {others})")
        if not path.is_dir():
            what = "no model at" if not path.exists() else "not a model folder:"
            raise NotFound(f"{what} '{path}': expected REPO/NAME or REPO/NAME/VERSION")
        if any(model_versions(p) for p in path.iterdir() if p.is_dir()):
            raise NotFound(f"'{path}' is a model repository; name one of its models: {path}/NAME")
        raise NotFound(f"'{path}' holds no version folder with a model.safetensors (e.g. {path}/1/model.safetensors)")
    return path, versions[-1]


# A block's tensors besides its weights, by the variant flag that needs them ([L*D, 3, H]: rows i, f, o).
_EXTRAS = ("peephole",)
_FLOAT_STORED = ("F32", "F16", "BF16", "F64")


def _check_tensors(file: Path, spec: RNNSpec, tensors: dict[str, np.ndarray], stored: dict[str, str],
                   dtype: Any) -> None:
    """What ``rnnserve convert`` writes and nothing else: float tensors of known names, every value finite, a known
    storage dtype. A hand-edited or damaged file otherwise served wrong numbers: integer bytes read as weights,
    a NaN weight that the compiled kernel turned into a plausible answer (NumPy answered NaN)."""
    if dtype not in STORAGE_DTYPES:
        raise InvalidInput(f"{file}: corrupt metadata: storage dtype {str(dtype)[:40]!r} is not one of "
                           f"{', '.join(STORAGE_DTYPES)}; convert the model again")
    # an extra only where its variant is on: a peephole tensor beside a block without peepholes was used all the same
    known = {f"block{k}.weights": None for k in range(len(spec.blocks))}
    known.update({f"block{k}.{n}": (blk.pseudo_layers, 3, blk.hidden_size)
                  for k, blk in enumerate(spec.blocks) for n in _EXTRAS if blk.variant.get(n)})
    for name, arr in tensors.items():
        if name not in known:
            raise InvalidInput(f"{file} has a tensor '{name[:80]}' that no part of the model uses (rnnserve writes "
                               f"block<k>.weights, and block<k>.peephole for an LSTM with peepholes); convert the "
                               f"model again")
        if known[name] is not None and tuple(arr.shape) != known[name]:
            raise InvalidInput(f"{file}: tensor '{name}' has shape {list(arr.shape)}, its block needs "
                               f"{list(known[name])}; convert the model again")
        if stored.get(name) not in _FLOAT_STORED:
            raise InvalidInput(f"{file}: tensor '{name}' is stored as {stored.get(name)}, not as floats; "
                               f"convert the model again")
        finite = np.isfinite(arr)
        if not finite.all():
            bad = int(np.flatnonzero(~finite.reshape(-1))[0])
            raise InvalidInput(f"{file}: tensor '{name}' holds {int((~finite).sum())} value(s) that are NaN or "
                               f"infinite (the first at element {bad}); the weights are damaged: convert the "
                               f"model again")


def load_model(path: str | Path, version: int | None = None) -> PackedModel:
    """Load ``REPO/NAME`` (latest version), ``REPO/NAME/V``, or the given ``version``."""
    model_dir, latest = resolve_model_path(path)
    version = latest if version is None else int(version)
    file = model_dir / str(version) / "model.safetensors"
    if not file.exists():
        raise NotFound(f"model '{model_dir.name}' has no version {version} (have {model_versions(model_dir)})")
    tensors, metadata, stored = load_tensors(file)
    if metadata.get("rnnserve.format_version") != FORMAT_VERSION or "rnnserve.spec" not in metadata:
        raise InvalidInput(f"{file} was not written by rnnserve convert (no rnnserve metadata); convert the source model")
    try:
        spec = RNNSpec.from_json(metadata["rnnserve.spec"])
        provenance = json.loads(metadata.get("rnnserve.provenance", "{}"))
    except (ValueError, KeyError, TypeError, RecursionError, InvalidInput) as exc:
        reason = exc.message if isinstance(exc, InvalidInput) else exc
        raise InvalidInput(f"{file}: corrupt spec metadata ({reason}); convert the model again") from exc
    if not isinstance(provenance, dict):
        raise InvalidInput(f"{file}: corrupt provenance metadata (not a JSON object); convert the model again")
    _check_tensors(file, spec, tensors, stored, metadata.get("rnnserve.dtype", "float32"))
    weights = []
    for k in range(len(spec.blocks)):
        key = f"block{k}.weights"
        if key not in tensors:
            raise InvalidInput(f"{file} has no tensor '{key}'; convert the model again")
        weights.append(np.asarray(tensors.pop(key), dtype=np.float32))
    extras = {n: np.asarray(v, dtype=np.float32) for n, v in tensors.items()}
    config = load_config(model_dir)
    try:
        return PackedModel(spec, weights, extras, provenance, metadata.get("rnnserve.dtype", "float32"),
                           config, model_dir.name, version)
    except InvalidInput as exc:  # a tensor's shape disagrees with the spec: say which file
        raise InvalidInput(f"{file}: {exc.message}; convert the model again") from exc
