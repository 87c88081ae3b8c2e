"""Usage objects in OpenAI's shape (`prompt_tokens_details.cached_tokens`: prompt tokens served from the
prefix cache), with per-request speculative-decoding statistics in the `spec_decode` extension.

Acceptance is inferred from the outputs themselves: the first output of a request comes from
prefill (one token, no drafts); every later output is one decode step that emitted its accepted
drafts plus one bonus token. So accepted = generated - 1 - decode_steps.
"""

from __future__ import annotations

from mtpserve.server.tracker import RequestStream


def usage(stream: RequestStream, num_speculative_tokens: int) -> dict[str, object]:
    prompt_tokens = sum(stream.num_prompt_tokens)
    completion_tokens = sum(c.num_tokens for c in stream.choices)
    out: dict[str, object] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_prompt_tokens(stream)}}
    if num_speculative_tokens > 0:
        out["spec_decode"] = spec_decode_stats(stream, num_speculative_tokens)
    return out


def cached_prompt_tokens(stream: RequestStream) -> int:
    """Counted once per prompt, as prompt_tokens is. NOTE: a prompt's n samples are n engine requests
    that may find different amounts cached (a later one can hit the blocks an earlier one computed);
    the prompt's cached tokens are those none of them computed, the fewest any found, so cached_tokens
    never exceeds prompt_tokens."""
    n = len(stream.choices) // len(stream.prompts)  # choices are ordered prompt by prompt, n each
    return sum(min(c.num_cached_tokens for c in stream.choices[p * n:(p + 1) * n])
               for p in range(len(stream.prompts)))


def spec_decode_stats(stream: RequestStream, num_speculative_tokens: int) -> dict:
    decode_steps = sum(max(c.num_steps - 1, 0) for c in stream.choices)
    accepted = sum(max(c.num_generated - 1 - max(c.num_steps - 1, 0), 0) for c in stream.choices)
    return {
        "num_decode_steps": decode_steps,
        "num_draft_tokens": decode_steps * num_speculative_tokens,
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": round(1.0 + accepted / decode_steps, 4) if decode_steps else None,
    }
