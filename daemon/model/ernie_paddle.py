"""ERNIE-4.5 MoE's Paddle release read as the Hugging Face ("-PT") layout the model is built in.

The Paddle release (what FastDeploy loads) differs from the "-PT" one in names and layout only:
  * the prefix `ernie.` instead of `model.` (`ernie.mtp_emb_norm.0`, `ernie.mtp_block.0`, ... included);
  * linear weights stored `[in, out]` (Paddle's layout), so each is transposed;
  * `self_attn.qkv_proj` = [q | k | v] along the output axis, split into q/k/v_proj;
  * `mlp.up_gate_proj` (dense, experts, shared experts) = [gate | up] along the output axis, split
    into gate_proj/up_proj (FastDeploy loads a "-PT" checkpoint's gate_proj into the first half of the
    same fused tensor and up_proj into the second);
  * `mtp_linear_proj.{j}` is [2H, H] (rows: embedding half first, as in the "-PT" [H, 2H]).
Embeddings, norms and `moe_statics.e_score_correction_bias` are the same. Each derived tensor reads its
source when the loader copies it (one tensor at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from mtpserve.model.ernie_config import ErnieMoeConfig
from mtpserve.model.safetensors_reader import CheckpointError

PADDLE_PREFIX = "ernie."


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read(self, name: str) -> np.ndarray: ...


class Derived:
    """A tensor computed from one source tensor: shape known up front, data read on demand."""

    def __init__(self, source: TensorSource, name: str, shape: tuple[int, ...],
                 transform: Callable[[np.ndarray], np.ndarray]):
        self.source, self.name, self._shape, self.transform = source, name, shape, transform

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape

    def read(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.transform(self.source.read(self.name)))


def is_paddle_release(names: set[str]) -> bool:
    return any(n.startswith(PADDLE_PREFIX) for n in names)


def as_hf_layout(sources: dict[str, TensorSource], config: ErnieMoeConfig) -> dict[str, TensorSource]:
    """The "-PT" names, each mapped to its (derived) tensor of the Paddle release."""
    out: dict[str, TensorSource] = {}
    origin: dict[str, str] = {}  # target name -> the checkpoint tensor it came from
    for name, source in sorted(sources.items()):
        target = "model." + name[len(PADDLE_PREFIX):] if name.startswith(PADDLE_PREFIX) else name
        converted = _convert(target, name, source, config)
        clash = sorted(set(converted) & set(out))
        if clash:
            raise CheckpointError(f"checkpoint mixes the Paddle (ernie.*) and Hugging Face (model.*) layouts: "
                                  f"{origin[clash[0]]} and {name} are both {clash[0]}")
        out |= converted
        origin |= {t: name for t in converted}
    return out


def _convert(target: str, name: str, source: TensorSource, config: ErnieMoeConfig) -> dict[str, TensorSource]:
    shape = source.shape(name)
    if target.endswith("self_attn.qkv_proj.weight"):
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        stem = target[:-len("qkv_proj.weight")]
        return {stem + "q_proj.weight": _columns(source, name, shape, 0, q),
                stem + "k_proj.weight": _columns(source, name, shape, q, q + kv),
                stem + "v_proj.weight": _columns(source, name, shape, q + kv, q + 2 * kv)}
    if target.endswith("up_gate_proj.weight"):
        inner = shape[1] // 2
        stem = target[:-len("up_gate_proj.weight")]
        return {stem + "gate_proj.weight": _columns(source, name, shape, 0, inner),
                stem + "up_proj.weight": _columns(source, name, shape, inner, 2 * inner)}
    if target == "lm_head.weight" and shape != (config.hidden_size, config.vocab_size):
        return {target: source}  # NOTE: already [V, H]; only an [H, V] head is Paddle's [in, out]
    if len(shape) == 2 and _is_linear(target):
        return {target: Derived(source, name, (shape[1], shape[0]), lambda w: w.T)}
    return {target: source if name == target else Derived(source, name, shape, lambda w: w)}


def _columns(source: TensorSource, name: str, shape: tuple[int, ...], begin: int, end: int) -> Derived:
    """Output columns begin..end-1 of an [in, out] weight, as an [out, in] weight."""
    return Derived(source, name, (end - begin, shape[0]), lambda w: w[:, begin:end].T)


def _is_linear(target: str) -> bool:
    """Every 2-D weight but the embedding (moe_statics' bias is [1, E], not a linear)."""
    return not target.endswith(("embed_tokens.weight", "e_score_correction_bias"))
