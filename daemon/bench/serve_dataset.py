"""What `mtpserve bench serve` sends: the dataset's prompts in sending order, and a request body for each."""

from __future__ import annotations

import argparse
import random
import sysconfig
from pathlib import Path

from mtpserve.bench.serve_levels import level_prompts
from mtpserve.bench.serve_shared_prefix import SharedPrefixPrompt, load_tokenizer, shared_prefix_prompts

CHARS_PER_TOKEN = 3.5  # code under a small byte-level BPE; prompt lengths are approximate
Prompt = str | SharedPrefixPrompt  # a prompt's text, or a shared prefix and a user turn (the chat's system and user)


def request_body(args: argparse.Namespace, model: str, prompt: Prompt) -> dict:
    text = prompt.text if isinstance(prompt, SharedPrefixPrompt) else prompt
    body = {"model": model, "max_tokens": _length(args.output_len, args.range_ratio, text),
            "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": not args.no_ignore_eos}
    if args.max_draft_tokens is not None:
        body["max_draft_tokens"] = args.max_draft_tokens  # mtpserve's cap on a request's drafts
    if args.endpoint == "chat":
        if args.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": args.logprobs}
        return {**body, "messages": _messages(prompt)}
    if args.logprobs is not None:
        body["logprobs"] = args.logprobs
    return {**body, "prompt": text}


def _messages(prompt: Prompt) -> list[dict]:
    if isinstance(prompt, SharedPrefixPrompt):
        return [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}]
    return [{"role": "user", "content": prompt}]


def _length(base: int, ratio: float, key: str) -> int:
    rng = random.Random(key)  # NOTE: tied to the prompt, so every level sends the same requests
    return max(1, round(base * rng.uniform(1 - ratio, 1 + ratio)))


def make_dataset(args: argparse.Namespace) -> list[Prompt]:
    """The requests' prompts, in sending order (make_prompts, or the shared-prefix dataset), enough for
    the largest level."""
    count = max(level_prompts(args, c) for c in args.concurrency)
    if args.dataset != "shared-prefix":
        return list(make_prompts(args, count))
    return list(shared_prefix_prompts(args.seed, args.num_prefixes, args.prefix_len, args.input_len,
                                      count, load_tokenizer(args.tokenizer)))


def make_prompts(args: argparse.Namespace, count: int | None = None) -> list[str]:
    rng = random.Random(args.seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    lines = [ln for f in rng.sample(files, min(40, len(files))) for ln in f.read_text(errors="replace").splitlines()]
    words = " ".join(lines).split()
    make = _code_prompt if args.dataset == "code" else _random_prompt
    return [make(rng, lines if args.dataset == "code" else words,
                 round(_length(args.input_len, args.range_ratio, str(i)) * CHARS_PER_TOKEN))
            for i in range(args.num_prompts if count is None else count)]


def _code_prompt(rng: random.Random, lines: list[str], num_chars: int) -> str:
    start, out, size = rng.randrange(len(lines)), [], 0
    for line in lines[start:] + lines[:start]:
        out.append(line)
        size += len(line) + 1
        if size >= num_chars:
            break
    return "\n".join(out) + "\n"


def _random_prompt(rng: random.Random, words: list[str], num_chars: int) -> str:
    out, size = [], 0
    while size < num_chars:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out)
