"""Fixtures: a tiny model with random (non-trivial) weights and a helper that packs paged batches."""

from __future__ import annotations

from typing import Any

import dataclasses

import numpy as np
import paddle

from mtpserve.model.config import ModelConfig
from mtpserve.model.forward_batch import ForwardBatch
from mtpserve.model.mimo_model import MiMoForCausalLM

TINY: dict[str, Any] = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
            num_nextn_predict_layers=2, architecture="MiMoForCausalLM",
            mtp_zero_position_zero=False)  # NOTE: the bundled model's convention (test_mimo_conventions.py: the other)
# NOTE: TINY's widths are not whole 32-column panels, so it runs the Paddle-op blocks; PACKED's are, and
# on CPU hosts it runs each block as one op (model/fused_layer.py).
PACKED: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def randomize(model: MiMoForCausalLM, seed: int) -> None:
    """Every parameter random, norms around 1 and biases non-zero, so no term can hide."""
    rng = np.random.default_rng(seed)
    for name, p in model.state_dict().items():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            value = 1.0 + 0.2 * rng.standard_normal(p.shape)
        else:
            value = 0.15 * rng.standard_normal(p.shape)
        p.set_value(paddle.to_tensor(value.astype(np.float32)))


def make_model(seed: int = 0, **overrides) -> MiMoForCausalLM:
    paddle.seed(seed)
    model = MiMoForCausalLM(ModelConfig(**{**TINY, **overrides}))
    randomize(model, seed)
    model.eval()
    return model




def weights_of(model: MiMoForCausalLM) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


@dataclasses.dataclass
class Window:
    """One request's slice of a step: `ids` at positions start..start+len-1, KV in `blocks`."""

    ids: list[int]
    start: int
    blocks: list[int]
    invalid_tail: int = 0  # trailing tokens marked slot -1 (over-allocated)


def pack(windows: list[Window], block_size: int, max_blocks: int) -> ForwardBatch:
    ids, positions, slots, cu, kv_lens = [], [], [], [0], []
    for w in windows:
        for j, token in enumerate(w.ids):
            pos = w.start + j
            ids.append(token)
            positions.append(pos)
            valid = j < len(w.ids) - w.invalid_tail
            slots.append(w.blocks[pos // block_size] * block_size + pos % block_size if valid else -1)
        cu.append(len(ids))
        kv_lens.append(w.start + len(w.ids) - w.invalid_tail)
    tables = np.full((len(windows), max_blocks), -1, np.int32)
    for b, w in enumerate(windows):
        tables[b, : len(w.blocks)] = w.blocks
    return ForwardBatch(
        input_ids=paddle.to_tensor(np.array(ids, np.int64)),
        positions=paddle.to_tensor(np.array(positions, np.int64)),
        slot_mapping=paddle.to_tensor(np.array(slots, np.int64)),
        cu_seqlens_q=paddle.to_tensor(np.array(cu, np.int32)),
        seq_lens_kv=paddle.to_tensor(np.array(kv_lens, np.int32)),
        block_tables=paddle.to_tensor(tables),
        max_q_len=max(len(w.ids) for w in windows),
    )
