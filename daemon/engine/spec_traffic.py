"""What the recent traffic looks like to the speculation policy: how many prompt tokens come with each token
emitted, and how large a step's prompt chunk is. Both price the prompts' share of a step (speculation.py).

NOTE: running means that start at their first sample: one starting at 0 charged the first requests'
prompts at ~10x a prompt token's cost (a 256-token chunk counted as 13).
"""

from __future__ import annotations

LOAD_WEIGHT = 0.05  # of a step in the running mean of its prompt chunk: the last ~20 steps
REQUEST_WEIGHT = 0.05  # of a finished request in the traffic's prompt/output means: the last ~20


class Traffic:
    def __init__(self) -> None:
        self._prompt_tokens = 0.0  # prompt tokens a finished request had prefilled, recently
        self._output_tokens = 0.0  # tokens a finished request emitted, recently
        self._num_finished = 0
        self.chunk_tokens = 0.0  # prompt tokens of a step that prefilled, recently
        self.chunk_prefix = 0.0  # its (query, key) pairs over its prompts' earlier positions (StepLoad.prefix)
        self._num_chunks = 0

    def observe_finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request: the prompt tokens it prefilled and the tokens it emitted."""
        self._num_finished += 1
        weight = max(1.0 / self._num_finished, REQUEST_WEIGHT)
        self._prompt_tokens += weight * (prompt_tokens - self._prompt_tokens)
        self._output_tokens += weight * (output_tokens - self._output_tokens)

    def observe_chunk(self, prompt_tokens: int, prefix: int = 0) -> None:
        """A step with `prompt_tokens` (> 0) of prompts in it, and `prefix` pairs of them over their prompts'
        earlier positions.

        NOTE: the policy plans for the load, not for this step's chunk, so one large prompt does not flip the
        depth, and leave gaps, for a step."""
        self._num_chunks += 1
        weight = max(1.0 / self._num_chunks, LOAD_WEIGHT)
        self.chunk_tokens += weight * (prompt_tokens - self.chunk_tokens)
        self.chunk_prefix += weight * (prefix - self.chunk_prefix)

    def prefill_per_token(self) -> float:
        """Prompt tokens prefilled per token emitted, over recently finished requests.

        NOTE: a property of the traffic, not of the moment: counted per step it would be huge while a
        burst of prompts is prefilled, and the policy would stop drafting just when those prompts' MTP
        KV is written (a prompt prefilled without it drafts poorly all its life)."""
        return self._prompt_tokens / max(self._output_tokens, 1.0)
