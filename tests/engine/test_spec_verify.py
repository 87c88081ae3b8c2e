"""The verifier keeps the target distribution: 100k emitted tokens per position on a small vocabulary
against random target/draft distributions; deliberately broken verifiers fail the same test."""

import math

import numpy as np
import paddle
import pytest

from chi_square import chi2_sf
from mtpserve.engine import rng as counter_rng
from mtpserve.engine.sampler import draw
from mtpserve.engine.spec_verify import (accept_coins, accepted_prefix, emit, residual, verify,
                                         verify_greedy, verify_greedy_numpy, verify_sampled)

V, K, SAMPLES = 8, 3, 100_000
# NOTE: alpha 3 makes targets and drafts overlap (~75% acceptance), so ~3x SAMPLES rows reach the
# last position; the broken verifiers still shift the distributions far beyond sampling noise.
ALPHA = 3.0


def make_case(seed):
    gen = np.random.default_rng(seed)
    p = gen.dirichlet(np.full(V, ALPHA), size=K + 1).astype(np.float32)  # [k+1, V]
    q = gen.dirichlet(np.full(V, ALPHA), size=K).astype(np.float32)  # [k, V]
    reach_last = np.prod(np.minimum(p[:K], q).sum(axis=1))
    rows = int(math.ceil(SAMPLES / reach_last * 1.25)) + 1000
    cdf = np.cumsum(q, axis=1)
    drafts = np.stack([np.searchsorted(cdf[j], gen.random(rows) * cdf[j, -1]) for j in range(K)], 1)
    keys = paddle.to_tensor(counter_rng.seed_to_key(np.arange(rows) + seed * 10**7))
    index = paddle.arange(K + 1, dtype="int64").unsqueeze(0).expand([rows, K + 1])
    u_acc = counter_rng.uniforms(keys.unsqueeze(-1).expand([rows, K + 1]), index,
                                 counter_rng.Purpose.ACCEPT)[:, :K]
    u_smp = counter_rng.uniforms(keys.unsqueeze(-1).expand([rows, K + 1]), index,
                                 counter_rng.Purpose.SAMPLE)
    P = paddle.to_tensor(p).unsqueeze(0).expand([rows, K + 1, V])
    Q = paddle.to_tensor(q).unsqueeze(0).expand([rows, K, V])
    return p, P, Q, paddle.to_tensor(np.minimum(drafts, V - 1).astype(np.int64)), u_acc, u_smp


def distribution_problems(tokens, p, positions=K + 1, samples=SAMPLES):
    """TV distance and chi-square p-value per position over the first `samples` emitted tokens."""
    out = []
    for j in range(positions):
        col = tokens[:, j]
        col = col[col >= 0][:samples]
        assert col.shape[0] == samples, "not enough rows reached this position"
        freq = np.bincount(col, minlength=V) / samples
        tv = 0.5 * np.abs(freq - p[j]).sum()
        chi2 = (samples * (freq - p[j]) ** 2 / p[j]).sum()
        out.append((tv, chi2_sf(chi2, V - 1)))
    return out


def passes(stats):
    return all(tv < 0.01 and pval > 1e-4 for tv, pval in stats)


def always_accept(P, draft_ids, Q, u_acc, u_smp):
    n = paddle.full([draft_ids.shape[0]], K, dtype="int64")
    bonus = draw(P[:, K], u_smp[:, K]).unsqueeze(-1)
    return emit(paddle.concat([draft_ids, bonus], 1), draft_ids, n)


def resample_from_target(P, draft_ids, Q, u_acc, u_smp):
    p_d = paddle.take_along_axis(P[:, :K], draft_ids.unsqueeze(-1), 2).squeeze(-1)
    q_d = paddle.take_along_axis(Q, draft_ids.unsqueeze(-1), 2).squeeze(-1)
    n = accepted_prefix(accept_coins(p_d, q_d, u_acc))
    return emit(draw(P, u_smp), draft_ids, n)


def accept_ten_percent_more(P, draft_ids, Q, u_acc, u_smp):
    p_d = paddle.take_along_axis(P[:, :K], draft_ids.unsqueeze(-1), 2).squeeze(-1)
    q_d = paddle.take_along_axis(Q, draft_ids.unsqueeze(-1), 2).squeeze(-1)
    n = accepted_prefix(accept_coins(1.1 * p_d, q_d, u_acc))
    recovered = draw(residual(P[:, :K], Q, draft_ids), u_smp[:, :K])
    return emit(paddle.concat([recovered, draw(P[:, K], u_smp[:, K]).unsqueeze(-1)], 1), draft_ids, n)


@pytest.mark.parametrize("seed", [1, 2])
def test_rejection_sampling_preserves_the_target_distribution(seed):
    p, P, Q, drafts, u_acc, u_smp = make_case(seed)
    result = verify_sampled(P, drafts, Q, u_acc, u_smp)
    stats = distribution_problems(result.token_ids.numpy(), p)
    assert passes(stats), stats


@pytest.mark.parametrize("broken", [always_accept, resample_from_target, accept_ten_percent_more])
def test_broken_verifiers_fail_the_same_test(broken):
    p, P, Q, drafts, u_acc, u_smp = make_case(1)
    stats = distribution_problems(broken(P, drafts, Q, u_acc, u_smp).token_ids.numpy(), p)
    assert not passes(stats), stats


def test_one_hot_drafts_preserve_the_target_distribution():
    """MTP drafts are argmax (q one-hot): acceptance p(d), residual p without d. One-hot drafts are
    accepted less often, so only the first two positions collect enough samples here."""
    p, P, Q, _, u_acc, u_smp = make_case(3)
    drafts = paddle.argmax(P[:, :K], axis=-1)  # a drafter that predicts the target's mode
    result = verify_sampled(P, drafts, None, u_acc, u_smp)
    assert passes(distribution_problems(result.token_ids.numpy(), p, positions=2, samples=50_000))


def test_greedy_verify_emits_the_target_argmax_prefix():
    target = paddle.to_tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]], dtype="int64")
    drafts = paddle.to_tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7]], dtype="int64")
    out = verify_greedy(target, drafts)
    assert out.token_ids.numpy().tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [5, -1, -1, -1]]
    assert out.num_emitted.numpy().tolist() == [4, 2, 1]


def test_mixed_batch_picks_greedy_or_sampled_per_row():
    p, P, Q, drafts, u_acc, u_smp = make_case(4)
    rows = 64
    P, drafts, u_acc, u_smp = P[:rows], drafts[:rows], u_acc[:rows], u_smp[:rows]
    target = paddle.argmax(P, axis=-1)
    temperature = paddle.to_tensor(np.tile([0.0, 1.0], rows // 2).astype(np.float32))
    mixed = verify(P, target, drafts, Q[:rows], u_acc, u_smp, temperature)
    greedy = verify_greedy(target, drafts)
    sampled = verify_sampled(P, drafts, Q[:rows], u_acc, u_smp)
    got = mixed.token_ids.numpy()
    assert (got[0::2] == greedy.token_ids.numpy()[0::2]).all()
    assert (got[1::2] == sampled.token_ids.numpy()[1::2]).all()


def test_numpy_greedy_verify_matches_the_paddle_one():
    gen = np.random.default_rng(0)
    target = gen.integers(0, 3, size=(200, 4))
    drafts = np.where(gen.random((200, 3)) < 0.7, target[:, :3], gen.integers(0, 3, size=(200, 3)))
    ref = verify_greedy(paddle.to_tensor(target), paddle.to_tensor(drafts))
    tokens, accepted = verify_greedy_numpy(target, drafts)
    assert (tokens == ref.token_ids.numpy()).all() and (accepted == ref.num_accepted.numpy()).all()


def mixed_lengths(drafts: paddle.Tensor, seed: int) -> paddle.Tensor:
    """Each row keeps its first 0..K drafts (as the speculation policy chooses per request); -1 after."""
    gen = np.random.default_rng(seed)
    keep = gen.integers(0, K + 1, drafts.shape[0])
    return paddle.to_tensor(np.where(np.arange(K)[None, :] < keep[:, None], drafts.numpy(), -1))


def test_windows_of_mixed_lengths_preserve_the_target_distribution():
    """A row that drafted fewer than K ends its window with a plain draw from p where its drafts end."""
    p, P, Q, drafts, u_acc, u_smp = make_case(4)
    result = verify_sampled(P, mixed_lengths(drafts, 4), Q, u_acc, u_smp)
    assert passes(distribution_problems(result.token_ids.numpy(), p, positions=2, samples=50_000))


def test_ending_a_short_window_with_the_residual_fails_the_same_test():
    p, P, Q, drafts, u_acc, u_smp = make_case(4)
    short = mixed_lengths(drafts, 4)
    has_draft = short >= 0
    p_d = paddle.take_along_axis(P[:, :K], paddle.clip(short, min=0).unsqueeze(-1), 2).squeeze(-1)
    q_d = paddle.take_along_axis(Q, paddle.clip(short, min=0).unsqueeze(-1), 2).squeeze(-1)
    n = accepted_prefix(accept_coins(p_d, q_d, u_acc) & has_draft)
    wrong = draw(residual(P[:, :K], Q, paddle.clip(short, min=0)), u_smp[:, :K])  # no has_draft: wrong
    result = emit(paddle.concat([wrong, draw(P[:, K], u_smp[:, K]).unsqueeze(-1)], 1), short, n)
    assert not passes(distribution_problems(result.token_ids.numpy(), p, positions=2, samples=50_000))
