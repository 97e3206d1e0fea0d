"""`rnnserve convert` and `rnnserve inspect` as a user runs them (real processes)."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import service  # noqa: E402
from service.engines.reference import ReferenceEngine  # noqa: E402
from service.loaders.verify import probe_input  # noqa: E402


def rnnserve(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def torch_file(tmp_path_factory):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(5, 7)
            self.rnn = torch.nn.GRU(7, 13, 2, batch_first=True, bidirectional=True)

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("src") / "net.pt"
    net = Net()
    torch.save(net.state_dict(), path)
    return path, net


def test_convert_inspect_and_engine_reproduce_torch(torch_file, tmp_path):
    path, net = torch_file
    res = rnnserve("convert", path, "--name", "tagger", "--repository", tmp_path / "repo", "--version", "2")
    assert res.returncode == 0, res.stderr
    assert ("verified against torch (the file's weights in rebuilt nn.GRU modules: a state dict holds no code, so "
            "what the model does around or between them is not checked): max abs difference") in res.stdout
    assert "block 0: gru I=7 H=13 layers=2 bidirectional" in res.stdout
    assert (tmp_path / "repo" / "tagger" / "2" / "model.safetensors").exists()

    res = rnnserve("inspect", tmp_path / "repo" / "tagger")
    assert res.returncode == 0, res.stderr
    assert "model tagger version 2" in res.stdout
    # pseudo-layer 2 (layer 1, forward) reads both directions of layer 0: [13, 26]
    assert any(line.split()[:6] == ["matrix", "2", "1", "0", "0", "W_r"] and "13x26" in line
               for line in res.stdout.splitlines())
    # GRU I=7 H=13, 2 bidirectional layers: 4 x (2*7 + 2*2*3*13 + (2*26 + 2*26) + 3*26) bytes a sequence step
    assert "memory: about 1,408 bytes of engine working memory per sequence step; max_batch_memory_mb 0" in res.stdout
    info = json.loads(rnnserve("inspect", tmp_path / "repo" / "tagger", "--json", "--device", "cpu").stdout)
    assert info["memory"]["step_bytes"] == 1408
    assert info["memory"]["max_sequence_steps"] == info["memory"]["limit_bytes"] // 1408
    assert info["provenance"]["format"] == "torch" and info["provenance"]["selection"] == ["rnn"]
    assert len(info["provenance"]["sha256"]) == 64 and info["engine"]["engine"] == "reference"

    model = service.load_model(tmp_path / "repo" / "tagger")
    x = np.random.default_rng(0).standard_normal((2, 5, 7)).astype(np.float32)
    with torch.no_grad():
        expected, _ = net.rnn(torch.from_numpy(x))
    out = service.create_engine(model, "cpu").forward(x)
    np.testing.assert_allclose(out.output, expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_convert_reduced_precision(torch_file, tmp_path, dtype):
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--dtype", dtype)
    assert res.returncode == 0, res.stderr
    assert service.load_model(tmp_path / "m").storage_dtype == dtype


def test_cli_errors_are_one_line_and_exit_2(torch_file, tmp_path):
    res = rnnserve("convert", tmp_path / "missing.pt", "--name", "m", "--repository", tmp_path)
    assert res.returncode == 2 and "error: source file" in res.stderr and "does not exist" in res.stderr
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--select", "decoder")
    assert res.returncode == 2 and "matches no tensor" in res.stderr and "'rnn'" in res.stderr
    res = rnnserve("convert", torch_file[0], "--name", "../m", "--repository", tmp_path)
    assert res.returncode == 2 and "is not allowed" in res.stderr
    weird = tmp_path / "weights.xyz"
    weird.write_bytes(b"hello world")
    res = rnnserve("convert", weird, "--name", "m", "--repository", tmp_path)
    assert res.returncode == 2 and "--format" in res.stderr
    res = rnnserve("inspect", tmp_path / "nothing")
    assert res.returncode == 2 and "no model at" in res.stderr
    assert "Traceback" not in res.stderr


def _corrupt_header(path, edit) -> None:
    """Rewrite the safetensors header of ``path`` as ``edit(header) -> bytes``, the length prefix matching."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = edit(json.loads(data[8:8 + n]))
    path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n:])


def _entry(key, value):
    def edit(header):
        header["block0.weights"][key] = value
        return json.dumps(header).encode()
    return edit


@pytest.mark.parametrize("edit,problem", [
    (_entry("dtype", 5), "tensor 'block0.weights' has dtype 5"),
    (_entry("shape", "x"), "tensor 'block0.weights' has shape \"x\""),
    (_entry("data_offsets", [10, 2]), "tensor 'block0.weights' has data_offsets [10, 2]"),
    (_entry("data_offsets", [0, 10**9]), "tensor 'block0.weights' has data_offsets [0, 1000000000], past the end"),
    (lambda h: json.dumps({**h, "__metadata__": ["x"]}).encode(), "__metadata__ is a JSON array"),
    (lambda h: b"[1, 2]", "corrupt header: a JSON array where an object of tensors belongs"),
    (lambda h: b'{"\xff": 1}', "corrupt header: not UTF-8 text"),
])
def test_inspect_refuses_a_corrupt_header_without_a_traceback(torch_file, tmp_path, edit, problem):
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    assert res.returncode == 0, res.stderr
    path = tmp_path / "m" / "1" / "model.safetensors"
    _corrupt_header(path, edit)
    res = rnnserve("inspect", tmp_path / "m")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith(f"error: model file {path}") and problem in res.stderr
    assert res.stderr.rstrip().endswith("convert the model again (rnnserve convert)") and res.stdout == ""


def test_inspect_refuses_a_header_length_past_the_file(torch_file, tmp_path):
    rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    path = tmp_path / "m" / "1" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    res = rnnserve("inspect", tmp_path / "m", "--json")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"error: model file {path} has a corrupt header: its length prefix says {len(data):,} bytes" in res.stderr


def test_serve_with_a_missing_repository_exits_2_before_listening(tmp_path):
    res = rnnserve("serve", "--repository", tmp_path / "modles", "--http-port", "0", "--grpc-port", "0")
    assert res.returncode == 2, res.stderr
    assert f"error: model repository '{tmp_path / 'modles'}' is not a folder; pass --repository DIR" in res.stderr
    assert "HTTP on" not in res.stdout + res.stderr


def test_inspect_prints_each_buckets_algorithms_and_uncaptured_launch_time(capsys):
    """`rnnserve inspect --device cuda` prints the autotuner's table: per bucket the algorithm and ms at both
    tuning lengths, and the host ms of that call uncaptured (what a ragged batch pays without a graph)."""
    from service.cli import _print_engine
    from service.engines.cudnn.autotune import AlgoTable, BucketChoice, Trial

    per = [BucketChoice(b, 0, 0.4, {0: Trial(0, time_ms=0.4, long_ms=1.5, host_ms=1.3, long_host_ms=5.2)})
           for b in (1, 8)]
    table = AlgoTable((1, 8), [per], steps=50, long_steps=200, graphs=True)
    _print_engine({"engine": "cudnn", "algorithms": table.describe(), "layouts": table.describe_layouts()})
    lines = capsys.readouterr().out.splitlines()
    assert "launch ms" in lines[2] and "algorithm at T=200" in lines[2]
    assert lines[3].split() == ["1", "standard", "0.4000", "standard", "1.5000", "5.2000", "batch_major"]


def test_inspect_prints_each_buckets_layout_times(capsys):
    """The IO layout table: per bucket how it was timed, both layouts at both lengths, and the layout chosen."""
    from service.cli import _print_engine
    from service.engines.cudnn.autotune import AlgoTable, BucketChoice, Trial

    per = [BucketChoice(b, 0, 0.4, {0: Trial(0, time_ms=0.4, long_ms=1.5)}) for b in (1, 8)]
    table = AlgoTable((1, 8), [per], steps=50, long_steps=200, graphs=True)
    table.layouts = {1: (False, {"timed": "replay", "batch_major_ms": 0.4, "batch_major_long_ms": 1.5,
                                 "seq_major_ms": 0.5, "seq_major_long_ms": 1.6}),
                     8: (True, {"timed": "replay", "batch_major_ms": 0.9, "batch_major_long_ms": 3.1,
                                "seq_major_ms": 0.7, "seq_major_long_ms": 2.5})}
    _print_engine({"engine": "cudnn", "algorithms": table.describe(), "layouts": table.describe_layouts()})
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if "io layouts" in line)
    assert lines[at + 1].split() == ["1", "replay", "0.400/1.500", "0.500/1.600", "batch_major"]
    assert lines[at + 2].split() == ["8", "replay", "0.900/3.100", "0.700/2.500", "seq_major"]


def test_convert_refuses_an_existing_version_unless_told_to_overwrite(torch_file, tmp_path):
    first = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    assert first.returncode == 0, first.stderr
    again = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    assert again.returncode == 2 and "version 1 of 'm' is converted already" in again.stderr
    assert "--overwrite" in again.stderr and "Traceback" not in again.stderr
    forced = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify", "--overwrite",
                      "--dtype", "float16")
    assert forced.returncode == 0, forced.stderr
    assert service.load_model(tmp_path / "m").storage_dtype == "float16"


def _file_size_limit(limit: int):
    import resource

    def apply() -> None:  # Python ignores SIGXFSZ, so a write past the limit raises OSError (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_write_that_fails_leaves_the_previous_model_and_no_partial_files(torch_file, tmp_path):
    ok = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    assert ok.returncode == 0, ok.stderr
    before = (tmp_path / "m" / "1" / "model.safetensors").read_bytes()
    for name, extra in (("m", ["--overwrite", "--dtype", "bfloat16"]), ("fresh", [])):
        res = subprocess.run([sys.executable, "-m", "service.cli", "convert", str(torch_file[0]), "--name", name,
                              "--repository", str(tmp_path), "--no-verify", *extra], capture_output=True, text=True,
                             timeout=120, preexec_fn=_file_size_limit(1000))
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"error: cannot write the model to '{tmp_path / name / '1' / 'model.safetensors'}'" in res.stderr
    assert (tmp_path / "m" / "1" / "model.safetensors").read_bytes() == before  # replaced only once written whole
    assert sorted(p.name for p in (tmp_path / "m" / "1").iterdir()) == ["model.safetensors"]
    assert not (tmp_path / "fresh").exists()  # the folders that failed write made are gone


def test_convert_refuses_what_a_repository_cannot_hold(torch_file, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", a_file, "--no-verify")
    assert res.returncode == 2 and f"'{a_file}' is a file where the folder of the repository goes; move it away, " \
                                   f"or pick another --repository" in res.stderr, res.stderr
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--version", 10**18)
    assert res.returncode == 2 and "version must be a whole number from 1 to 999999999999999999" in res.stderr
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", "")
    assert res.returncode == 2 and "--repository: is empty" in res.stderr
    res = rnnserve("convert", "/dev/null", "--name", "m", "--repository", tmp_path, "--format", "torch")
    assert res.returncode == 2 and "is not a regular file" in res.stderr
    assert not (tmp_path / "m").exists()


def test_reduced_precision_is_refused_past_its_range_and_its_cost_is_reported(tmp_path):
    torch.manual_seed(3)
    net = torch.nn.LSTM(4, 8)
    path = tmp_path / "lstm.pt"
    torch.save(net.state_dict(), path)
    res = rnnserve("convert", path, "--name", "full", "--repository", tmp_path / "repo")
    full = service.load_model(tmp_path / "repo" / "full")
    x, lengths = probe_input(full.spec.input_size)
    want = ReferenceEngine(full, dtype=np.float64).forward(x.astype(np.float64), lengths).output
    for dtype in ("float16", "bfloat16"):
        res = rnnserve("convert", path, "--name", dtype, "--repository", tmp_path / "repo", "--dtype", dtype)
        assert res.returncode == 0, res.stderr
        line = next(s for s in res.stdout.splitlines() if s.startswith(f"stored as {dtype}"))
        model = service.load_model(tmp_path / "repo" / dtype)
        stored = model.provenance["verification"]["stored"]
        assert stored["dtype"] == dtype and 1e-6 < stored["max_abs_diff_from_float32"] < 1e-1
        assert f"{stored['max_abs_diff_from_float32']:.3g}" in line
        # what is reported is what the stored file serves (bfloat16 was reported as 0: compared unrounded)
        got = ReferenceEngine(model, dtype=np.float64).forward(x.astype(np.float64), lengths).output
        assert float(np.max(np.abs(got - want))) == pytest.approx(stored["max_abs_diff_from_float32"], rel=1e-6)
    with torch.no_grad():
        net.weight_ih_l0[0, 0] = 1e6  # float16 tops out at 65504: stored as inf, every output NaN
    torch.save(net.state_dict(), path)
    res = rnnserve("convert", path, "--name", "big", "--repository", tmp_path / "repo", "--dtype", "float16")
    assert res.returncode == 2 and "tensor 'block0.weights' has a weight of magnitude 1e+06, past float16's range" \
        in res.stderr
    assert not (tmp_path / "repo" / "big").exists()


def test_inspect_says_which_part_of_the_path_is_wrong(torch_file, tmp_path):
    assert rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify").returncode == 0
    res = rnnserve("inspect", tmp_path / "m" / "2")
    assert res.returncode == 2 and "model 'm' has no version 2 (have [1])" in res.stderr
    res = rnnserve("inspect", tmp_path)
    assert res.returncode == 2 and f"'{tmp_path}' is a model repository; name one of its models" in res.stderr
    res = rnnserve("inspect", tmp_path / "m" / "1" / "model.safetensors" / "x")
    assert res.returncode == 2 and "no model at" in res.stderr
    res = rnnserve("inspect", "/dev/null")
    assert res.returncode == 2 and "not a model folder: '/dev/null'" in res.stderr
    res = rnnserve("convert", torch_file[0], "--name", "e", "--repository", tmp_path, "--select", " , ")
    assert res.returncode == 2 and "--select is empty" in res.stderr


def test_convert_warns_when_the_model_folder_keeps_a_config_that_will_not_load(torch_file, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"max_batchsize": 3}')
    res = rnnserve("convert", torch_file[0], "--name", "m", "--repository", tmp_path, "--no-verify")
    assert res.returncode == 0, res.stderr
    assert "warning: the model folder's config.json, kept as it was, will not load: " in res.stderr
    assert "max_batchsize: not a setting" in res.stderr
