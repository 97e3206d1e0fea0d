"""ServeSettings: every knob of `rnnserve serve`, from RNNSERVE_* env vars and CLI flags.

One pydantic-settings class is the single source: each field is an env var
(``RNNSERVE_<FIELD>``) and a flag (``--field-name``) whose help is the field's
description. Precedence: CLI flag > env var > default.

The batching and stream fields (``max_batch_size``, ``max_queue_delay_us``, ``max_queue_size``,
``max_sequence_length``, ``max_batch_memory_mb``, ``max_streams``, ``stream_idle_timeout_s``) are server-wide defaults for every model; a model's
``config.json`` overrides them (see :func:`service.registry.effective_config`).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import InvalidInput
from .finite import MAX_SECONDS, FiniteFloat
from .repository.config import (MAX_BATCH_SIZE, MAX_COUNT, MAX_FRONTEND_IN_FLIGHT, MAX_MEMORY_MB, MAX_QUEUE_DELAY_US,
                                MAX_SEQUENCE_LENGTH)

LOG_LEVELS = ("debug", "info", "warning", "error")
# RNNSERVE_* variables that are not serve settings: engine knobs read where they apply (the cuDNN library's path,
# service.engines.cudnn.library.ENV_LIBRARY; the native CPU kernels' switch, service.engines.reference.native.ENV_SWITCH)
OTHER_VARIABLES = frozenset({"RNNSERVE_CUDNN_LIBRARY", "RNNSERVE_NATIVE_CPU"})
# Kubernetes gives every pod variables for each Service of its namespace (enableServiceLinks, on by default): a
# Service named rnnserve (deploy/kubernetes) or rnnserve-x makes RNNSERVE_SERVICE_HOST, RNNSERVE_SERVICE_PORT[_HTTP],
# RNNSERVE_PORT=tcp://..., RNNSERVE_PORT_8000_TCP[_PROTO|_PORT|_ADDR]. They are not settings, nor misspelt ones.
_SERVICE_LINK = re.compile(r"RNNSERVE_(?:\w+_)?(?:SERVICE_(?:HOST|PORT(?:_\w+)?)"
                           r"|PORT_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)")
_SERVICE_LINK_PORT = re.compile(r"RNNSERVE_(?:\w+_)?PORT")  # with a value tcp://IP:PORT
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC takes its message limits as a C int


class ServeSettings(BaseSettings):
    """Settings of `rnnserve serve`."""

    model_config = SettingsConfigDict(env_prefix="RNNSERVE_", extra="forbid")

    repository: Path = Field(Path("models"), description="Model repository: DIR/<name>/<version>/model.safetensors.")
    host: str = Field("0.0.0.0", min_length=1, description="Address the HTTP and gRPC servers listen on.")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP (REST) port; 0 picks a free port.")
    grpc_port: int = Field(8001, ge=-1, le=65535, description="gRPC port; 0 picks a free port, -1 turns gRPC off.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Engine device: cuda (cuDNN), cpu (the reference engine: NumPy, compiled kernels for plain float32 LSTM/GRU) or auto (cuDNN when available)."
    )
    max_batch_size: int = Field(64, ge=1, le=MAX_BATCH_SIZE, description="Default most sequences per engine call.")
    max_queue_delay_us: int = Field(
        0, ge=0, le=MAX_QUEUE_DELAY_US,
        description="Default time the oldest waiting request may wait for a fuller batch (µs); 0 (Triton's default) "
                    "starts a batch as soon as the engine is free, and requests arriving meanwhile form the next one.",
    )
    max_queue_size: int = Field(1024, ge=1, le=MAX_COUNT,
                                description="Default requests waiting per model; more get 503 at once.")
    max_sequence_length: int = Field(100_000, ge=1, le=MAX_SEQUENCE_LENGTH,
                                     description="Default longest T accepted per request.")
    max_batch_memory_mb: int = Field(
        0, ge=0, le=MAX_MEMORY_MB, description="Default working memory one engine call of a model may use, in MiB; a request needing "
                             "more alone gets 413 / RESOURCE_EXHAUSTED. 0: a quarter of the machine's memory (GPU: "
                             "of the smaller of host and GPU memory).",
    )
    max_streams: int = Field(
        1024, ge=1, le=MAX_COUNT, description="Default live stateful streams (sequence_id) per model; one more gets UNAVAILABLE (503)."
    )
    stream_idle_timeout_s: FiniteFloat = Field(
        60.0, gt=0, le=MAX_SECONDS, description="Default seconds a stateful stream may go without a chunk before its state is dropped."
    )
    frontend_in_flight: int = Field(
        2, ge=1, le=MAX_FRONTEND_IN_FLIGHT,
        description="Default messages each front-end process keeps in the engine process per model (with "
                    "--frontends); requests validated meanwhile wait and leave merged. Raise it (4-8) for larger, "
                    "GPU-bound models, whose batches cost about the same with more rows.",
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, le=MAX_MESSAGE_BYTES,
        description="Largest request body (HTTP) or message (gRPC) accepted, in bytes. It bounds answers too: gRPC "
                    "messages, and HTTP answers sent as JSON (~20 bytes a number; binary outputs are not held to it); "
                    "at most 2 GiB - 1, gRPC's own limit.",
    )
    body_timeout_s: FiniteFloat = Field(
        60.0, ge=0, le=MAX_SECONDS,
        description="Longest pause, in seconds, between the parts of an HTTP request body, and the longest time a "
                    "request's headers may take to arrive whole (from their first byte, or the connection's start). "
                    "A client that sends its headers or part of a body and then stops gets 408 and the connection "
                    "closes, instead of holding it and its buffered bytes for good. 0: no limit.",
    )
    max_grpc_calls: int = Field(
        4096, ge=0, le=10_000_000,
        description="Most gRPC calls in progress at once in each server process (streams and health watches "
                    "count); one more is refused with RESOURCE_EXHAUSTED at once. grpc buffers each call's message "
                    "(up to --max-request-bytes) before it is handled, so this times that is what partial messages "
                    "can hold (logged at start): behind untrusted clients lower one or the other. Each connection "
                    "also holds at most 1,024 calls open. 0: no limit.",
    )
    max_grpc_connections: int = Field(
        0, ge=0, le=10_000_000,
        description="Most gRPC connections open at once in each server process; one more is closed before its "
                    "handshake. A connection must send HTTP/2's preface within --body-timeout-s, and one with no "
                    "call for 300 s is closed. 0: an eighth of the process's open-file limit (ulimit -n).",
    )
    max_http_connections: int = Field(
        0, ge=0, le=10_000_000,
        description="Most HTTP connections open at once in each server process; one more gets 503 and is closed at "
                    "once, so that idle connections cannot take every file descriptor (gRPC's too). 0: three quarters "
                    "of the process's open-file limit (ulimit -n).",
    )
    frontends: int = Field(
        1, ge=1, le=64,
        description="HTTP/gRPC front-end processes. 1 serves everything in one process; N > 1 starts N processes "
                    "that share the ports, validate requests and forward them to this one, which runs the engines, "
                    "batching and streams (one Python process serves ~2,000-4,000 requests/s).",
    )
    http_balance: Literal["connections", "kernel"] = Field(
        "connections",
        description="How HTTP connections spread over the front-end processes (with --frontends): connections: "
                    "the front-end holding the fewest accepts the next one, so kept-alive connections stay even; "
                    "kernel: each front-end listens with SO_REUSEPORT and the kernel hashes connections to them "
                    "(uneven while connections last). gRPC is always spread by the kernel.",
    )
    engines: int = Field(
        1, ge=1, le=16,
        description="Engine processes (instances of every model, like Triton's instance_group count). N > 1 starts "
                    "N processes that each load every model on the same device and batch on their own; front-ends "
                    "send each request to the least busy one and every chunk of a stream to the same one (by "
                    "sequence_id). Queue and stream limits apply per engine process. Implies front-end processes "
                    "(at least one).",
    )
    child_stall_timeout_s: FiniteFloat = Field(
        60.0, ge=0, le=MAX_SECONDS,
        description="With --frontends or --engines > 1: a child process whose event loop has not run for this many "
                    "seconds (stopped, or wedged) holds its connections and requests for good, and health probes "
                    "cannot see it; it is ended and the server exits 1, for its supervisor to restart it. 0: never.",
    )
    frontend_shm_mb: int = Field(
        32, ge=0, le=65536,
        description="Shared memory each front-end process reserves in /dev/shm for the request arrays it hands to "
                    "the engine processes, in MiB (with --frontends or --engines > 1; split between the engines). "
                    "The engine process reads them in place instead of off the socket; 0, a full /dev/shm or a "
                    "request larger than what is free sends them on the socket.",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="Event loop: uvloop (faster per request), asyncio (the standard loop) or auto (uvloop "
                            "when installed).",
    )
    gil_switch_interval_us: int = Field(
        50, ge=1, le=100_000,
        description="Python's thread switch interval in every server process (µs). The batch worker gives up the "
                    "GIL in every launch, copy and wait and must get it back from the busy event loop; Python's 5 ms "
                    "default made a 1.4 ms batch take 126 ms on an H200 (bench/batch_path.py). Front-end processes: "
                    "gRPC's poller thread needs the GIL for every call it completes.",
    )
    drain_timeout_s: FiniteFloat = Field(30.0, ge=0, le=MAX_SECONDS, description="On SIGTERM/SIGINT, how long in-flight requests may finish (with --frontends or --engines: the front-ends first, then the engine processes for as long again).")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @field_validator("repository", mode="before")
    @classmethod
    def _repository_named(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") would quietly be the current folder
            raise ValueError("is empty; name the model repository folder (default ./models)")
        return value

    @field_validator("host", mode="before")
    @classmethod
    def _host_without_brackets(cls, value: Any) -> Any:
        # "[::1]" is how a URL writes an IPv6 address; bound as a name it failed with "Name or service not known"
        if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
            return value.strip()[1:-1]
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        # RNNSERVE_MAX_BATCH_SIZE=8.0 was read as 8, where --max-batch-size 8.0 and config.json refuse it
        if isinstance(value, str) and cls.model_fields[info.field_name].annotation is int:
            try:
                int(value)  # what the flag's argparse type takes: "8", " +8 ", "8_000"; not "8.0" or "1e3"
            except ValueError:
                raise PydanticCustomError("int_parsing", "Input should be a valid integer (a whole number), got {got}",
                                          {"got": repr(value.strip()[:40])}) from None
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _choices_in_any_case(cls, value: Any, info: ValidationInfo) -> Any:
        # every choice setting (their choices are lower case): RNNSERVE_LOG_LEVEL=DEBUG, as --log-level DEBUG
        if isinstance(value, str) and get_origin(cls.model_fields[info.field_name].annotation) is Literal:
            return value.strip().lower()
        return value

    @classmethod
    def from_args(cls, argv: list[str]) -> "ServeSettings":
        """Settings from env vars overridden by ``argv`` flags (exits with usage on bad flags)."""
        parser = build_serve_parser()
        args = parser.parse_args(argv)
        overrides = {k: v for k, v in vars(args).items() if v is not None}
        _drop_service_links_named_as_settings()
        _refuse_unknown_variables()
        _say_overridden_variables(overrides)
        try:
            settings = cls(**overrides)
        except ValidationError as exc:
            problems = "; ".join(f"{_named(e['loc'], overrides)}: {e['msg']}" for e in exc.errors())
            raise InvalidInput(f"bad serve settings: {problems}") from exc
        if settings.http_port == settings.grpc_port and settings.http_port != 0:
            # one process would bind gRPC there first and HTTP would never answer
            http, grpc = _named(("http_port",), overrides), _named(("grpc_port",), overrides)
            raise InvalidInput(f"bad serve settings: {http} and {grpc} are both {settings.http_port}; "
                               f"give them different ports (0 picks a free one, {grpc} -1 turns gRPC off)")
        return settings


def _named(loc: tuple, flags: dict[str, Any]) -> str:
    """A setting as the user gave it: ``--max-queue-size`` when the flag was passed, else its variable."""
    name = ".".join(map(str, loc))
    return f"--{name.replace('_', '-')}" if name in flags else f"RNNSERVE_{name.upper()}"


def _service_link(var: str, value: str) -> bool:
    """Whether ``var`` is one of the variables Kubernetes sets for a Service (see _SERVICE_LINK)."""
    if _SERVICE_LINK.fullmatch(var):
        return True
    return bool(_SERVICE_LINK_PORT.fullmatch(var)) and value.startswith(("tcp://", "udp://", "sctp://"))


def _drop_service_links_named_as_settings() -> None:
    """A Service named rnnserve-http (or rnnserve-grpc) makes Kubernetes set RNNSERVE_HTTP_PORT=tcp://IP:PORT, the
    name of a setting: such a value is no port number but a service link, and is set aside, with a line saying so."""
    import os
    import sys

    for var in [v for v in os.environ if v.startswith("RNNSERVE_") and v.endswith("_PORT")]:
        if _service_link(var, os.environ[var]):
            print(f"rnnserve: ignoring {var}={os.environ[var]}: a Kubernetes service link (of a Service named "
                  f"{var[:-5].lower().replace('_', '-')}), not a port number", file=sys.stderr)
            del os.environ[var]


def _say_overridden_variables(flags: dict[str, Any]) -> None:
    """A line per RNNSERVE_* variable that a flag overrides: an image's CMD or a manifest's args pass flags, and
    `docker run -e RNNSERVE_DEVICE=cpu IMAGE` was ignored without a word."""
    import os
    import sys

    for name, value in flags.items():
        var = f"RNNSERVE_{name.upper()}"
        if var in os.environ and _same_setting(name, os.environ[var], value) is not True:  # an invalid one too
            # said, not advised against: the image sets its defaults as variables, which a flag rightly overrides
            print(f"rnnserve: --{name.replace('_', '-')} {value} overrides {var}={os.environ[var]} (a flag wins "
                  f"over its variable)", file=sys.stderr)


def _same_setting(name: str, a: Any, b: Any) -> bool | None:
    """Whether two spellings of setting ``name`` mean one value (CPU and cpu, 08 and 8, /x/ and /x); None when either
    is no valid value (the settings' validation then says so)."""
    import os

    kind = ServeSettings.model_fields[name].annotation

    def norm(v: Any) -> Any:
        text = str(v).strip()
        if get_origin(kind) is Literal:
            return text.lower()
        if name == "host" and text.startswith("[") and text.endswith("]"):
            return text[1:-1]
        if kind in (int, float):
            return kind(text)
        return os.path.normpath(text) if kind is Path else text

    try:
        x, y = norm(a), norm(b)
    except ValueError:
        return None
    return x == y or (isinstance(x, float) and x != x and y != y)  # nan and nan: one (invalid) value


def _refuse_unknown_variables() -> None:
    """A misspelt RNNSERVE_* variable was ignored, serving with the default it meant to change; refused like an
    unknown flag, naming the nearest setting."""
    import difflib
    import os

    known = {f"RNNSERVE_{name.upper()}" for name in ServeSettings.model_fields} | OTHER_VARIABLES
    for var in sorted(os.environ):
        if var.startswith("RNNSERVE_") and var not in known and not _service_link(var, os.environ[var]):
            near = difflib.get_close_matches(var, sorted(known), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise InvalidInput(f"bad serve settings: {var} is not a setting of rnnserve serve{hint}; unset it "
                               f"or correct its name (`rnnserve serve --help` lists each variable)")


def build_serve_parser() -> argparse.ArgumentParser:
    """`rnnserve serve` flags, generated from :class:`ServeSettings` (defaults come from env/fields)."""
    parser = argparse.ArgumentParser(
        prog="rnnserve serve",
        description="Serve a model repository over REST and gRPC. Every flag is also an env var RNNSERVE_<NAME>.",
    )
    for name, info in ServeSettings.model_fields.items():
        kwargs: dict[str, Any] = {"default": None, "dest": name}
        ann = info.annotation
        if get_origin(ann) is Literal:
            kwargs["choices"] = list(get_args(ann))
            kwargs["type"] = str.lower  # --log-level DEBUG, as the variable takes it
        elif ann in (int, float):
            kwargs["type"] = ann
        # a Path stays text here: the settings refuse an empty one, which Path("") would make "." 
        kwargs["help"] = f"{info.description} (default {info.default}; env RNNSERVE_{name.upper()})"
        parser.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return parser
