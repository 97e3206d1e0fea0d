"""ServeSettings: env vars, CLI flags over them, and config.json over the server's defaults."""
from __future__ import annotations

import json

import pytest

from service.errors import InvalidInput
from service.registry import effective_config
from service.settings import ServeSettings, build_serve_parser


def test_defaults_env_and_flags(monkeypatch):
    s = ServeSettings.from_args([])
    assert (s.http_port, s.grpc_port, s.host, s.device, str(s.repository)) == (8000, 8001, "0.0.0.0", "auto", "models")
    monkeypatch.setenv("RNNSERVE_HTTP_PORT", "9000")
    monkeypatch.setenv("RNNSERVE_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("RNNSERVE_DEVICE", "cpu")
    s = ServeSettings.from_args(["--max-batch-size", "16", "--repository", "/srv/models"])
    assert s.http_port == 9000 and s.device == "cpu"
    assert s.max_batch_size == 16 and str(s.repository) == "/srv/models"


def test_bad_values_name_the_flag(monkeypatch):
    with pytest.raises(InvalidInput, match="--max-batch-size: Input should be greater than or equal to 1"):
        ServeSettings.from_args(["--max-batch-size", "0"])
    with pytest.raises(SystemExit):
        ServeSettings.from_args(["--device", "tpu"])
    # a value from the environment is named as the user set it, not as a flag they never passed
    monkeypatch.setenv("RNNSERVE_MAX_QUEUE_SIZE", "abc")
    with pytest.raises(InvalidInput, match="settings: RNNSERVE_MAX_QUEUE_SIZE: Input should be a valid integer"):
        ServeSettings.from_args([])
    with pytest.raises(InvalidInput, match="settings: --max-queue-size: Input should be greater"):
        ServeSettings.from_args(["--max-queue-size", "0"])
    # a memory guard set past any machine (a typo) would switch itself off
    monkeypatch.delenv("RNNSERVE_MAX_QUEUE_SIZE")
    with pytest.raises(InvalidInput, match="--max-batch-memory-mb: Input should be less than or equal to 16777216"):
        ServeSettings.from_args(["--max-batch-memory-mb", str(10**15)])


@pytest.mark.parametrize("flag", ["--drain-timeout-s", "--body-timeout-s", "--stream-idle-timeout-s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_seconds_must_be_finite(monkeypatch, flag, value):
    """NaN was told "greater than 0" (it is not a comparison problem) and inf passed ge=0 unchecked."""
    with pytest.raises(InvalidInput, match=f"{flag}: {value} is not a finite number"):
        ServeSettings.from_args([f"{flag}={value}"])
    monkeypatch.setenv("RNNSERVE_" + flag[2:].replace("-", "_").upper(), value)
    with pytest.raises(InvalidInput, match="is not a finite number"):
        ServeSettings.from_args([])


def test_ports_host_and_limits_that_cannot_serve_are_refused(monkeypatch):
    """One process with equal ports bound gRPC and never answered HTTP; an empty host reached grpc's own error;
    limits config.json refuses were taken from flags; a month bounds the seconds."""
    with pytest.raises(InvalidInput, match="--http-port and --grpc-port are both 9100; give them different ports"):
        ServeSettings.from_args(["--http-port", "9100", "--grpc-port", "9100"])
    monkeypatch.setenv("RNNSERVE_HTTP_PORT", "9101")
    with pytest.raises(InvalidInput, match="are both 9101"):
        ServeSettings.from_args(["--grpc-port", "9101"])
    assert ServeSettings.from_args(["--http-port", "0", "--grpc-port", "0"]).grpc_port == 0  # two free ports
    monkeypatch.delenv("RNNSERVE_HTTP_PORT")
    for flag, value, problem in [("--host", "", "--host: String should have at least 1 character"),
                                 ("--max-queue-size", "100000000", "--max-queue-size: Input should be less than or "
                                                                   "equal to 10000000"),
                                 ("--max-sequence-length", "10000000000", "--max-sequence-length: Input should be "
                                                                          "less than or equal to 1000000000"),
                                 ("--max-streams", "100000000", "--max-streams: Input should be less than or equal"),
                                 ("--drain-timeout-s", "1e300", "--drain-timeout-s: Input should be less than or "
                                                                "equal to 2678400")]:
        with pytest.raises(InvalidInput, match=problem):
            ServeSettings.from_args([f"{flag}={value}"])


def test_a_misspelt_variable_is_refused_with_the_nearest_name(monkeypatch):
    monkeypatch.setenv("RNNSERVE_MAX_BATCH_SIZ", "8")
    with pytest.raises(InvalidInput, match="RNNSERVE_MAX_BATCH_SIZ is not a setting of rnnserve serve \\(did you "
                                           "mean RNNSERVE_MAX_BATCH_SIZE\\?\\)"):
        ServeSettings.from_args([])
    monkeypatch.delenv("RNNSERVE_MAX_BATCH_SIZ")
    monkeypatch.setenv("RNNSERVE_NATIVE_CPU", "0")  # an engine knob, read where it applies
    assert ServeSettings.from_args([]).max_batch_size == 64


def test_every_field_is_a_flag():
    usage = build_serve_parser().format_help()
    for name in ServeSettings.model_fields:
        assert f"--{name.replace('_', '-')}" in usage and f"RNNSERVE_{name.upper()}" in usage


def test_config_json_overrides_server_defaults(tmp_path):
    defaults = {"max_batch_size": 8, "max_queue_delay_us": 100, "max_queue_size": 10, "max_sequence_length": 50}
    (tmp_path / "config.json").write_text(json.dumps({"max_batch_size": 64, "max_queue_size": 3}))
    cfg = effective_config(tmp_path, defaults)
    # fields written in config.json win, even when equal to the built-in default; the rest take the server's
    assert (cfg.max_batch_size, cfg.max_queue_delay_us, cfg.max_queue_size, cfg.max_sequence_length) == (64, 100, 3, 50)
    (tmp_path / "config.json").write_text("{}")
    assert effective_config(tmp_path, defaults).max_batch_size == 8


def test_every_variable_the_service_reads_is_known_to_the_check():
    """The misspelt-variable check would refuse an engine knob it did not know: every RNNSERVE_ name the
    service assigns as a variable's name is a setting or one of OTHER_VARIABLES."""
    import re
    from pathlib import Path

    from service.settings import OTHER_VARIABLES

    names = {m for path in (Path(__file__).resolve().parents[2] / "service").rglob("*.py")
             for m in re.findall(r'= "(RNNSERVE_[A-Z0-9_]+)"', path.read_text())}
    assert names, "no variable names found"
    known = {f"RNNSERVE_{f.upper()}" for f in ServeSettings.model_fields} | OTHER_VARIABLES
    assert names <= known, names - known


def test_kubernetes_service_link_variables_are_not_refused(monkeypatch):
    """A Service named rnnserve (deploy/kubernetes) gives every pod of its namespace these variables: the server
    refused them as misspelt settings and the shipped Deployment crash-looped. A misspelt setting is still refused."""
    links = {"RNNSERVE_SERVICE_HOST": "10.96.12.34", "RNNSERVE_SERVICE_PORT": "8000",
             "RNNSERVE_SERVICE_PORT_HTTP": "8000", "RNNSERVE_SERVICE_PORT_GRPC": "8001",
             "RNNSERVE_PORT": "tcp://10.96.12.34:8000", "RNNSERVE_PORT_8000_TCP": "tcp://10.96.12.34:8000",
             "RNNSERVE_PORT_8000_TCP_PROTO": "tcp", "RNNSERVE_PORT_8000_TCP_PORT": "8000",
             "RNNSERVE_PORT_8000_TCP_ADDR": "10.96.12.34",
             # KServe's predictor Service of an InferenceService named rnnserve-models
             "RNNSERVE_MODELS_PREDICTOR_SERVICE_HOST": "10.96.0.7", "RNNSERVE_MODELS_PREDICTOR_PORT": "tcp://10.96.0.7:80"}
    for var, value in links.items():
        monkeypatch.setenv(var, value)
    assert ServeSettings.from_args([]).http_port == 8000
    # a Service named rnnserve-http: its link has the name of the setting, and a tcp:// value
    monkeypatch.setenv("RNNSERVE_HTTP_PORT", "tcp://10.96.0.9:8000")
    monkeypatch.setenv("RNNSERVE_HTTP_SERVICE_HOST", "10.96.0.9")
    assert ServeSettings.from_args([]).http_port == 8000
    monkeypatch.setenv("RNNSERVE_HTTP_PORT", "9000")
    assert ServeSettings.from_args([]).http_port == 9000
    monkeypatch.setenv("RNNSERVE_HTPP_PORT", "9000")  # not a link: its value is no tcp:// address
    with pytest.raises(InvalidInput, match="RNNSERVE_HTPP_PORT is not a setting .*did you mean RNNSERVE_HTTP_PORT"):
        ServeSettings.from_args([])


def test_an_empty_repository_setting_and_upper_case_choices(monkeypatch):
    """An empty repository was the current folder (in the image, /: its folders listed as models, and ready)."""
    with pytest.raises(InvalidInput, match="--repository: Value error, is empty; name the model repository folder"):
        ServeSettings.from_args(["--repository", ""])
    monkeypatch.setenv("RNNSERVE_REPOSITORY", " ")
    with pytest.raises(InvalidInput, match="RNNSERVE_REPOSITORY: Value error, is empty"):
        ServeSettings.from_args([])
    monkeypatch.setenv("RNNSERVE_REPOSITORY", "models")
    monkeypatch.setenv("RNNSERVE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("RNNSERVE_EVENT_LOOP", "AsyncIO")
    settings = ServeSettings.from_args(["--device", "CPU", "--http-balance", "Kernel"])
    assert (settings.log_level, settings.device, str(settings.repository)) == ("debug", "cpu", "models")
    assert (settings.event_loop, settings.http_balance) == ("asyncio", "kernel")  # every choice setting
    # gRPC takes its message limit as a C int: a larger one failed at its start with no setting named
    with pytest.raises(InvalidInput, match="--max-request-bytes: Input should be less than or equal to 2147483647"):
        ServeSettings.from_args(["--max-request-bytes", "3000000000"])


def test_config_json_numbers_are_numbers_and_keys_are_given_once(tmp_path):
    """"60" was taken for 60 seconds where "8" is refused for 8 requests; a key given twice served its last value."""
    from service.repository.config import load_config

    for body, words in (('{"stream_idle_timeout_s": "60"}', "stream_idle_timeout_s: Input should be a valid number"),
                        ('{"max_batch_size": 4, "max_batch_size": 8}', "sets 'max_batch_size' more than once")):
        (tmp_path / "config.json").write_text(body)
        with pytest.raises(InvalidInput, match=words):
            load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"stream_idle_timeout_s": 60, "max_batch_size": 8}')
    assert load_config(tmp_path).stream_idle_timeout_s == 60.0


def test_a_variable_overridden_by_a_flag_is_named(monkeypatch, capsys):
    """The image's CMD passed --device auto: `docker run -e RNNSERVE_DEVICE=cpu IMAGE` was ignored without a word."""
    monkeypatch.setenv("RNNSERVE_DEVICE", "cpu")
    monkeypatch.setenv("RNNSERVE_MAX_QUEUE_SIZE", "7")
    settings = ServeSettings.from_args(["--device", "auto", "--max-queue-size", "7"])
    assert settings.device == "auto" and settings.max_queue_size == 7
    err = capsys.readouterr().err
    assert "--device auto overrides RNNSERVE_DEVICE=cpu (a flag wins over its variable)" in err
    assert "RNNSERVE_MAX_QUEUE_SIZE" not in err  # the same value: nothing to say
    for var, value, flag, given in (("RNNSERVE_DEVICE", "CPU", "--device", "cpu"),
                                    ("RNNSERVE_MAX_QUEUE_SIZE", "08", "--max-queue-size", "8"),
                                    ("RNNSERVE_REPOSITORY", "/x/", "--repository", "/x")):
        monkeypatch.setenv(var, value)
        ServeSettings.from_args([flag, given])
        assert "overrides" not in capsys.readouterr().err, (var, value)  # one value, spelt two ways


def test_a_variable_is_read_as_strictly_as_its_flag(monkeypatch):
    """RNNSERVE_MAX_BATCH_SIZE=8.0 was read as 8, where --max-batch-size 8.0 is refused; two ports equal from the
    environment were named as flags never passed."""
    monkeypatch.setenv("RNNSERVE_MAX_BATCH_SIZE", "8.0")
    with pytest.raises(InvalidInput, match=r"RNNSERVE_MAX_BATCH_SIZE: Input should be a valid integer \(a whole "
                                           r"number\), got '8.0'"):
        ServeSettings.from_args([])
    monkeypatch.delenv("RNNSERVE_MAX_BATCH_SIZE")
    monkeypatch.setenv("RNNSERVE_HTTP_PORT", "9000")
    monkeypatch.setenv("RNNSERVE_GRPC_PORT", "9000")
    with pytest.raises(InvalidInput, match="RNNSERVE_HTTP_PORT and RNNSERVE_GRPC_PORT are both 9000"):
        ServeSettings.from_args([])
    monkeypatch.setenv("RNNSERVE_GRPC_PORT", "9001")
    with pytest.raises(InvalidInput, match="--http-port and RNNSERVE_GRPC_PORT are both 9001"):
        ServeSettings.from_args(["--http-port", "9001"])


def test_a_bracketed_ipv6_host_is_the_address():
    assert ServeSettings.from_args(["--host", "[::1]"]).host == "::1"
