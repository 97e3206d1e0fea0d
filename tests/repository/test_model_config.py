"""config.json of a model folder: numbers are numbers, not JSON booleans."""
from __future__ import annotations

import json
import os
import re

import pytest

from service.errors import InvalidInput
from service.repository import ModelConfig, load_config

# every integer and number setting; bool is an int to Python, so `true` was read as 1 and `false` as 0
NUMERIC = sorted(name for name, info in ModelConfig.model_fields.items() if info.annotation in (int, float))


def _write(folder, settings: dict) -> None:
    (folder / "config.json").write_text(json.dumps(settings))


def test_the_numeric_settings_are_the_expected_ones():
    assert {"max_batch_size", "max_queue_delay_us", "max_queue_size", "max_sequence_length", "max_batch_memory_mb",
            "cuda_graph_memory_mb", "max_streams", "frontend_in_flight", "stream_idle_timeout_s"} == set(NUMERIC)


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("key", NUMERIC)
def test_booleans_are_refused_for_numbers(tmp_path, key, value):
    _write(tmp_path, {key: value})
    expected = "a number" if ModelConfig.model_fields[key].annotation is float else "an integer"
    with pytest.raises(InvalidInput) as err:
        load_config(tmp_path)
    assert err.value.message == (f"{tmp_path / 'config.json'}: {key}: {json.dumps(value)} is a boolean; "
                                 f"expected {expected}")
    assert err.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize("policy", [[True], [1, False], [2, True, 3]])
def test_booleans_are_refused_as_version_numbers(tmp_path, policy):
    _write(tmp_path, {"version_policy": policy})
    at = next(i for i, v in enumerate(policy) if isinstance(v, bool))
    with pytest.raises(InvalidInput) as err:
        load_config(tmp_path)
    assert err.value.message == (f"{tmp_path / 'config.json'}: version_policy.list.{at}: "
                                 f"{json.dumps(policy[at])} is a boolean; expected an integer")


@pytest.mark.parametrize("policy,problem", [
    (True, "version_policy: expected 'latest', 'all' or a list of version numbers"),
    (5, "version_policy: expected 'latest', 'all' or a list of version numbers"),
    ("newest", "version_policy.name: Input should be 'latest' or 'all'"),
    ([], "version_policy.list: List should have at least 1 item"),
    ([0], "version_policy.list.0: Input should be greater than or equal to 1"),
])
def test_bad_version_policies_name_one_problem(tmp_path, policy, problem):
    _write(tmp_path, {"version_policy": policy})
    with pytest.raises(InvalidInput) as err:
        load_config(tmp_path)
    assert err.value.message.startswith(f"{tmp_path / 'config.json'}: {problem}")
    assert ";" not in err.value.message


def test_numbers_still_load(tmp_path):
    _write(tmp_path, {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 3, "stream_idle_timeout_s": 5,
                      "version_policy": [1, 3], "allow_tf32": True})
    cfg = load_config(tmp_path)
    assert (cfg.max_batch_size, cfg.max_queue_delay_us, cfg.max_queue_size) == (8, 0, 3)
    assert cfg.stream_idle_timeout_s == 5.0 and cfg.version_policy == [1, 3] and cfg.allow_tf32 is True
    for policy in ("latest", "all"):
        _write(tmp_path, {"version_policy": policy})
        assert load_config(tmp_path).version_policy == policy


@pytest.mark.parametrize("value", [1, 0, "yes", "true"])
def test_allow_tf32_takes_only_json_booleans(tmp_path, value):
    _write(tmp_path, {"allow_tf32": value})
    with pytest.raises(InvalidInput, match="allow_tf32: Input should be a valid boolean"):
        load_config(tmp_path)
    _write(tmp_path, {"allow_tf32": True})
    assert load_config(tmp_path).allow_tf32 is True


def test_a_config_that_cannot_be_read_says_so(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(InvalidInput, match=r"config.json is a folder, not a regular file; make it"):
        load_config(tmp_path)
    (tmp_path / "config.json").rmdir()
    # a pipe would block the read (the event loop, the model's lock) and /dev/zero never ends: both refused unread
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(InvalidInput, match=r"config.json is a pipe, not a regular file"):
        load_config(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to("/dev/zero")
    with pytest.raises(InvalidInput, match=r"config.json is a device or socket, not a regular file"):
        load_config(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text("{}" + " " * (1 << 20))
    with pytest.raises(InvalidInput, match=r"config.json has 1,048,578 bytes, more than the 1,048,576 it may have"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(InvalidInput, match="nests too deep"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(InvalidInput, match="is not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("field,value,problem", [
    ("max_batch_size", "8", "Input should be a valid integer"),
    ("max_batch_size", 8.0, "Input should be a valid integer"),
    ("version_policy", ["1"], "version_policy.list.0: Input should be a valid integer"),
    ("max_queue_size", 10**20, "less than or equal to 10000000"),
    ("max_sequence_length", 10**19, "less than or equal to 1000000000"),
    ("max_streams", 10**11, "less than or equal to 10000000"),
])
def test_numbers_must_be_what_the_field_takes(tmp_path, field, value, problem):
    """A string or a float where an integer belongs is a typo in a file people edit; pydantic's lax mode served
    "8" as 8. Counts past any machine's reach are refused too."""
    (tmp_path / "config.json").write_text(json.dumps({field: value}))
    with pytest.raises(InvalidInput, match=re.escape(problem)):
        load_config(tmp_path)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_a_non_finite_idle_timeout_is_refused_as_such(tmp_path, literal):
    """Python's JSON reads these literals; NaN was told "should be greater than 0", which it is not asked."""
    (tmp_path / "config.json").write_text(f'{{"stream_idle_timeout_s": {literal}}}')
    with pytest.raises(InvalidInput, match="stream_idle_timeout_s: .* is not a finite number"):
        load_config(tmp_path)


def test_a_byte_order_mark_and_an_unknown_key_say_what_to_change(tmp_path):
    """Python's own words were "decode using utf-8-sig" and "Extra inputs are not permitted"."""
    (tmp_path / "config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"max_batch_size": 8}).encode())
    with pytest.raises(InvalidInput, match=r"starts with a byte-order mark \(BOM\); save it as UTF-8 without one"):
        load_config(tmp_path)
    _write(tmp_path, {"max_batchsize": 8})
    with pytest.raises(InvalidInput, match=r"max_batchsize: not a setting \(the settings are max_batch_size, "):
        load_config(tmp_path)
