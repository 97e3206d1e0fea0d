"""A TorchScript archive run through its own ``forward``, beside its recurrent modules rebuilt alone.

The PyTorch loader checks a conversion by loading the file's recurrent weights into fresh
``nn.LSTM``/``nn.GRU``/``nn.RNN`` modules, which cannot see what the archive's own code does
with them: scaling the input, calling one module twice, an activation on the output. A
TorchScript archive carries that code, so here it runs whole on the probe, as onnxruntime runs a
whole ONNX file (:mod:`.onnx_file_check`). Every tensor it returns with the shape of an output
rnnserve serves (the output sequence, batch- or time-first, or its last step) must equal it;
if one such tensor differs, the archive computes something rnnserve does not serve, and the
conversion is refused (``--no-verify`` serves the recurrent modules alone on purpose).

The probe is tried batch-first and time-first, since the archive does not say which it takes. An
archive holding more tensors than its recurrent modules' (a head, an embedding) runs but is not
compared: its outputs are more than the served modules' (the loader's note names the rest); a
stack of several of its modules is then checked on the archive's graph instead, each module fed
straight from the one before (:mod:`.torchscript_links`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import VerificationError
from .torchscript_links import stack_problem
from .verify import last_line, probe_input

_RUNTIME = "torch (the archive's own forward)"
# ours(x [B, T, I] float64) -> (output [B, T, F], h [D, B, Ho], c [D, B, H] or None): the converted model at full
# length, with its last layer's final states (service.loaders.verify._final_states)
OursRunner = Callable[[np.ndarray], tuple]


def archive_check(path: Path, input_size: int, compare: bool, rtol: float, atol: float,
                  stack: list[str] | None = None) -> Callable[[OursRunner], dict]:
    """``check(ours)``: the provenance record (``{"ran": ..., "compared": [...]}``), or VerificationError.

    ``stack``: the served modules' prefixes, in order; where the outputs cannot be compared (``compare`` False),
    the archive's graph must still feed each one from the one before (:mod:`.torchscript_links`)."""

    def check(ours: OursRunner) -> dict:
        import torch

        module = torch.jit.load(str(path), map_location="cpu").eval()
        if not compare and (problem := stack_problem(module, stack or [])):
            raise VerificationError(
                f"the TorchScript archive '{path.name}' does not run its recurrent modules as the stack rnnserve "
                f"would serve: {problem}. Serve the modules one by one (--select one of them), or convert with "
                f"--no-verify to serve them stacked anyway")
        dtype = next((p.dtype for p in module.parameters()), torch.float32)
        x, _ = probe_input(input_size)
        y, h, c = (None if a is None else np.asarray(a, np.float64) for a in ours(x.astype(np.float64)))
        tol = (max(rtol, 1e-2), max(atol, 1e-2)) if dtype in (torch.float16, torch.bfloat16) else (rtol, atol)
        states = _state_forms(y, h, c)
        failures, differed = [], []
        for layout, feed, sequence in (("batch-first", x, y), ("time-first", x.transpose(1, 0, 2), y.transpose(1, 0, 2))):
            try:
                with torch.no_grad():
                    result = _entry(module)(torch.from_numpy(np.ascontiguousarray(feed)).to(dtype))
            except Exception as exc:  # noqa: BLE001 - an input the archive does not take: the other layout may fit
                failures.append(f"{layout}: {type(exc).__name__}: {last_line(exc)}")
                continue
            if not compare:
                return {"ran": True, "runtime": _RUNTIME, "compared": []}
            forms = [("output", sequence), *states]
            matched, wrong = [], []
            for where, tensor in _tensors(result, "forward()"):
                got = tensor.detach().to(torch.float64).numpy()
                fits = [(what, want) for what, want in forms if want.shape == got.shape]
                if not fits:
                    continue
                close = [what for what, want in fits if np.all(np.abs(got - want) <= tol[1] + tol[0] * np.abs(want))]
                (matched if close else wrong).append(f"{where} ({close[0] if close else fits[0][0]}, {layout})")
            if matched and not wrong:
                reduced = {"within": f"{str(dtype).removeprefix('torch.')}'s rounding (rtol {tol[0]:g}, atol "
                                     f"{tol[1]:g})"} if tol != (rtol, atol) else {}
                return {"ran": True, "runtime": _RUNTIME, "compared": matched, **reduced}
            differed += wrong
        if differed:
            raise VerificationError(
                f"the TorchScript archive '{path.name}' run whole through its own forward gives {differed[0]} "
                f"unlike its recurrent modules run alone (which the converted model matches): its code does more "
                f"with them than rnnserve serves (scales or changes the input, calls a module twice, applies a "
                f"function to the output). Convert with --no-verify to serve the recurrent modules alone")
        if len(failures) == 2:
            return {"ran": False, "reason": f"its forward does not take a float tensor [batch, time, "
                                            f"{input_size}] either way ({failures[0]})"}
        return {"ran": True, "runtime": _RUNTIME, "compared": [],
                "not_compared": "none of the tensors it returns has the shape of an output or state rnnserve serves"}

    return check


def _entry(module: Any) -> Callable:
    """The archive's forward. A scripted bare ``nn.LSTM``/``nn.GRU``/``nn.RNN`` has none: its overloads are
    saved as ``forward__0``, ``forward__1``; the one taking a Tensor is what calling the module did in Python."""
    if hasattr(module, "forward"):
        return module
    for name in module._c._method_names():  # noqa: SLF001 - TorchScript lists overloads only here
        if name.startswith("forward__"):
            arguments = module._c._get_method(name).schema.arguments  # noqa: SLF001
            if len(arguments) > 1 and str(arguments[1].type) == "Tensor":
                return getattr(module, name)
    return module


def _state_forms(y: np.ndarray, h: np.ndarray, c: np.ndarray | None) -> list[tuple[str, np.ndarray]]:
    """What an archive returns from the last layer's states, as served: the last step ``out[:, -1]``, the final
    states ``h`` [D, B, Ho] (and ``c``), each direction's ``h[d]``, and both directions' side by side
    (``cat(h[-2], h[-1])``, a bidirectional classifier's input: rnnserve's output_last)."""
    # bidirectional: out[:, -1] is not output_last, whose reverse half is the reverse direction's last state (it
    # read every step) where out[:, -1]'s has read one; the message said "last step" as if output_last matched
    last = "output_last, at full length" if h.shape[0] == 1 else \
        "output[:, -1], the output's last step, not output_last (whose reverse half is the first step's)"
    forms = [(last, y[:, -1]), ("h_n", h), *((f"h_n[{d}]", h[d]) for d in range(h.shape[0]))]
    if h.shape[0] == 2:
        forms.append(("both directions' final states", np.concatenate([h[0], h[1]], axis=1)))
    if c is not None:
        forms += [("c_n", c), *((f"c_n[{d}]", c[d]) for d in range(c.shape[0]))]
    return forms


def _tensors(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Every tensor in ``value`` (nested tuples, lists and dicts), with where it sits."""
    import torch

    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, (tuple, list)):
        for k, item in enumerate(value):
            yield from _tensors(item, f"{where}[{k}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _tensors(item, f"{where}[{k!r}]")
