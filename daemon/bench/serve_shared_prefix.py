"""`bench serve --dataset shared-prefix`: a few long system prompts, each followed by many distinct user
turns (issue 18: what cache-aware routing is for).

`--num-prefixes` N prefixes of `--prefix-len` tokens and `--num-prompts` requests. Each request picks
one prefix at random (seeded), so the prefixes interleave: round robin sends every prefix to every
instance, and only a router that follows the prefixes keeps each one on one instance. Each request's
user turn is its own (`--input-len` tokens). Every text starts with a tag naming it, so no two prefixes
share a first block and no user turn repeats another's.

With a tokenizer (a model directory's tokenizer.json) the prefixes and user turns are cut to their exact
token counts; without one their lengths are estimated from characters, as the other datasets' are.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from mtpserve.bench.code_corpus import CodeCorpus

TEXT_MARGIN = 2.0  # text drawn per wanted token when cutting exactly: the tokenizer never comes up short


class SharedPrefixPrompt(NamedTuple):
    prefix_index: int  # which of the shared prefixes
    system: str  # the shared prefix: the chat endpoint's system message
    user: str  # this request's own turn

    @property
    def text(self) -> str:
        """The completions endpoint's prompt: the prefix, then the turn."""
        return self.system + self.user


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def shared_prefix_prompts(seed: int, num_prefixes: int, prefix_len: int, user_len: int, num_requests: int,
                          tokenizer: TextTokenizer | None = None) -> list[SharedPrefixPrompt]:
    """`num_requests` prompts in sending order; the same arguments give the same prompts."""
    if num_prefixes < 1 or prefix_len < 1 or user_len < 1:
        raise ValueError("the shared-prefix dataset needs at least one prefix and lengths of at least one token")
    from mtpserve.bench.code_corpus import CodeCorpus  # NOTE: here, as code_corpus imports serve, which imports us

    corpus, rng = CodeCorpus(seed), random.Random(seed)
    prefixes = [_text(corpus, f"# system prompt {n} of {num_prefixes} (seed {seed})\n", prefix_len, tokenizer)
                for n in range(num_prefixes)]
    choices = [rng.randrange(num_prefixes) for _ in range(num_requests)]
    return [SharedPrefixPrompt(p, prefixes[p], _text(corpus, f"\n# user turn {n}\n", user_len, tokenizer))
            for n, p in enumerate(choices)]


def requests_per_prefix(prompts: list[SharedPrefixPrompt]) -> list[int]:
    """How many requests each prefix gets, by prefix index (0 for a prefix no request picked)."""
    counts = Counter(p.prefix_index for p in prompts)
    return [counts[n] for n in range(max(counts, default=-1) + 1)]


def load_tokenizer(model_dir: Path | None) -> TextTokenizer | None:
    """The tokenizer of `model_dir` (None when there is none, or no directory was given)."""
    if model_dir is None or not (model_dir / "tokenizer.json").exists():
        return None
    from mtpserve.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(model_dir)


def _text(corpus: CodeCorpus, tag: str, num_tokens: int, tokenizer: TextTokenizer | None) -> str:
    """`tag` and code, about `num_tokens` tokens; exactly that many by `tokenizer` when there is one."""
    if tokenizer is None:
        return tag + corpus.window(num_tokens)
    ids = tokenizer.encode(tag + corpus.window(num_tokens * TEXT_MARGIN), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"a text of {len(ids)} tokens is shorter than the {num_tokens} wanted")
    return tokenizer.decode(ids[:num_tokens], skip_special_tokens=False)
