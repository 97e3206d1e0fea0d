"""Saving and loading the repository format: safetensors with spec and provenance metadata."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from service import load_model
from service.errors import InvalidInput, NotFound
from service.packing import block_param_count
from service.repository import PackedModel
from service.spec import BlockSpec, RNNSpec


def _model(seed=0, variant=None) -> PackedModel:
    blocks = (BlockSpec("lstm", 7, 13, 2, True, variant=variant or {}), BlockSpec("gru", 26, 5))
    rng = np.random.default_rng(seed)
    extras = {}
    if variant and variant.get("peephole"):
        extras["block0.peephole"] = rng.standard_normal((4, 3, 13)).astype(np.float32)
    return PackedModel(RNNSpec(blocks), [rng.standard_normal(block_param_count(b)).astype(np.float32) for b in blocks],
                       extras, {"source": "x.pt", "format": "torch"})


def test_roundtrip_float32_and_layout_on_disk(tmp_path):
    m = _model()
    path = m.save(tmp_path, "tagger", 3)
    assert path == tmp_path / "tagger" / "3" / "model.safetensors"
    assert json.loads((tmp_path / "tagger" / "config.json").read_text()) == {}
    back = load_model(tmp_path / "tagger")
    assert back.version == 3 and back.name == "tagger" and back.spec == m.spec
    for a, b in zip(m.weights, back.weights):
        np.testing.assert_array_equal(a, b)
    assert back.provenance == m.provenance
    # The official library reads it too, with the spec in the metadata.
    with safe_open(str(path), framework="numpy") as f:
        assert json.loads(f.metadata()["rnnserve.spec"])["blocks"][0]["cell"] == "lstm"
        np.testing.assert_array_equal(f.get_tensor("block1.weights"), m.weights[1])


def test_versions_latest_and_explicit(tmp_path):
    _model(0).save(tmp_path, "m", 1)
    _model(1).save(tmp_path, "m", 2)
    assert load_model(tmp_path / "m").version == 2
    assert load_model(tmp_path / "m" / "1").version == 1
    with pytest.raises(NotFound, match="has no version 7"):
        load_model(tmp_path / "m", version=7)
    with pytest.raises(NotFound, match="no model at"):
        load_model(tmp_path / "missing")


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-3), ("bfloat16", 8e-3)])
def test_reduced_precision_storage(tmp_path, dtype, tol):
    m = _model()
    m.save(tmp_path, "m", 1, dtype=dtype)
    back = load_model(tmp_path / "m")
    assert back.storage_dtype == dtype
    for a, b in zip(m.weights, back.weights):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


def test_peephole_extras_roundtrip(tmp_path):
    m = _model(variant={"peephole": True})
    m.save(tmp_path, "p", 1)
    back = load_model(tmp_path / "p")
    np.testing.assert_array_equal(back.extras["block0.peephole"], m.extras["block0.peephole"])
    assert back.spec.blocks[0].variant_names == ["peephole"]


def test_bad_files_get_clear_errors(tmp_path):
    m = _model()
    path = m.save(tmp_path, "m", 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidInput, match="truncated"):
        load_model(tmp_path / "m")
    path.write_bytes(b"\x01\x02")
    with pytest.raises(InvalidInput, match="truncated"):
        load_model(tmp_path / "m")
    path.write_bytes((10).to_bytes(8, "little") + b"not json!!")
    with pytest.raises(InvalidInput, match="corrupt header"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"max_batch_sise": 3}')
    path.write_bytes(data)
    with pytest.raises(InvalidInput, match="max_batch_sise"):
        load_model(tmp_path / "m")


def test_bad_names_and_specs():
    with pytest.raises(InvalidInput, match="not allowed"):
        _model().save("/tmp", "../evil", 1)
    with pytest.raises(InvalidInput, match="block 1 expects 5 input features but block 0 produces 26"):
        RNNSpec((BlockSpec("lstm", 7, 13, 1, True), BlockSpec("gru", 5, 5)))
    with pytest.raises(InvalidInput, match="proj_size is only defined for LSTM"):
        BlockSpec("gru", 3, 5, proj_size=2)
    with pytest.raises(InvalidInput, match="unknown cell"):
        BlockSpec("lstmx", 3, 5)


def test_a_file_where_the_model_s_folder_goes_is_named(tmp_path):
    """The write failed with "Not a directory; pick a --repository folder you can write to"."""
    block = BlockSpec("gru", 2, 3)
    model = PackedModel(RNNSpec((block,)), [np.zeros(block_param_count(block), np.float32)], {}, {})
    (tmp_path / "m").write_text("not a folder")
    with pytest.raises(InvalidInput, match=r"'.*/m' is a file where the folder of model 'm' goes; move it away, or "
                                           r"pick another --name"):
        model.save(tmp_path, "m", 1)
