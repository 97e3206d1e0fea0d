"""Per-model serving settings: REPO/<name>/config.json.

Every field has a default, so a model folder without config.json serves as is.
Unknown keys are refused so a typo does not silently fall back to a default.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Strict, StrictBool, StrictInt, Tag,
                      ValidationError)
from pydantic_core import PydanticCustomError

from ..errors import InvalidInput
from ..finite import MAX_SECONDS, Finite
from ..json_keys import unique_keys
from .files import read_regular


def _refuse_bool(expected: str) -> BeforeValidator:
    """A validator refusing JSON ``true``/``false`` where ``expected`` (a number) belongs.

    bool is an int to Python and to pydantic's lax mode, so ``"max_batch_size": true`` was served as 1.
    """
    def check(value: object) -> object:
        if isinstance(value, bool):
            raise PydanticCustomError("bool_not_number", "{value} is a boolean; expected {expected}",
                                      {"value": json.dumps(value), "expected": expected})
        return value

    return BeforeValidator(check)


# Strict: "8" and 8.0 are typos of 8 in a file people edit, refused as the field names are
Integer = Annotated[StrictInt, _refuse_bool("an integer")]
Number = Annotated[float, _refuse_bool("a number"), Finite, Strict()]  # "60" too: a typo of 60, as above
# version numbers (>= 1), at least one: an empty list loaded "successfully" into a model with no version
VersionList = Annotated[list[Annotated[Integer, Field(ge=1)]], Field(min_length=1)]
# Tagged so an error names one branch ("version_policy.list.0: ..."), not both in pydantic's internal spelling.
VersionPolicy = Annotated[
    Union[Annotated[Literal["latest", "all"], Tag("name")], Annotated[VersionList, Tag("list")]],
    Discriminator(lambda v: "list" if isinstance(v, list) else "name" if isinstance(v, str) else None,
                  custom_error_type="version_policy",
                  custom_error_message="expected 'latest', 'all' or a list of version numbers"),
]


# The bounds of the batching and stream settings, shared by config.json and the server's defaults (flags): past
# them a value is a typo, and the two places must refuse the same ones.
MAX_BATCH_SIZE = 65536
MAX_QUEUE_DELAY_US = 10_000_000
MAX_COUNT = 10_000_000  # requests waiting, live streams
MAX_SEQUENCE_LENGTH = 1_000_000_000
MAX_FRONTEND_IN_FLIGHT = 64
MAX_MEMORY_MB = 1 << 24  # 16 TiB, past any one machine: a larger value is a typo that would switch a guard off


class ModelConfig(BaseModel):
    """Serving settings of one model (all optional in config.json)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: Integer = Field(
        64, ge=1, le=MAX_BATCH_SIZE,
        description="Most sequences the scheduler batches into one engine call; a single request carrying more runs "
                    "alone as one call (within max_batch_memory_mb)."
    )
    max_queue_delay_us: Integer = Field(
        0, ge=0, le=MAX_QUEUE_DELAY_US,
        description="How long the oldest waiting request may wait for others to batch with, in µs. 0 (the default, "
                    "as in Triton) runs a batch as soon as the engine is free; under load, requests that arrive "
                    "while a batch computes form the next batch, so batching needs no added latency.",
    )
    max_queue_size: Integer = Field(
        1024, ge=1, le=MAX_COUNT,
        description="Requests waiting at most; more are refused at once with UNAVAILABLE (503)."
    )
    max_sequence_length: Integer = Field(100_000, ge=1, le=MAX_SEQUENCE_LENGTH, description="Longest T accepted per request.")
    max_batch_memory_mb: Integer = Field(
        0, ge=0, le=MAX_MEMORY_MB, description="Working memory one engine call may use, in MiB (estimated from the model's layers: "
                             "rows x longest length x bytes per step; `rnnserve inspect` prints it). A request needing more alone is "
                             "refused with 413 / RESOURCE_EXHAUSTED; batches are formed within it. 0 (the default): "
                             "a quarter of the machine's memory (GPU engine: of the smaller of host and GPU memory).",
    )
    precision: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="Data type the engine computes in (GPU engine; the CPU engine computes in float32)."
    )
    allow_tf32: StrictBool = Field(False, description="Let the cuDNN engine use TF32 tensor cores for float32 models.")
    cuda_graph_memory_mb: Integer = Field(
        512, ge=0, le=MAX_MEMORY_MB, description="Device memory the cuDNN engine may keep for CUDA graphs of repeated equal-length "
                               "calls (their input, output and state buffers), in MiB; 0 turns the graphs off.",
    )
    version_policy: VersionPolicy = Field(
        "latest", description="Which versions to serve: 'latest', 'all' or a list of version numbers."
    )
    max_streams: Integer = Field(
        1024, ge=1, le=MAX_COUNT, description="Live stateful streams at most; more are refused with UNAVAILABLE."
    )
    frontend_in_flight: Integer = Field(
        2, ge=1, le=MAX_FRONTEND_IN_FLIGHT,
        description="Messages each front-end process keeps in the engine process for this model at once (with front-end processes); requests validated meanwhile wait and leave merged. 2 keeps a small model's engine thread fed with few messages; a larger, GPU-bound model batches more with 4-8 (see README).",
    )
    stream_idle_timeout_s: Number = Field(
        60.0, gt=0, le=MAX_SECONDS, description="A stream with no chunk for this long is dropped with its state."
    )


CONFIG_LIMIT = 1 << 20  # a config is a few settings; more is not one


_NO_REPEATS = unique_keys("sets")


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``model_dir/config.json`` (defaults when absent); errors name the field to fix."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return ModelConfig()
    raw = read_regular(path, str(path), "make it a readable JSON file of settings", CONFIG_LIMIT)
    if raw.startswith(b"\xef\xbb\xbf"):  # an editor's UTF-8 byte-order mark: json says "decode using utf-8-sig"
        raise InvalidInput(f"{path} starts with a byte-order mark (BOM); save it as UTF-8 without one")
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_NO_REPEATS)
    except RecursionError:
        raise InvalidInput(f"{path} nests too deep to be a config; it holds one JSON object of settings") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise InvalidInput(f"{path} is not valid JSON: {exc}") from exc
    except InvalidInput as exc:  # a key given twice
        raise InvalidInput(f"{path} {exc.message}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} must hold a JSON object of settings")
    try:
        return ModelConfig(**data)
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise InvalidInput(f"{path}: {problems}") from exc


def _problem(error: dict) -> str:
    """One pydantic error as a config.json reader needs it: an unknown key with the keys there are."""
    field = ".".join(map(str, error["loc"]))
    if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
        return f"{field}: not a setting (the settings are {', '.join(ModelConfig.model_fields)})"
    return f"{field}: {error['msg']}"
