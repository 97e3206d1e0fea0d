"""Running the whole ONNX file in onnxruntime, beside the check of its rebuilt recurrent nodes.

The loader's runner (:func:`.onnx_loader.chain_model`) checks the weights and the gate
mapping on the recurrent nodes rebuilt on their own. That cannot see a file that is wrong
around them: torch's dynamo exporter writes an ``nn.LSTM`` with ``proj_size`` as a plain
LSTM of hidden size proj_size, with initial states of the wrong width, and drops the
projection (torch 2.13). onnxruntime refuses to run such a file, yet its nodes alone ran
and "verified". So the file itself must run too:

* onnxruntime loads the file and runs it on a probe (its inputs fed from their declared
  types and shapes). A file it cannot load or run is refused: the source model does not run
  in its own runtime, so nothing can be checked against it.
* Where the served stack is the whole graph (a float input reaches the first recurrent node
  through shape-only ops, and no other op computes on the input's values), each graph output
  read from the last recurrent node through shape-only ops must equal the converted model's
  output (or final state, or last step) in one of the layouts exporters write. A file whose
  graph computes more (an embedding, a head) only has to run: its outputs are not the
  served model's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
from onnx import NodeProto, TensorProto

from ..errors import VerificationError
from .onnx_graph import GraphIndex
from .onnx_nodes import value_op
from .onnx_state_check import StateClaim, check_state_claims, unchecked_claims
from .verify import last_line, runtime_lacks_kernel

# ours(x [B, T, I] float64) -> (output [B, T, F], h of the last block's last layer [D, B, Ho], its c or None)
OursRunner = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]
# Probe sizes for dynamic batch and time axes: unequal, so a layout mistake cannot match by its shape alone.
_PROBE_B, _PROBE_T = 3, 5
_FLOATS = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}
_INTS = {f"tensor({t})": np.dtype(t) for t in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                                 "uint64", "bool")}


def whole_file_check(path: Path, index: GraphIndex, chain: list[NodeProto], stack_is_graph: bool,
                     input_size: int, directions: int, rtol: float, atol: float,
                     claims: list[StateClaim] | None = None,
                     notes: list[str] | None = None) -> Callable[[OursRunner], dict]:
    """A check to run once the model is converted: ``check(ours)`` returns the provenance record
    (``{"ran": True, "compared": [output names]}``) or raises VerificationError.

    ``stack_is_graph``: no op outside the recurrent stack computes on the inputs' values (the loader's finding).
    ``claims``: the loader's notes that call a state input the graph input itself, checked on the file
    (:mod:`.onnx_state_check`), whose failures are replaced in ``notes``.
    """
    def not_run(reason: str) -> dict:
        record = {"ran": False, "reason": reason}
        if claims and notes is not None:  # the notes on state inputs then stand unchecked, and say so
            record.update(unchecked_claims(index, claims, notes, "onnxruntime did not run the file"))
        return record

    def check(ours: OursRunner) -> dict:
        import onnxruntime as ort

        try:
            # severity 4: its warnings about the file's shapes say what the error below says
            session = ort.InferenceSession(str(path), session_options(ort, 4), providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any refusal by the runtime is the file's to report
            if runtime_lacks_kernel(exc):  # valid ONNX that onnxruntime lacks a kernel for (e.g. layout=1 recurrent nodes)
                return not_run(f"onnxruntime does not support the file: {last_line(exc)}")
            raise _refused(path, index, "load", exc) from exc
        x_name = _stack_input(index, chain[0]) if stack_is_graph else None
        names = [o.name for o in session.get_outputs()]
        for sizes in _probe_sizes(session.get_inputs(), x_name):
            feeds, x, guessed = _feeds(session.get_inputs(), index, chain, x_name, input_size, sizes)
            try:
                outputs = dict(zip(names, session.run(names, feeds)))
                break
            except Exception as exc:  # noqa: BLE001
                if runtime_lacks_kernel(exc):
                    return not_run(f"onnxruntime does not support the file: {last_line(exc)}")
                if not guessed:
                    raise _refused(path, index, "run", exc) from exc
                failure = exc  # the probe may be what is wrong, not the file: the next sizes, if any
        else:
            return not_run(f"onnxruntime did not run it on rnnserve's probe, whose sizes or types for the inputs "
                           f"{', '.join(dict.fromkeys(guessed))} may not fit the file: {last_line(failure)}")
        record: dict[str, Any] = {"ran": True, "compared": []}
        if claims and notes is not None:
            record.update(check_state_claims(path, index, chain, claims, feeds, guessed, notes, ort,
                                             session_options(ort, 4)))
        if x is None:
            return record
        direct = {name: k for name in names if (k := _from_last_node(index, chain[-1], name)) is not None}
        if not direct:
            return record
        forms = _forms(ours, x, directions)
        # a float16 file computes in float16, whatever its inputs' type (onnxconverter-common's keep_io_types
        # writes float32 inputs and outputs around float16 nodes)
        half = x.dtype == np.float16 or _computes_in_half(index, chain)
        tol = (max(rtol, 1e-2), max(atol, 1e-2)) if half else (rtol, atol)
        if half:
            record["within"] = f"float16's rounding (rtol {tol[0]:g}, atol {tol[1]:g})"
        for name, k in sorted(direct.items()):
            got = np.asarray(outputs[name], np.float64)
            if not any(_close(got, want, *tol) for want in forms[k]):
                raise VerificationError(
                    f"onnxruntime's output '{name}' of the whole file '{path.name}' does not match the converted "
                    f"model on a probe batch (its recurrent nodes, rebuilt on their own, did): the graph around them "
                    f"changes the result in a way rnnserve does not serve. Check --select; if the file is right, "
                    f"report this")
            record["compared"].append(name)
        return record

    return check


def session_options(ort: Any, log_level: int) -> Any:
    """onnxruntime's options for a check: one thread (a probe is tiny), its log at ``log_level``."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = log_level
    return opts


def _computes_in_half(index: GraphIndex, chain: list[NodeProto]) -> bool:
    """Whether a recurrent node of the stack holds float16 weights (so computes in float16). A float32 node fed an
    input rounded to float16 on its way does not: that rounding is an op of the file, not its precision."""
    for node in chain:
        w = index.initializers.get(node.input[1]) if len(node.input) > 1 else None
        if w is not None and w.data_type == TensorProto.FLOAT16:
            return True
    return False


def _refused(path: Path, index: GraphIndex, what: str, exc: Exception) -> VerificationError:
    first = last_line(exc)
    hint = ""
    if _state_wider_than_node(index):
        hint = (" (an initial state wider than its node's hidden_size: torch.onnx.export's dynamo exporter writes an "
                "nn.LSTM with proj_size so, without its projection; convert the PyTorch module's state dict or "
                "TorchScript file instead)")
    return VerificationError(
        f"onnxruntime cannot {what} the file '{path.name}' itself ({type(exc).__name__}: {first}), so the conversion "
        f"cannot be checked against it; the file is likely invalid: export it again{hint}. --no-verify converts its "
        f"recurrent nodes unchecked")


def _state_wider_than_node(index: GraphIndex) -> bool:
    """Whether a recurrent node has a constant initial_h or initial_c whose width is not its hidden_size."""
    for node in index.nodes:
        if node.op_type in ("LSTM", "GRU", "RNN"):
            hidden = index.attr(node, "hidden_size")
            for slot in (5, 6):
                value = index.constant(node.input[slot]) if len(node.input) > slot and node.input[slot] else None
                if value is not None and value.ndim == 3 and value.shape[-1] != hidden:
                    return True
    return False


def _stack_input(index: GraphIndex, first: NodeProto) -> str | None:
    """The graph input that reaches the first recurrent node's X through shape-only ops, or None. Any Cast counts
    here, a rounding one too (to an integer or float16): fed that input, the file's outputs show the rounding,
    and the comparison refuses it."""
    name, node, _ = index.past_shape_ops(first.input[0], any_cast=True)
    return name if node is None and name in index.graph_inputs else None


def _from_last_node(index: GraphIndex, last: NodeProto, name: str) -> int | None:
    """Which output (0 Y, 1 Y_h, 2 Y_c) of ``last`` the graph output ``name`` is, through shape-only ops (any Cast
    too, as for :func:`_stack_input`: a truncating one is then refused by the comparison)."""
    _, node, k = index.past_shape_ops(name, any_cast=True)
    return k if node is last else None


def _picked_inputs(index: GraphIndex, chain: list[NodeProto], slots: tuple[int, ...]) -> set[str]:
    """Graph inputs that reach a recurrent node's input in ``slots`` (4 sequence_lens, 5-6 initial states) through
    ops that only pick or reshape (a Gather too: lengths fed 1s made the file's answers unlike the converted
    model's at full length)."""
    found = set()
    for node in chain:
        for slot in slots:
            if len(node.input) > slot and node.input[slot] and value_op(index, node.input[slot], set()) is None:
                feed = index.depends_on_input(node.input[slot])
                if feed is not None:
                    found.add(feed)
    return found


def _probe_sizes(inputs: list, x_name: str | None) -> list[tuple[int, int]]:
    """Sizes to try for the stack input's first two axes where the file leaves them open: (3, 5), then, where other
    inputs fix a batch (states [D, B, H] or lengths [B] exported at the example's batch), that batch on either axis."""
    tries = [(_PROBE_B, _PROBE_T)]
    fixed = set()
    for meta in inputs:
        dims = [d if isinstance(d, int) and d > 0 else None for d in meta.shape]
        if meta.name != x_name and len(dims) in (1, 3):
            fixed.add(dims[0] if len(dims) == 1 else dims[1])
    for b in sorted(d for d in fixed if d is not None):
        tries += [(b, _PROBE_T), (_PROBE_T, b)]
    return list(dict.fromkeys(tries))[:5]


def _feeds(inputs: list, index: GraphIndex, chain: list[NodeProto], x_name: str | None, input_size: int,
           sizes: tuple[int, int] = (_PROBE_B, _PROBE_T)) -> tuple[dict[str, np.ndarray], np.ndarray | None, list[str]]:
    """A probe value for every graph input, the stack's input as fed (None when the stack's input is not one
    float [*, *, I] graph input), and the inputs with a guessed size. Dims the file leaves open take the stack
    input's value for the same symbol; other open dims are guesses."""
    rng = np.random.default_rng(4321)
    symbols: dict[str, int] = {}
    x_meta = next((i for i in inputs if i.name == x_name and i.type in _FLOATS and len(i.shape) == 3), None)
    if x_meta is not None:
        for dim, default in zip(x_meta.shape, (*sizes, input_size)):
            if not isinstance(dim, int) and dim:
                symbols.setdefault(dim, default)

    guessed: list[str] = []

    def shape_of(meta, defaults=()) -> list[int]:
        dims = []
        for j, dim in enumerate(meta.shape):
            if isinstance(dim, int) and dim > 0:
                dims.append(dim)
            elif dim in symbols:
                dims.append(symbols[dim])
            else:
                dims.append(defaults[j] if j < len(defaults) else 1)
                if meta is not x_meta and meta.name not in guessed:
                    guessed.append(meta.name)
        return dims

    feeds: dict[str, np.ndarray] = {}
    x = None
    if x_meta is not None:
        x = rng.standard_normal(shape_of(x_meta, (*sizes, input_size))).astype(_FLOATS[x_meta.type])
        feeds[x_meta.name] = x
    x_chosen = x_meta is not None and any(not (isinstance(d, int) and d > 0) for d in x_meta.shape)
    lengths_inputs = _picked_inputs(index, chain, (4,)) if x is not None else set()
    # the converted model is compared at full lengths and zero states: the file's inputs that only carry them to
    # the nodes get those values in whatever type the file declares (float lengths, integer states)
    state_inputs = _picked_inputs(index, chain, (5, 6)) - lengths_inputs
    for meta in inputs:
        if meta.name in feeds:
            continue
        shape = shape_of(meta)
        if x_chosen and any(isinstance(d, int) and d > 0 for d in meta.shape) and meta.name not in guessed:
            # fixed sizes beside the sizes chosen for x (states exported at the example's batch): may not fit
            guessed.append(meta.name)
        if meta.type not in _FLOATS and meta.type not in _INTS:
            guessed.append(meta.name)  # a type the probe does not make (strings, bfloat16): fed as the file allows
            feeds[meta.name] = np.zeros(shape, object if meta.type == "tensor(string)" else np.float32)
            continue
        dtype = _FLOATS.get(meta.type) or _INTS[meta.type]
        if meta.name in lengths_inputs:
            assert x is not None
            # full lengths: the batch axis is the x axis of the same size, time the other one
            steps = x.shape[1] if shape and shape[0] == x.shape[0] else x.shape[0]
            feeds[meta.name] = np.full(shape, steps, dtype)
        elif meta.type in _FLOATS or meta.name in state_inputs:
            feeds[meta.name] = np.zeros(shape, dtype)  # initial states and the like: zeros
        else:
            feeds[meta.name] = np.ones(shape, dtype)  # token ids, flags: 1 is valid
    return feeds, x, guessed


def _forms(ours: OursRunner, x: np.ndarray, d: int) -> dict[int, list[np.ndarray]]:
    """The converted model's results in the layouts exporters write, for ``x`` read as [B, T, I] and as [T, B, I]:
    0 (Y) the output sequence, 1 (Y_h) and 2 (Y_c) the last layer's final states."""
    forms: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    for batch_first in (True, False):
        xb = np.asarray(x, np.float64) if batch_first else np.asarray(x, np.float64).transpose(1, 0, 2)
        y, h, c = ours(np.ascontiguousarray(xb))
        b, t, f = y.shape
        per_dir = y.reshape(b, t, d, f // d)
        forms[0] += [y, y.transpose(1, 0, 2), per_dir.transpose(1, 2, 0, 3), per_dir.transpose(1, 0, 2, 3), per_dir]
        for k, state in ((1, h), (2, c)):
            if state is not None:  # [D, B, Ho]
                forms[k] += [state, state.transpose(1, 0, 2), state.transpose(1, 0, 2).reshape(b, -1)]
    return forms


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    got, want = np.squeeze(got), np.squeeze(want)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= atol + rtol * np.abs(want)))
