"""One exception hierarchy for rnnserve; every error carries its status.

Transports map ``status`` to HTTP and gRPC codes through one table
(:data:`STATUS_TABLE`), so no route or RPC can forget an error kind.
"""
from __future__ import annotations


class RNNServeError(Exception):
    """Base of every error rnnserve raises on purpose; ``status`` names its kind."""

    status: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message


# Messages repeat what the client sent (names, shapes, versions). gRPC carries a message in a header that
# grpc-core percent-encodes (a non-ASCII byte takes 3) and refuses past 16 KiB, sometimes past 8 KiB, so a
# 17,000-character model name turned NOT_FOUND into the transport's RESOURCE_EXHAUSTED. Bounded in UTF-8 bytes.
MAX_MESSAGE_BYTES = 2000


def bounded(message: str) -> str:
    """``message`` if its UTF-8 is at most :data:`MAX_MESSAGE_BYTES`, else its head and tail around a cut mark
    (the tail keeps the advice on what to change)."""
    if len(message) <= MAX_MESSAGE_BYTES // 4:
        return message
    data = message.encode("utf-8", "replace")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    mark = f" [... {len(data) - 1200:,} bytes of the message cut ...] "
    head = data[:900].decode("utf-8", "ignore")
    tail = data[-300:].decode("utf-8", "ignore")
    return head + mark + tail


class InvalidInput(RNNServeError):
    """The caller sent something wrong (shape, dtype, value, file); the message says what to change."""

    status = "INVALID_ARGUMENT"


class NotFound(RNNServeError):
    """A model, version, stream or tensor that does not exist."""

    status = "NOT_FOUND"


class Unavailable(RNNServeError):
    """Temporarily unable: queue full, model not ready, stream limit reached."""

    status = "UNAVAILABLE"


def cut_off_by_drain(drain_timeout_s: float) -> Unavailable:
    """What a request still running when the drain's time is up gets, on every transport."""
    return Unavailable(
        f"the server is shutting down and this request did not finish within its drain timeout "
        f"({drain_timeout_s:g}s, --drain-timeout-s); retry it on another replica")


class StaleModelView(Unavailable):
    """A front-end process validated a request against a model version that has since been replaced.

    The front-end sends the request again as it came, so a client sees it only if that fails too.
    """


class TooLarge(RNNServeError):
    """A request or its answer is over a size limit of the server; the message names the limit."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(RNNServeError):
    """The request's own timeout passed before it could run."""

    status = "DEADLINE_EXCEEDED"


class ConversionError(InvalidInput):
    """A source file could not be converted; the message names the problem and the fix."""


class VerificationError(RNNServeError):
    """The converted model does not reproduce the source framework's output."""

    status = "INTERNAL"


class EngineUnavailable(RNNServeError):
    """An engine cannot run on this machine or cannot run this model (named variant)."""

    status = "UNAVAILABLE"


class NoCudaDevice(EngineUnavailable):
    """The machine has no CUDA device for the cuDNN engine (no NVIDIA device, or none the driver reports).

    ``--device auto`` on a CPU machine meets this for every model; it is the expected
    case there, not a fault, so it is logged at info level where other failures warn.
    """


class Unimplemented(RNNServeError):
    """A protocol feature rnnserve does not serve (one of Triton's extensions); the message says what instead."""

    status = "UNIMPLEMENTED"


class MissingDependency(RNNServeError):
    """An optional framework is needed for this step; the message names the extra to install."""

    status = "FAILED_PRECONDITION"


# status -> (HTTP code, gRPC status code name)
STATUS_TABLE: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "INVALID_ARGUMENT"),
    "NOT_FOUND": (404, "NOT_FOUND"),
    "UNAVAILABLE": (503, "UNAVAILABLE"),
    "DEADLINE_EXCEEDED": (504, "DEADLINE_EXCEEDED"),
    "REQUEST_TIMEOUT": (408, "DEADLINE_EXCEEDED"),  # REST only: a request body that stopped arriving
    "FAILED_PRECONDITION": (400, "FAILED_PRECONDITION"),
    "RESOURCE_EXHAUSTED": (413, "RESOURCE_EXHAUSTED"),
    "UNIMPLEMENTED": (501, "UNIMPLEMENTED"),
    "INTERNAL": (500, "INTERNAL"),
}


def require_module(module: str, extra: str, purpose: str):
    """Import an optional framework, or raise MissingDependency naming the pip extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(
            f"{purpose} needs the '{module}' package, which is not installed: "
            f"pip install 'rnnserve[{extra}]' ({exc})"
        ) from exc
