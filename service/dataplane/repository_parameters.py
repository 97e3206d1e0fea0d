"""The parameters of the repository extension's load and unload calls, for every transport.

Triton's load takes ``config`` (a model configuration to use instead of the repository's)
and ``file:<path>`` contents; rnnserve loads models only from its repository, so a load
with parameters is refused by name rather than run without them, which would serve a
configuration other than the one the caller sent. ``unload_dependents`` (tritonclient
always sends it) is accepted: rnnserve models have no dependents.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidInput


def check_load_parameters(model: str, parameters: Mapping[str, Any]) -> None:
    """InvalidInput when a load of ``model`` carries parameters (none are supported)."""
    if parameters:
        raise InvalidInput(
            f"model '{model}' is loaded from the server's repository; load parameters are not supported "
            f"(got {', '.join(sorted(parameters))}): change REPO/{model}/config.json, then load it without parameters")


def check_unload_parameters(parameters: Mapping[str, Any]) -> None:
    """InvalidInput when an unload carries a parameter other than ``unload_dependents``."""
    unknown = sorted(name for name in parameters if name != "unload_dependents")
    if unknown:
        raise InvalidInput(f"unload parameters are not supported (got {', '.join(unknown)}); send none, "
                           f"or only unload_dependents")
