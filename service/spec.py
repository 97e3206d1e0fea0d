"""RNNSpec: the framework-neutral description of a recurrent model.

A model is an ordered list of blocks; block k+1 consumes block k's output
sequence. A block is what one cuDNN RNN descriptor can express, plus an optional
``variant`` for cells cuDNN cannot run (see design.md, "Variants beyond cuDNN").
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
# Canonical gate names, in cuDNN linLayerID order.
GATE_NAMES = {"lstm": ("i", "f", "g", "o"), "gru": ("r", "z", "n"), "rnn_tanh": ("h",), "rnn_relu": ("h",)}

# Keys a variant may carry. Anything else in a file is refused at load.
VARIANT_KEYS = (
    "peephole",       # bool: LSTM peepholes; tensors block{k}.peephole [L*D, 3, H] in order i, f, o
    "reset_before",   # bool: GRU candidate uses (r*h) @ R_n.T (ONNX linear_before_reset=0, Keras reset_after=False)
    "activations",    # per direction: list of {"name", "alpha", "beta"}; LSTM [f, g, h], GRU [f, g], RNN [f]
    "clip",           # float: clip every gate pre-activation to [-clip, clip] (ONNX `clip`)
    "input_forget",   # bool: LSTM forget gate coupled as f = 1 - i (ONNX `input_forget`)
    "reverse",        # bool: a unidirectional block that reads each sequence backwards
)

ACTIVATIONS = (
    "sigmoid", "tanh", "relu", "hard_sigmoid", "affine", "leaky_relu", "thresholded_relu",
    "scaled_tanh", "elu", "softsign", "softplus",
)


_FLAGS = ("peephole", "reset_before", "input_forget", "reverse")


def _check_types(block: "BlockSpec") -> None:
    """Refuse fields of the wrong type (a hand-edited spec: ``"input_size": "3"``) before anything computes with them."""
    from .errors import InvalidInput

    def integer(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if not isinstance(block.cell, str):
        raise InvalidInput(f"block cell must be a string (one of {', '.join(CELLS)}), got {block.cell!r}")
    for name in ("input_size", "hidden_size", "num_layers", "proj_size"):
        if not integer(getattr(block, name)):
            raise InvalidInput(f"block {name} must be an integer, got {getattr(block, name)!r}")
    if not isinstance(block.bidirectional, (bool, np.bool_)):
        raise InvalidInput(f"block bidirectional must be true or false, got {block.bidirectional!r}")
    if not isinstance(block.variant, dict):
        raise InvalidInput(f"block variant must be an object of variant keys, got {block.variant!r}")
    for key in _FLAGS:
        if key in block.variant and not isinstance(block.variant[key], (bool, np.bool_)):
            raise InvalidInput(f"variant '{key}' must be true or false, got {block.variant[key]!r}")
    clip = block.variant.get("clip")
    if clip is not None and (isinstance(clip, (bool, np.bool_)) or not isinstance(clip, (int, float, np.number))
                             or not clip > 0):
        raise InvalidInput(f"variant 'clip' must be a positive number, got {clip!r}")
    acts = block.variant.get("activations")
    if acts is not None and not isinstance(acts, (list, tuple)):
        raise InvalidInput(f"variant 'activations' must be a list (one per direction), got {acts!r}")


@dataclass(frozen=True)
class BlockSpec:
    """One cuDNN-expressible stack of recurrent layers (plus an optional variant)."""

    cell: str
    input_size: int
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    proj_size: int = 0
    variant: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .errors import InvalidInput

        _check_types(self)
        if self.cell not in CELLS:
            raise InvalidInput(f"unknown cell '{self.cell}'; expected one of {', '.join(CELLS)}")
        for name in ("input_size", "hidden_size", "num_layers"):
            if int(getattr(self, name)) < 1:
                raise InvalidInput(f"block {name} must be >= 1, got {getattr(self, name)}")
        if self.proj_size:
            if self.cell != "lstm":
                raise InvalidInput(f"proj_size is only defined for LSTM, not {self.cell}")
            if not 0 < self.proj_size < self.hidden_size:
                raise InvalidInput(
                    f"proj_size must be in 1..hidden_size-1 ({self.hidden_size - 1}), got {self.proj_size}"
                )
        unknown = set(self.variant) - set(VARIANT_KEYS)
        if unknown:
            raise InvalidInput(f"unknown variant keys {sorted(unknown)}; known: {', '.join(VARIANT_KEYS)}")
        if self.variant.get("reverse") and self.bidirectional:
            raise InvalidInput("variant 'reverse' is for unidirectional blocks only")

    @property
    def gates(self) -> int:
        """G: gates per cell (LSTM 4, GRU 3, RNN 1)."""
        return GATES[self.cell]

    @property
    def directions(self) -> int:
        """D: 2 for bidirectional, else 1."""
        return 2 if self.bidirectional else 1

    @property
    def output_size(self) -> int:
        """Ho: proj_size when set, else hidden_size."""
        return self.proj_size or self.hidden_size

    @property
    def pseudo_layers(self) -> int:
        """L*D: the number of (layer, direction) pairs."""
        return self.num_layers * self.directions

    @property
    def is_cudnn(self) -> bool:
        """True when a plain cuDNN descriptor computes this block exactly."""
        return not self.variant_names

    @property
    def variant_names(self) -> list[str]:
        """Names of the variant features that are switched on."""
        return [k for k, v in self.variant.items() if v not in (None, False, 0, [], {})]

    def layer_input_size(self, layer: int) -> int:
        """in_p: I for layer 0, D*Ho after."""
        return self.input_size if layer == 0 else self.directions * self.output_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class RNNSpec:
    """An ordered list of blocks; the model's input feeds block 0."""

    blocks: tuple[BlockSpec, ...]

    def __post_init__(self) -> None:
        from .errors import InvalidInput

        if not self.blocks:
            raise InvalidInput("a model needs at least one recurrent block")
        for k in range(1, len(self.blocks)):
            prev, cur = self.blocks[k - 1], self.blocks[k]
            if cur.input_size != prev.directions * prev.output_size:
                raise InvalidInput(
                    f"block {k} expects {cur.input_size} input features but block {k - 1} "
                    f"produces {prev.directions * prev.output_size}"
                )

    @property
    def input_size(self) -> int:
        """I of the model: features per time step."""
        return self.blocks[0].input_size

    @property
    def output_size(self) -> int:
        """D*Ho of the last block: features of `output`."""
        last = self.blocks[-1]
        return last.directions * last.output_size

    @property
    def causal(self) -> bool:
        """True when every block reads forward only: step t's output depends on steps <= t alone
        (a sequence can be streamed in chunks, and padding after a sequence does not change it)."""
        return all(not b.bidirectional and not b.variant.get("reverse") for b in self.blocks)

    @property
    def is_lstm(self) -> bool:
        """True when some block carries a cell state."""
        return any(b.cell == "lstm" for b in self.blocks)

    @property
    def state_layers(self) -> int:
        """Rows of h_0/h_n: sum of L*D over blocks."""
        return sum(b.pseudo_layers for b in self.blocks)

    @property
    def cell_state_layers(self) -> int:
        """Rows of c_0/c_n: sum of L*D over LSTM blocks."""
        return sum(b.pseudo_layers for b in self.blocks if b.cell == "lstm")

    @property
    def state_size(self) -> int | None:
        """Ho shared by every block (h state width), or None when blocks differ."""
        sizes = {b.output_size for b in self.blocks}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def cell_state_size(self) -> int | None:
        """H shared by every LSTM block (c state width), or None when none or they differ."""
        sizes = {b.hidden_size for b in self.blocks if b.cell == "lstm"}
        return sizes.pop() if len(sizes) == 1 else None

    def to_json(self) -> str:
        """Serialize for safetensors metadata."""
        return json.dumps({"blocks": [b.to_dict() for b in self.blocks]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RNNSpec":
        """Parse what :meth:`to_json` wrote."""
        from .errors import InvalidInput

        data = json.loads(text)
        blocks = data.get("blocks") if isinstance(data, dict) else None
        if not isinstance(blocks, list) or not blocks or not all(isinstance(b, dict) for b in blocks):
            raise InvalidInput('the spec must be {"blocks": [{...}, ...]} with at least one block object')
        fields = {"cell", "input_size", "hidden_size", "num_layers", "bidirectional", "proj_size", "variant"}
        for k, b in enumerate(blocks):
            unknown, missing = set(b) - fields, {"cell", "input_size", "hidden_size"} - set(b)
            if unknown:
                raise InvalidInput(f"block {k} of the spec has unknown fields {sorted(unknown)}; a block's fields are "
                                   f"{', '.join(sorted(fields))}")
            if missing:
                raise InvalidInput(f"block {k} of the spec lacks {sorted(missing)}")
        return cls(tuple(BlockSpec(**b) for b in blocks))
