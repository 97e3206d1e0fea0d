"""ModelSignature: the fixed tensor names, shapes and datatypes every rnnserve model serves.

Inputs: ``input`` [B, T, I] (FP32, FP16 or FP64), optional ``lengths`` [B] (INT32 or
INT64; default T for every sequence), optional ``h_0`` [B, L*D, Ho] and ``c_0``
[B, L*D, H] (LSTM only). Outputs: ``output`` [B, T, D*Ho], ``output_last`` [B, D*Ho],
``h_n`` [B, L*D, Ho], ``c_n`` [B, L*D, H] (LSTM only). Outputs are always FP32,
whatever the input's datatype: engines compute in float32 (or reduced precision on
GPU, accumulated in float32), so FP32 is the exact result and one datatype keeps
clients simple. -1 marks a variable dimension in metadata.

A model whose blocks have different state sizes has no single state tensor, so it
has no ``h_0``/``c_0``/``h_n``/``c_n``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..spec import RNNSpec

FLOAT_TYPES = ("FP32", "FP16", "FP64")
INT_TYPES = ("INT32", "INT64")


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor in model metadata."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelSignature:
    """Inputs and outputs of one model, derived from its spec."""

    input_size: int
    output_size: int
    state_rows: int
    state_size: int | None
    cell_rows: int
    cell_size: int | None
    causal: bool = True  # every block reads forward only, so a sequence can be streamed in chunks

    @classmethod
    def of(cls, spec: RNNSpec) -> "ModelSignature":
        cell_size = spec.cell_state_size if spec.is_lstm else None
        return cls(spec.input_size, spec.output_size, spec.state_layers, spec.state_size,
                   spec.cell_state_layers, cell_size, spec.causal)

    # Read on every request: computed once per signature (cached_property stores into the
    # instance __dict__, which a frozen dataclass allows).
    @cached_property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("input", "FP32", (-1, -1, self.input_size)), TensorSpec("lengths", "INT32", (-1,)),
                *self._states("h_0", "c_0"))

    @cached_property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (TensorSpec("output", "FP32", (-1, -1, self.output_size)),
                TensorSpec("output_last", "FP32", (-1, self.output_size)), *self._states("h_n", "c_n"))

    def _states(self, h: str, c: str) -> list[TensorSpec]:
        out = []
        if self.state_size is not None:
            out.append(TensorSpec(h, "FP32", (-1, self.state_rows, self.state_size)))
        if self.cell_size is not None:
            out.append(TensorSpec(c, "FP32", (-1, self.cell_rows, self.cell_size)))
        return out

    @cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @cached_property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)
