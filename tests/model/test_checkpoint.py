"""Checkpoint save/load: exact round trip, sharded files, bf16, tensor-parallel slicing, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model_fixtures import TINY, make_model, weights_of
from mtpserve.model.checkpoint import CheckpointError, load_weights, save_checkpoint
from mtpserve.model.config import ModelConfig, UnsupportedArchitectureError
from mtpserve.model.loader import load_model
from mtpserve.model.mimo_model import MiMoForCausalLM
from mtpserve.model.parallel import TensorParallel


def saved(tmp_path, seed: int = 0, **overrides):
    model = make_model(seed, **overrides)
    save_checkpoint(model, tmp_path)
    return model


def test_save_then_load_round_trips_exactly(tmp_path):
    original = saved(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == original.config
    for name, value in weights_of(original).items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value, err_msg=name)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    original = saved(tmp_path / "one")
    tensors = load_file(str(tmp_path / "one" / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    loaded = load_model(tmp_path)
    for name, value in weights_of(original).items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value)


def test_bf16_tensors_are_widened(tmp_path):
    original = saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.norm.weight"
    bits = (tensors[name].view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    _rewrite_as_bf16(path, name, bits)
    loaded = load_model(tmp_path)
    expected = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), expected)
    assert not np.array_equal(expected, original.state_dict()[name].numpy())


def _rewrite_as_bf16(path, name: str, bits: np.ndarray) -> None:
    """Re-encode one tensor as BF16 by editing the safetensors header and data directly."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), bytearray(raw[8 + n:])
    begin, _ = header[name]["data_offsets"]
    data[begin:begin + bits.nbytes] = bits.tobytes()
    header[name]["dtype"] = "BF16"
    header[name]["data_offsets"] = [begin, begin + bits.nbytes]
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))


def test_missing_tensor_is_named(tmp_path):
    saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.9.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.9\.extra\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.mtp_layers.0.input_proj.weight"] = np.zeros((48, 95), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.mtp_layers\.0\.input_proj\.weight.*\[48, 95\].*\[48, 96\]"):
        load_model(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    saved(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        load_model(tmp_path)


def test_tensor_parallel_rank_gets_its_slice(tmp_path):
    original = weights_of(saved(tmp_path, vocab_size=98))
    config = ModelConfig(**{**TINY, "vocab_size": 98})
    rank1 = MiMoForCausalLM(config, TensorParallel(rank=1, size=2))
    load_weights(rank1, tmp_path)
    local = weights_of(rank1)
    q = "model.layers.0.self_attn.q_proj.weight"  # column-parallel: rows split
    np.testing.assert_array_equal(local[q], original[q][24:])
    o = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: columns split
    np.testing.assert_array_equal(local[o], original[o][:, 24:])
    np.testing.assert_array_equal(local["model.layers.0.self_attn.o_proj.weight"].shape, (48, 24))
    e = "model.embed_tokens.weight"  # vocab-parallel: rows split
    np.testing.assert_array_equal(local[e], original[e][49:])
    n = "model.layers.0.input_layernorm.weight"  # replicated
    np.testing.assert_array_equal(local[n], original[n])
