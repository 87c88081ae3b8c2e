"""Verify k draft tokens against one target pass (Leviathan et al. 2023, "Fast inference from
transformers via speculative decoding", Algorithm 1), batched over requests.

Row b holds the target distributions p_0..p_k for the k+1 positions of its window (p_j decides the
token after draft j-1; p_k is the bonus position) and the drafts d_1..d_k drawn from q_1..q_k.
  * Temperature 0: accept d_j while it equals the target argmax; emit the argmax at the first
    mismatch (or the bonus argmax). The output is exactly plain greedy decoding.
  * Temperature > 0: accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection emit a
    draw from normalise(max(p - q, 0)); if all k are accepted emit a bonus draw from p_k. The emitted
    tokens are distributed exactly as sampling from p alone. MTP drafts are argmax, so q is one-hot
    (`draft_probs=None`): acceptance is p(d_j) and the residual is p with d_j removed.

On CPU hosts `sample_and_verify` does both, and the plain draws of prompt rows, in one op
(ops_ext/sample_verify.cc); these Paddle functions are the other devices' way and the op's reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import paddle

from mtpserve.engine import rng
from mtpserve.engine.sampler import RowParams, choose, draw, probs_from
from mtpserve.host_tensor import host_tensor
from mtpserve.ops import cpu_op_available, run_op

SAMPLE_VERIFY_OP = "mtp_sample_verify"


class VerifyResult(NamedTuple):
    token_ids: paddle.Tensor  # [B, k+1] int64: accepted drafts, then the recovered/bonus token, then -1
    num_emitted: paddle.Tensor  # [B] int64 = num_accepted + 1
    num_accepted: paddle.Tensor  # [B] int64


def accept_coins(p_draft: paddle.Tensor, q_draft: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
    """Accept with probability min(1, p/q): u < p/q, written u*q < p to avoid dividing. [B, k] bool."""
    return u * q_draft < p_draft


def accepted_prefix(accept: paddle.Tensor) -> paddle.Tensor:
    """Length of the leading run of accepted drafts. accept: [B, k] bool -> [B] int64."""
    return paddle.cumprod(accept.astype("int64"), dim=1).sum(axis=1)


def residual(p: paddle.Tensor, q: paddle.Tensor | None, draft_ids: paddle.Tensor,
             has_draft: paddle.Tensor | None = None) -> paddle.Tensor:
    """max(p - q, 0) per draft position (unnormalised). p: [B, k, V], q: [B, k, V] or None (one-hot).
    has_draft: [B, k] bool; where False (a row that drafted fewer than k) the window ends there with a
    plain draw, so the residual is p itself.

    NOTE: when p == q the residual is all zero, but then rejection has probability 0; fall back to p so
    the (never used) draw stays defined.
    """
    if has_draft is not None:
        return paddle.where(has_draft.unsqueeze(-1), residual(p, q, draft_ids), p)
    if q is None:
        idx = draft_ids.unsqueeze(-1)  # [B, k, 1]
        res = paddle.put_along_axis(p, idx, paddle.zeros_like(idx, dtype=p.dtype), axis=2,
                                    reduce="assign")
    else:
        res = paddle.clip(p - q, min=0.0)
    empty = (res.sum(axis=-1, keepdim=True) <= 0)
    return paddle.where(empty, p, res)


def emit(candidates: paddle.Tensor, draft_ids: paddle.Tensor, num_accepted: paddle.Tensor
         ) -> VerifyResult:
    """Assemble [d_1..d_n, candidates[n], -1...]. candidates: [B, k+1], draft_ids: [B, k]."""
    k = draft_ids.shape[1]
    final = paddle.take_along_axis(candidates, num_accepted.unsqueeze(-1), axis=1)  # [B, 1]
    padded = paddle.concat([draft_ids, final], axis=1)  # [B, k+1]
    col = paddle.arange(k + 1, dtype="int64").unsqueeze(0)  # [1, k+1]
    n = num_accepted.unsqueeze(-1)
    tokens = paddle.where(col < n, padded, paddle.where(col == n, final.expand_as(padded),
                                                        paddle.full_like(padded, -1)))
    return VerifyResult(tokens, num_accepted + 1, num_accepted)


def verify_greedy(target_ids: paddle.Tensor, draft_ids: paddle.Tensor) -> VerifyResult:
    """target_ids: [B, k+1] argmax per position; draft_ids: [B, k]."""
    k = draft_ids.shape[1]
    n = accepted_prefix(draft_ids == target_ids[:, :k])
    return emit(target_ids, draft_ids, n)


def verify_greedy_numpy(target_ids: np.ndarray, draft_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`verify_greedy` on host arrays, for a CPU device where a dozen tiny Paddle ops cost more than
    the work. target_ids: [B, k+1], draft_ids: [B, k] -> token_ids [B, k+1] (-1 padded), num_accepted [B]."""
    k = draft_ids.shape[1]
    num_accepted = np.cumprod(draft_ids == target_ids[:, :k], axis=1).sum(axis=1)
    keep = np.arange(k + 1)[None, :] <= num_accepted[:, None]
    return np.where(keep, target_ids, -1), num_accepted


def verify_sampled(probs: paddle.Tensor, draft_ids: paddle.Tensor, draft_probs: paddle.Tensor | None,
                   u_accept: paddle.Tensor, u_sample: paddle.Tensor) -> VerifyResult:
    """probs: [B, k+1, V] processed target distributions; draft_ids: [B, k], -1 past a row's last
    draft; draft_probs: [B, k, V] or None for one-hot drafts; u_accept: [B, k], u_sample: [B, k+1]
    uniforms in (0, 1)."""
    k = draft_ids.shape[1]
    has_draft = draft_ids >= 0
    ids = paddle.clip(draft_ids, min=0).unsqueeze(-1)  # NOTE: a valid index; the coin below rejects it
    p_draft = paddle.take_along_axis(probs[:, :k], ids, axis=2).squeeze(-1)
    if draft_probs is None:
        q_draft = paddle.ones_like(p_draft)
    else:
        q_draft = paddle.take_along_axis(draft_probs, ids, axis=2).squeeze(-1)
    n = accepted_prefix(accept_coins(p_draft, q_draft, u_accept) & has_draft)
    recovered = draw(residual(probs[:, :k], draft_probs, ids.squeeze(-1), has_draft), u_sample[:, :k])
    bonus = draw(probs[:, k], u_sample[:, k]).unsqueeze(-1)  # [B, 1]
    return emit(paddle.concat([recovered, bonus], axis=1), draft_ids, n)


def verify(probs: paddle.Tensor, target_ids: paddle.Tensor, draft_ids: paddle.Tensor,
           draft_probs: paddle.Tensor | None, u_accept: paddle.Tensor, u_sample: paddle.Tensor,
           temperature: paddle.Tensor) -> VerifyResult:
    """Greedy rows (temperature [B] == 0) verify by argmax, the others by rejection sampling."""
    greedy = verify_greedy(target_ids, draft_ids)
    sampled = verify_sampled(probs, draft_ids, draft_probs, u_accept, u_sample)
    is_greedy = temperature <= 0
    pick = lambda a, b: paddle.where(is_greedy.reshape([-1] + [1] * (a.ndim - 1)), a, b)  # noqa: E731
    return VerifyResult(*(pick(g, s) for g, s in zip(greedy, sampled)))


def sample_and_verify_paddle(logits: paddle.Tensor, greedy: paddle.Tensor, params: RowParams, drafts: np.ndarray
                             ) -> tuple[np.ndarray, VerifyResult | None]:
    """The Paddle way of `sample_and_verify` (other devices, and the op's reference): logits [B*(k+1), V]
    processed, greedy [B, k+1] their argmax, params of the B*(k+1) verify rows, drafts [B, k] (-1 padded).
    -> every request's plain draw at position 0 [B], and its window verified (None when k = 0)."""
    b, k = drafts.shape
    probs = probs_from(logits, params).reshape([b, k + 1, -1])
    keys, index = params.keys.reshape([b, k + 1]), params.out_index.reshape([b, k + 1])
    u_sample = rng.uniforms(keys, index, rng.Purpose.SAMPLE)  # [B, k+1]
    temperature = params.temperature.reshape([b, k + 1])[:, 0]
    first = choose(probs[:, 0], greedy[:, 0], u_sample[:, 0], temperature).numpy()
    if k == 0:
        return first, None
    u_accept = rng.uniforms(keys, index, rng.Purpose.ACCEPT)[:, :k]
    return first, verify(probs, greedy, host_tensor(drafts), None, u_accept, u_sample, temperature)


class HostSampling(NamedTuple):
    """Per request [B] of a step, host arrays: what `sample_and_verify` draws with."""

    temperature: np.ndarray  # float32, 0 = greedy
    top_p: np.ndarray  # float32
    top_k: np.ndarray  # int64, <= 0 = off
    min_p: np.ndarray  # float32

    def row_params(self, keys: np.ndarray, out_index: np.ndarray) -> RowParams:
        """The Paddle path's parameters of these requests' verify rows (keys [B], out_index [B, k+1]), with
        no penalty and no min_tokens (benchmarks and tests of the op against that path)."""
        width = out_index.shape[1]
        rep = lambda a: host_tensor(np.repeat(a, width))  # noqa: E731
        zeros, ones = np.zeros_like(self.temperature), np.ones_like(self.temperature)
        return RowParams(temperature=rep(self.temperature), top_p=rep(self.top_p), top_k=rep(self.top_k),
                         min_p=rep(self.min_p), presence=rep(zeros), frequency=rep(zeros), repetition=rep(ones),
                         min_tokens=rep(np.zeros_like(self.top_k)), out_index=host_tensor(out_index.reshape(-1)),
                         keys=rep(keys), stop_ids=host_tensor(np.full((out_index.size, 1), -1, np.int64)),
                         needs_sort=bool(((self.top_k > 0) | (self.top_p < 1)).any()))


def host_sampling_available() -> bool:
    """Whether `sample_and_verify` runs here (a CPU build with the op compiled)."""
    return cpu_op_available(SAMPLE_VERIFY_OP)


def sample_and_verify(logits: paddle.Tensor, drafts: np.ndarray, params: HostSampling, u_sample: np.ndarray,
                      u_accept: np.ndarray, is_prefill: np.ndarray,
                      stage: Callable[[str, np.ndarray], paddle.Tensor] = lambda _, a: host_tensor(a),
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`verify` (and a plain draw for prompt rows) in one CPU op. logits: [B*(k+1), V] processed (penalties
    and the min_tokens mask applied), request b's window rows b*(k+1) .. b*(k+1)+k; drafts: [B, k], -1 past
    a request's last draft; u_sample: [B, k+1], u_accept: [B, k]; is_prefill: [B] bool; `stage` makes the
    op's two parameter tensors (the runner's StagedTensors.stage). -> tokens [B, k+1] (accepted drafts, then
    the recovered/bonus/plain token, then -1) and drafts accepted [B].

    NOTE: on a 2-core host, ~80 Paddle ops of the reference path took 2.3 ms for one request's window of
    two (0.9 ms with no draft) and 17.6 ms at 64 requests; the op, one pass per window row it reads."""
    ints = np.column_stack([drafts, params.top_k, is_prefill]).astype(np.int64, copy=False)  # [B, k+2]
    floats = np.column_stack([params.temperature, params.top_p, params.min_p, u_sample, u_accept])  # [B, 2k+4]
    logits = logits if logits.dtype == paddle.float32 else logits.astype("float32")
    tokens, accepted = run_op(SAMPLE_VERIFY_OP, logits, stage("sample_ints", ints),
                              stage("sample_floats", floats.astype(np.float32, copy=False)))
    return tokens.numpy(), accepted.numpy()
