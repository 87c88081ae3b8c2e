"""`mtpserve bench peer`'s pure parts: the GGUF files it writes for llama.cpp (read back with gguf-py's
reader), and the comparison helpers. Nothing here needs llama.cpp built."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from daemon_harness import BUNDLED, model_available
from mtpserve.bench.peer import first_difference, shared_texts, table, top2_gap
from mtpserve.bench.peer_gguf import ConversionError, read_vocab, write_gguf
from mtpserve.model.safetensors_reader import SafetensorsFile
from mtpserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not model_available(), reason="no bundled model")

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
CONFIG = json.loads((BUNDLED / "config.json").read_text())


@pytest.fixture(scope="module")
def checkpoint() -> dict[str, np.ndarray]:
    reader = SafetensorsFile(BUNDLED / "model.safetensors")
    return {name: reader.read(name) for name in reader.names()}


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> gguf.GGUFReader:
    return gguf.GGUFReader(write_gguf(BUNDLED, tmp_path_factory.mktemp("gguf") / "m-F32.gguf", F32))


@pytest.fixture(scope="module")
def q8(tmp_path_factory) -> gguf.GGUFReader:
    return gguf.GGUFReader(write_gguf(BUNDLED, tmp_path_factory.mktemp("gguf") / "m-Q8_0.gguf", Q8_0))


def field(reader: gguf.GGUFReader, key: str):
    found = reader.get_field(key)
    assert found is not None, key
    return found.contents()


def expected_names() -> set[str]:
    per_layer = ("attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias",
                 "attn_v.weight", "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                 "ffn_up.weight", "ffn_down.weight")
    blocks = {f"blk.{i}.{name}" for i in range(CONFIG["num_hidden_layers"]) for name in per_layer}
    return blocks | {"token_embd.weight", "output_norm.weight"}  # tied: no output.weight


def test_metadata_describes_a_qwen2_decoder(f32):
    assert field(f32, "general.architecture") == "qwen2"
    assert field(f32, "general.file_type") == gguf.LlamaFileType.ALL_F32
    expected = {"qwen2.block_count": CONFIG["num_hidden_layers"], "qwen2.embedding_length": CONFIG["hidden_size"],
                "qwen2.feed_forward_length": CONFIG["intermediate_size"],
                "qwen2.attention.head_count": CONFIG["num_attention_heads"],
                "qwen2.attention.head_count_kv": CONFIG["num_key_value_heads"],
                "qwen2.attention.key_length": CONFIG["head_dim"], "qwen2.rope.dimension_count": CONFIG["head_dim"],
                "qwen2.context_length": CONFIG["max_position_embeddings"]}
    assert {key: field(f32, key) for key in expected} == expected
    assert field(f32, "qwen2.rope.freq_base") == pytest.approx(CONFIG["rope_theta"])
    assert field(f32, "qwen2.attention.layer_norm_rms_epsilon") == pytest.approx(CONFIG["rms_norm_eps"])


def test_tokenizer_metadata_round_trips(f32):
    raw = json.loads((BUNDLED / "tokenizer.json").read_text())
    by_id = {i: token for token, i in raw["model"]["vocab"].items()}
    assert field(f32, "tokenizer.ggml.model") == "gpt2"
    assert field(f32, "tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's name for the GPT-2 regex
    assert field(f32, "tokenizer.ggml.tokens") == [by_id[i] for i in range(CONFIG["vocab_size"])]
    specials = {t["id"] for t in raw["added_tokens"] if t["special"]}
    assert field(f32, "tokenizer.ggml.token_type") == [
        gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(CONFIG["vocab_size"])]
    assert field(f32, "tokenizer.ggml.merges") == [" ".join(m) for m in raw["model"]["merges"]]
    assert field(f32, "tokenizer.ggml.eos_token_id") == CONFIG["eos_token_id"] == 0
    assert field(f32, "tokenizer.ggml.bos_token_id") == CONFIG["bos_token_id"]
    assert field(f32, "tokenizer.ggml.add_bos_token") is False


def test_f32_tensors_are_the_checkpoint_without_the_mtp_layers(f32, checkpoint):
    tensors = {t.name: t for t in f32.tensors}
    assert set(tensors) == expected_names()
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.2.attn_k.bias": "model.layers.2.self_attn.k_proj.bias",
             "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
             "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm.weight"}
    for ours, theirs in pairs.items():
        assert tensors[ours].tensor_type == F32
        assert list(tensors[ours].shape) == list(reversed(checkpoint[theirs].shape))  # GGUF: ne0 first
        np.testing.assert_array_equal(np.asarray(tensors[ours].data), checkpoint[theirs])
    assert sum(t.n_elements for t in f32.tensors) == sum(
        a.size for name, a in checkpoint.items() if not name.startswith("model.mtp_layers."))


def test_q8_0_quantizes_matrices_and_keeps_vectors(q8, checkpoint):
    tensors = {t.name: t for t in q8.tensors}
    assert set(tensors) == expected_names()
    assert field(q8, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    assert {t.tensor_type for t in q8.tensors if len(t.shape) == 1} == {F32}
    assert {t.tensor_type for t in q8.tensors if len(t.shape) == 2} == {Q8_0}
    original = checkpoint["model.layers.0.mlp.gate_proj.weight"]
    restored = gguf.quants.dequantize(np.asarray(tensors["blk.0.ffn_gate.weight"].data), Q8_0)
    assert restored.shape == original.shape
    blocks = np.abs(original).reshape(original.shape[0], -1, 32).max(axis=-1, keepdims=True)
    # NOTE: one int8 step of a 32-value block is max|x| / 127; rounding errs by half a step, and the scale,
    # stored as fp16 (relative error 2^-11), by up to 127 * 2^-11 = 0.06 step more
    assert np.all(np.abs(restored - original).reshape(*blocks.shape[:2], 32) <= blocks / 127 * 0.6)


def test_an_existing_file_is_kept(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"not rewritten")
    assert write_gguf(BUNDLED, out, F32) == out and out.read_bytes() == b"not rewritten"
    assert not list(tmp_path.glob("*.partial"))


def test_a_tokenizer_that_is_not_byte_level_is_refused(tmp_path):
    raw = json.loads((BUNDLED / "tokenizer.json").read_text())
    raw["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ConversionError):
        read_vocab(tmp_path / "tokenizer.json", CONFIG["vocab_size"])


def test_texts_several_ids_share_are_the_byte_fragments():
    """The greedy check compares decoded texts: it must know where a text does not name one id."""
    tokenizer = Tokenizer.from_model_dir(BUNDLED)
    shared = shared_texts(tokenizer)
    assert "\ufffd" in shared  # partial UTF-8 bytes, each alone
    assert tokenizer.inner.decode([tokenizer.encode("def")[0]]) not in shared


def test_first_difference_and_top2_gap():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference(["a", "b"], ["a", "b", "c"]) == 2
    assert top2_gap({"x": -0.1, "y": -0.3, "z": -2.0}) == pytest.approx(0.2)
    assert top2_gap({"x": -0.1}) is None


def test_table_ratios_are_to_llama_cpp_f32_at_the_same_level():
    def run(label: str, concurrency: int, rate: float) -> dict:
        summary = {"output_throughput": rate, "tpot_ms": {"p50": 5.0}, "ttft_ms": {"p50": 9.0},
                   "total_output_tokens": 256, "completed": 2, "failed": 0}
        return {"label": label, "concurrency": concurrency, "output_len": 128, "summary": summary}

    runs = [run("mtp-k2", 1, 300.0), run("llama-f32", 1, 200.0), run("llama-f32", 4, 500.0), run("mtp-k2", 4, 400.0)]
    rows = table(runs, ["llama-f32", "mtp-k2"])
    assert [(r["concurrency"], r["label"], r["ratio_to_llama_f32"]) for r in rows] == [
        (1, "llama-f32", 1.0), (1, "mtp-k2", 1.5), (4, "llama-f32", 1.0), (4, "mtp-k2", 0.8)]
    assert rows[0]["tokens_per_request"] == 128
