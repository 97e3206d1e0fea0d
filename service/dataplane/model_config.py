"""Triton's configuration extension (``/v2/models/{m}[/versions/{v}]/config``, gRPC ``ModelConfig``).

Triton clients read a model's configuration to learn how to batch for it:
``perf_analyzer`` and ``model_analyzer`` stop without it, and ``tritonclient``'s
``get_model_config`` returns it. rnnserve has no config.pbtxt; this module describes a
served version in Triton's terms, as JSON (the HTTP form; gRPC parses the same dict into
its message):

- ``max_batch_size`` is 0 and every ``dims`` is the tensor's whole shape, the batch
  dimension first, exactly as in the metadata. Triton's other form (a positive
  ``max_batch_size`` and dims without the batch dimension) cannot describe ``lengths``,
  one number per sequence, [B]: it would become [B, 1], and clients that shape requests
  from the metadata (``perf_analyzer``) refuse an input whose shape after the batch
  dimension is empty. rnnserve's own limit, sequences per engine call, is the parameter
  ``max_batch_size``; the ``dynamic_batching`` section says that requests are batched.
  ``lengths``, ``h_0`` and ``c_0`` are ``optional``.
- ``dynamic_batching`` carries ``max_queue_delay_microseconds``; requests with a
  ``sequence_id`` are stateful streams on any model (see the README), so there is no
  ``sequence_batching`` section: a client reading one would send every request as a stream.
- ``instance_group``: one instance on the engine's device (``KIND_GPU`` for the cuDNN engine),
  or one per engine process (``rnnserve serve --engines N``).
- ``parameters``: the rest of the version's ``config.json`` settings, as strings.
"""
from __future__ import annotations

import json
from typing import Any

from ..registry import ServedVersion
from .signature import ModelSignature, TensorSpec

# config.json settings that have their own place in Triton's configuration
_MAPPED = frozenset({"max_queue_delay_us", "version_policy"})
_OPTIONAL_INPUTS = frozenset({"lengths", "h_0", "c_0"})


def _dims(tensor: TensorSpec) -> dict[str, Any]:
    return {"dims": [int(d) for d in tensor.shape]}


def _version_policy(policy: Any) -> dict[str, Any]:
    if policy == "latest":
        return {"latest": {"num_versions": 1}}
    if policy == "all":
        return {"all": {}}
    return {"specific": {"versions": [int(v) for v in policy]}}


def triton_model_config(served: ServedVersion, signature: ModelSignature) -> dict[str, Any]:
    """Triton's ``ModelConfig`` of a served version, as JSON."""
    cfg = served.config
    engine = served.engine
    gpu = getattr(engine, "name", "") == "cudnn"
    group: dict[str, Any] = {"name": served.name, "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
    if gpu:
        group["gpus"] = [int(getattr(engine, "device_id", 0))]
    settings = cfg.model_dump()
    return {
        "name": served.name,
        "platform": served.platform,
        "backend": "rnnserve",
        "version_policy": _version_policy(cfg.version_policy),
        "max_batch_size": 0,
        "input": [{"name": t.name, "data_type": f"TYPE_{t.datatype}", "format": "FORMAT_NONE", **_dims(t),
                   "is_shape_tensor": False, "allow_ragged_batch": False, "optional": t.name in _OPTIONAL_INPUTS}
                  for t in signature.inputs],
        "output": [{"name": t.name, "data_type": f"TYPE_{t.datatype}", **_dims(t), "label_filename": "",
                    "is_shape_tensor": False} for t in signature.outputs],
        "dynamic_batching": {"preferred_batch_size": [], "max_queue_delay_microseconds": cfg.max_queue_delay_us,
                             "preserve_ordering": False},
        "instance_group": [group],
        "parameters": {k: {"string_value": v if isinstance(v, str) else json.dumps(v)}
                       for k, v in settings.items() if k not in _MAPPED},
    }
