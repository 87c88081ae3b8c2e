"""The bundled model's main decoder as a GGUF file for llama.cpp (`mtpserve bench peer`).

The checkpoint is a Qwen2 decoder plus MiMo MTP layers. llama.cpp's `qwen2` architecture runs the
decoder alone, so the MTP layers (`model.mtp_layers.*`) are dropped and everything else is renamed
to llama.cpp's tensor names (gguf-py's own name map). Facts this relies on, from llama.cpp's sources:
  * `qwen2` rotates with NEOX RoPE (pairs d and d + D/2), which is Hugging Face's "rotate half" and
    daemon/model/rotary.py's, so q/k are written as they are (LLaMA-style checkpoints need a row
    permutation, this one does not);
  * weights keep the checkpoint's [out, in] layout (GGUF's ne0 is the fastest axis, `in`);
  * with no `output.weight` the loader ties the head to `token_embd.weight`;
  * the GPT-2 split regex is the pre-tokenizer named "gpt-2" (src/llama-vocab.cpp).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from mtpserve.model.safetensors_reader import SafetensorsFile, weight_files

ARCH = gguf.MODEL_ARCH.QWEN2
PRE_TOKENIZER = "gpt-2"
DROPPED_PREFIX = "model.mtp_layers."
FILE_TYPES = {gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
              gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


class ConversionError(ValueError):
    """The model directory holds something this converter does not map onto llama.cpp's qwen2."""


class Vocab(NamedTuple):
    tokens: list[str]  # [V] by id
    token_types: list[int]  # [V] gguf.TokenType
    merges: list[str]  # "left right", in rank order


def write_gguf(model_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """Write `out` (F32 or Q8_0), unless it already exists.

    1. hyper-parameters from config.json; 2. the vocabulary from tokenizer.json; 3. every decoder
    tensor, renamed (2-D ones quantized for Q8_0; norms and biases stay F32); 4. write to a temporary
    name and rename, so an interrupted run never leaves a file that looks finished.
    """
    if out.exists():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[ARCH])
    writer.add_name(f"mtpserve {model_dir.name}")
    _add_hparams(writer, config, qtype)
    _add_vocab(writer, read_vocab(model_dir / "tokenizer.json", config["vocab_size"]), config)
    for name, array in decoder_tensors(model_dir, config["num_hidden_layers"]):
        _add_tensor(writer, name, array, qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)
    return out


def _add_hparams(writer: gguf.GGUFWriter, config: dict[str, Any], qtype: gguf.GGMLQuantizationType) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))


def _add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, config: dict[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    if config.get("eos_token_id") is not None:
        writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)  # NOTE: mtpserve's tokenizer adds nothing (no post-processor)
    writer.add_add_eos_token(False)


def read_vocab(path: Path, vocab_size: int) -> Vocab:
    """Tokens by id (padded to the model's vocab_size with unused entries), their types, and merges."""
    raw = json.loads(path.read_text())
    _check_byte_level(raw)
    by_id = {token_id: token for token, token_id in raw["model"]["vocab"].items()}
    added = {t["id"]: t for t in raw.get("added_tokens", ())}
    by_id.update({token_id: t["content"] for token_id, t in added.items()})
    if max(by_id) >= vocab_size:
        raise ConversionError(f"tokenizer id {max(by_id)} is outside the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for token_id in range(vocab_size):
        tokens.append(by_id.get(token_id, f"[PAD{token_id}]"))
        types.append(_token_type(token_id in by_id, added.get(token_id)))
    return Vocab(tokens, types, [_merge_text(m) for m in raw["model"]["merges"]])


def _check_byte_level(raw: dict[str, Any]) -> None:
    """llama.cpp's gpt2 model is byte-level BPE split by the GPT-2 regex, with nothing before it."""
    pre = raw.get("pre_tokenizer") or {}
    if raw["model"].get("type") != "BPE" or raw.get("normalizer") is not None or \
            pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        raise ConversionError("tokenizer.json is not byte-level BPE with the GPT-2 regex and no normalizer")


def _token_type(present: bool, added: dict[str, Any] | None) -> int:
    if not present:
        return gguf.TokenType.UNUSED
    if added is None:
        return gguf.TokenType.NORMAL
    return gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED


def _merge_text(merge: str | list[str]) -> str:
    """tokenizer.json stores merges as "a b" (older files) or ["a", "b"]; GGUF as "a b"."""
    return merge if isinstance(merge, str) else " ".join(merge)


def decoder_tensors(model_dir: Path, num_layers: int) -> Iterator[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array in the checkpoint's layout) for every tensor but the MTP layers."""
    names = gguf.get_tensor_name_map(ARCH, num_layers)
    for path in weight_files(model_dir):
        reader = SafetensorsFile(path)
        for name in sorted(reader.names()):
            if name.startswith(DROPPED_PREFIX):
                continue
            target = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise ConversionError(f"no llama.cpp qwen2 tensor for checkpoint tensor {name}")
            yield target, np.ascontiguousarray(reader.read(name), dtype=np.float32)


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray,
                qtype: gguf.GGMLQuantizationType) -> None:
    if qtype == gguf.GGMLQuantizationType.F32 or array.ndim < 2:
        writer.add_tensor(name, array)
        return
    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
