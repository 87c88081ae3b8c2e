"""Which of a prompt's positions the MTP depths run over: its last `window` positions, from a block start.

A prompt chunk runs every MTP depth of its step over its positions, to write each depth's KV there for the
drafts that later attend over it. Over a whole prompt that is most of what a depth costs a prompt: four
256-token prompts took 1.28-1.39x, 1.69-1.76x and 2.08-2.10x k=0's time at depths 1, 2 and 3 on the bundled
model (scripts/prefill_by_depth.py). But a draft reads the prompt mostly through the main model's hidden
state, which has seen all of it: on 16 windows of standard-library code (256-token prompts, the next 128
positions teacher-forced), the drafts that matched the main model's next greedy token went from 0.682 with
the whole prompt's MTP KV to 0.678 with its last 64 positions, 0.671 with 16 and 0.662 with the last position
alone at depth 1 (0.665, 0.659, 0.648, 0.638 at depth 2). So the depths run over a prompt's last positions
only, and the keys before them are hidden from every draft of the request (the attention's key start):
never stale keys, only fewer.

From a block start because the prefix cache keeps whole blocks: a cached block holds a depth's KV or not.
"""

from __future__ import annotations


def key_start(num_tokens: int, window: int, block_size: int) -> int:
    """The first position whose MTP KV a request's drafts read, for a prefill of `num_tokens` positions (its
    prompt, plus outputs it recomputes after a preemption): the block start at or before its last `window`
    positions; 0 (the whole prompt) for a window of 0."""
    if window <= 0:
        return 0
    return max(num_tokens - window, 0) // block_size * block_size
