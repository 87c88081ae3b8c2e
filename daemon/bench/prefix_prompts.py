"""The prompts of `bench prefix`: token ids of exact lengths, from seeded code text.

For each shared-prefix length L and repetition r (negative r: a warm-up case, not measured):
  - the prefix P is L tokens; its text starts with a tag naming (seed, L, r), so no two cases share a
    first block and no case can hit what another one cached;
  - the suffixes A and B are `suffix_len` tokens each; A's text starts with `x`, B's with `y`, so their
    first tokens differ: P+A and P+B share exactly P.
The miss sends P+A (P never seen), the hit P+B. Token ids are sent as the prompt, so lengths and block
boundaries are exact whatever the tokenizer does at the seams.
"""

from __future__ import annotations

from typing import NamedTuple

from mtpserve.bench.code_corpus import CodeCorpus

SUFFIX_HEADS = ("x = 1\n", "y = 2\n")  # distinct first characters: distinct first tokens
TEXT_MARGIN = 2.0  # text drawn per wanted token, in estimated tokens: the tokenizer never comes up short


class PrefixCase(NamedTuple):
    length: int  # shared prefix tokens
    repeat: int  # < 0: a warm-up
    prefix_text: str
    suffix_texts: tuple[str, str]  # A, B


class PrefixPrompt(NamedTuple):
    length: int
    repeat: int
    miss_ids: list[int]  # P + A
    hit_ids: list[int]  # P + B


def prefix_cases(seed: int, lengths: list[int], repeats: int, suffix_len: int, num_warmup: int = 1
                 ) -> list[PrefixCase]:
    """Per length, `num_warmup` warm-up cases then `repeats` measured ones, all from one seeded corpus."""
    corpus = CodeCorpus(seed)
    cases = []
    for length in lengths:
        for repeat in range(-num_warmup, repeats):
            tag = f"# {seed}.{length}.{repeat}: a shared prefix\n"
            suffixes = (SUFFIX_HEADS[0] + corpus.window(suffix_len * TEXT_MARGIN),
                        SUFFIX_HEADS[1] + corpus.window(suffix_len * TEXT_MARGIN))
            cases.append(PrefixCase(length, repeat, tag + corpus.window(length * TEXT_MARGIN), suffixes))
    return cases


def exact_prompt(case: PrefixCase, prefix_ids: list[int], suffix_ids: tuple[list[int], list[int]],
                 suffix_len: int) -> PrefixPrompt:
    """The case's tokenized texts cut to their lengths."""
    prefix = _cut(prefix_ids, case.length, "prefix")
    a, b = (_cut(ids, suffix_len, "suffix") for ids in suffix_ids)
    if a[0] == b[0]:
        raise ValueError("the two suffixes start with the same token: the hit would share more than the prefix")
    return PrefixPrompt(case.length, case.repeat, prefix + a, prefix + b)


def _cut(ids: list[int], length: int, what: str) -> list[int]:
    if len(ids) < length:
        raise ValueError(f"the {what} text has {len(ids)} tokens, fewer than the {length} wanted")
    return ids[:length]
