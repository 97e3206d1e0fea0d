"""JSON objects whose keys are each given once.

Python's json keeps the last of a repeated key without a word: a config.json setting written twice was served
with its second value, and an inference request giving ``"data"`` (or ``"inputs"``) twice was answered on the
last copy, where Triton's parser takes the first, so one request got two different answers from two servers.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import InvalidInput


def unique_keys(verb: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """An ``object_pairs_hook`` refusing a repeated key: "<verb> 'k' more than once; keep one"."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            raise InvalidInput(f"{verb} {', '.join(repr(k) for k in twice)} more than once; keep one")
        return obj

    return hook
