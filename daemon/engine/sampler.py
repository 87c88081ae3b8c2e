"""Logits -> tokens for a batch of rows: penalties, min_tokens, temperature, top-k/top-p/min-p, and a
seeded draw per row (inverse CDF with a counter-based uniform), or argmax for greedy rows.

Each row is one output position of one request. Every operation is row-wise, so a row's result does
not depend on the other rows in the batch.
"""

from __future__ import annotations

import dataclasses

import paddle
import paddle.nn.functional as F
from paddle import _C_ops

from mtpserve.ops import cpu_op_available

NEG_INF = float("-inf")

TOKEN_LOGPROBS_OP = "mtp_token_logprobs"


@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters, device tensors of N rows (built by the runner from slot state)."""

    temperature: paddle.Tensor  # [N] float32, 0 = greedy
    top_p: paddle.Tensor  # [N] float32
    top_k: paddle.Tensor  # [N] int64, <= 0 = off
    min_p: paddle.Tensor  # [N] float32
    presence: paddle.Tensor  # [N] float32
    frequency: paddle.Tensor  # [N] float32
    repetition: paddle.Tensor  # [N] float32
    min_tokens: paddle.Tensor  # [N] int64
    out_index: paddle.Tensor  # [N] int64, the output position this row decides
    keys: paddle.Tensor  # [N] int64, rng.seed_to_key(seed)
    stop_ids: paddle.Tensor  # [N, S] int64, EOS (unless ignore_eos) and stop ids, -1 = padding
    # NOTE: host-known flag: top-k/top-p need a sort of every row, skipped when no row asks for it.
    needs_sort: bool = True


def apply_penalties(logits: paddle.Tensor, counts: paddle.Tensor, prompt_mask: paddle.Tensor,
                    p: RowParams) -> paddle.Tensor:
    """logits, counts (output-token counts): [N, V] float32; prompt_mask: [N, V] bool."""
    seen = paddle.logical_or(prompt_mask, counts > 0)
    rep = p.repetition.unsqueeze(-1)  # [N, 1]
    scaled = paddle.where(logits > 0, logits / rep, logits * rep)
    logits = paddle.where(seen, scaled, logits)
    present = (counts > 0).astype(logits.dtype)
    return logits - p.frequency.unsqueeze(-1) * counts - p.presence.unsqueeze(-1) * present


def mask_stops_before_min_tokens(logits: paddle.Tensor, p: RowParams) -> paddle.Tensor:
    """Stop tokens get -inf on rows whose output position is below min_tokens. logits: [N, V]."""
    if p.stop_ids.shape[1] == 0:
        return logits
    valid = p.stop_ids >= 0  # [N, S]
    idx = paddle.where(valid, p.stop_ids, paddle.zeros_like(p.stop_ids))
    current = paddle.take_along_axis(logits, idx, axis=1)  # [N, S]
    active = paddle.logical_and(valid, (p.out_index < p.min_tokens).unsqueeze(-1))
    values = paddle.where(active, paddle.full_like(current, NEG_INF), current)
    # NOTE: padding entries point at token 0 and write back its own value; rows are independent.
    return paddle.put_along_axis(logits, idx, values, axis=1, reduce="assign")


def filter_probs(probs: paddle.Tensor, p: RowParams) -> paddle.Tensor:
    """Zero what top-k, top-p and min-p drop, then renormalise. probs: [N, V] -> [N, V].

    Thresholds are values, so the comparison runs in vocabulary order without a scatter; ties at
    the threshold are all kept.
    """
    keep = probs >= p.min_p.unsqueeze(-1) * probs.max(axis=-1, keepdim=True)
    if p.needs_sort:
        keep = paddle.logical_and(keep, probs >= _sorted_threshold(probs, p))
    kept = paddle.where(keep, probs, paddle.zeros_like(probs))
    return kept / kept.sum(axis=-1, keepdim=True)


def _sorted_threshold(probs: paddle.Tensor, p: RowParams) -> paddle.Tensor:
    """The smallest probability that both top-k and top-p keep. -> [N, 1]."""
    vocab = probs.shape[-1]
    ordered = paddle.sort(probs, axis=-1, descending=True)  # [N, V]
    mass_before = paddle.cumsum(ordered, axis=-1) - ordered
    num_top_p = (mass_before < p.top_p.unsqueeze(-1)).astype("int64").sum(axis=-1)  # [N]
    num_top_k = paddle.where(p.top_k > 0, paddle.clip(p.top_k, max=vocab), paddle.full_like(p.top_k, vocab))
    num_keep = paddle.clip(paddle.minimum(num_top_p, num_top_k), min=1)
    return paddle.take_along_axis(ordered, (num_keep - 1).unsqueeze(-1), axis=1)


def processed_logits(logits: paddle.Tensor, counts: paddle.Tensor | None,
                     prompt_mask: paddle.Tensor | None, p: RowParams) -> paddle.Tensor:
    """Penalties and the min_tokens mask. counts/prompt_mask None: no row has a penalty (host-known),
    so that work is skipped. -> [N, V] float32; its argmax is the greedy choice."""
    logits = logits.astype("float32")
    if counts is not None and prompt_mask is not None:
        logits = apply_penalties(logits, counts, prompt_mask, p)
    return mask_stops_before_min_tokens(logits, p)


def probs_from(logits: paddle.Tensor, p: RowParams) -> paddle.Tensor:
    """Temperature, softmax, then top-k/top-p/min-p. logits: processed [N, V] -> probs [N, V]."""
    temperature = paddle.where(p.temperature > 0, p.temperature, paddle.ones_like(p.temperature))
    return filter_probs(F.softmax(logits / temperature.unsqueeze(-1), axis=-1), p)


def target_probs(logits: paddle.Tensor, counts: paddle.Tensor | None, prompt_mask: paddle.Tensor | None,
                 p: RowParams) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The distribution each row samples from, and the greedy choice. -> probs [N, V], argmax [N]."""
    logits = processed_logits(logits, counts, prompt_mask, p)
    return probs_from(logits, p), paddle.argmax(logits, axis=-1)


def draw(probs: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
    """Inverse-CDF draw. probs: [..., V] (need not be normalised), u: [...] in (0, 1) -> ids [...]."""
    cdf = paddle.cumsum(probs, axis=-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    ids = (cdf < target).astype("int64").sum(axis=-1)
    # NOTE: float rounding can leave u * total above the last cdf entry; clamp into the vocabulary.
    return paddle.clip(ids, max=probs.shape[-1] - 1)


def choose(probs: paddle.Tensor, greedy_ids: paddle.Tensor, u: paddle.Tensor,
           temperature: paddle.Tensor) -> paddle.Tensor:
    """Greedy rows take argmax, the others a draw. -> ids [N] int64."""
    return paddle.where(temperature > 0, draw(probs, u), greedy_ids)


def gather_logprobs(logits: paddle.Tensor, token_ids: paddle.Tensor, num_top: int
                    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Raw (model) logprobs of the chosen tokens. logits: [N, V], token_ids: [N].

    -> token logprob [N], token rank [N] (1 = most likely), top ids [N, n], top logprobs [N, n].
    NOTE: CPU hosts use the `mtp_token_logprobs` op (ops_ext/token_logprobs.cc): one pass per row,
    where Paddle's CPU log_softmax alone took ~94 ms for [48, 4096]. Elsewhere Paddle's kernels.
    """
    if cpu_op_available(TOKEN_LOGPROBS_OP):
        # NOTE: no astype where the dtype is already right: each is one more Paddle call in the step
        logits = logits if logits.dtype == paddle.float32 else logits.astype("float32")
        token_ids = token_ids if token_ids.dtype == paddle.int64 else token_ids.astype("int64")
        out = _C_ops._run_custom_op(  # pyright: ignore[reportAttributeAccessIssue]
            TOKEN_LOGPROBS_OP, logits, token_ids, num_top)
        return out[0], out[1], out[2], out[3]
    logprobs = F.log_softmax(logits.astype("float32"), axis=-1)
    chosen = paddle.take_along_axis(logprobs, token_ids.unsqueeze(-1), axis=1).squeeze(-1)
    rank = (logprobs > chosen.unsqueeze(-1)).astype("int64").sum(axis=-1) + 1
    top_lp, top_ids = paddle.topk(logprobs, k=max(num_top, 1), axis=-1)
    return chosen, rank, top_ids[:, :num_top], top_lp[:, :num_top]


def check_bounds(token_ids, vocab_size: int) -> None:
    """Host side, on the emitted ids (numpy): a token outside the vocabulary is a bug, never sent."""
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size}): "
                         f"min {token_ids.min()}, max {token_ids.max()}")
