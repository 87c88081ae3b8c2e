"""How one request turns logits into tokens: the one definition, shared by the HTTP process (which
builds it from a validated body), the request channel (which carries it) and the engine (which runs it).
"""

from __future__ import annotations

import msgspec

MAX_TOP_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling (n is fanned out by the HTTP process). Immutable once admitted.

    NOTE: `temperature == 0` means greedy; `top_k <= 0` and `top_p == 1` turn those filters off;
    `seed is None` means the engine draws one at admission, so every row samples through the same
    seeded path and a request's randomness never depends on its batch neighbours.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # in [0, 2**64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the sampled token's logprob plus the top n (<= 20)
    max_draft_tokens: int | None = None  # a cap on the drafts of each window; 0: no drafting; None: the engine's

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_problems(p: SamplingParams) -> list[str]:
    """What is wrong with `p`, one sentence each. The HTTP process answers 400 field by field before
    building it; rank 0 checks again at intake (RequestFailed), because a malformed struct would
    otherwise reach the device."""
    checks = [
        (p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (-2.0 <= p.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
        (-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
        (p.max_tokens >= 1, f"max_tokens must be >= 1, got {p.max_tokens}"),
        (0 <= p.min_tokens <= p.max_tokens, "min_tokens must be in [0, max_tokens]"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_TOP_LOGPROBS,
         f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]"),
        (p.seed is None or 0 <= p.seed < 2**64, "seed must be in [0, 2**64)"),
        (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids must be >= 0"),
        (p.max_draft_tokens is None or p.max_draft_tokens >= 0, "max_draft_tokens must be >= 0"),
    ]
    return [message for ok, message in checks if not ok]
