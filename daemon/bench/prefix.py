"""`mtpserve bench prefix`: what automatic prefix caching buys, per shared-prefix length (issue 16).

Against one server (`--base-url`, or one `mtpserve serve --serve-args ...` it starts and stops), for
each prefix length (512, 1024 and 2048 tokens by default), one request at a time, greedy, ignoring EOS:
  1. warm-up: one case (below), not measured; wait for the engine's stats; scrape /metrics;
  2. per repetition: the miss P+A (P a prefix never sent), the hit P+B (the same P, another suffix;
     prefix_prompts.py), and, when the server has POST /reset_prefix_cache, a reset and P+B again
     (`miss_reset`: the hit's own prompt computed cold; its output and acceptance must equal the hit's,
     and the miss figures are taken from these, so a hit is compared with its own prompt);
  3. wait for the engine's stats; scrape /metrics: the length's hit rate from the counter deltas.
Prints medians per length (TTFT, decode tok/s and acceptance length on a miss and on a hit), the goals as
measured ratios (TTFT miss/hit on the longest prefix, acceptance hit/miss), and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from mtpserve.bench.prefix_client import BenchClient, Reply, hit_rate, session
from mtpserve.bench.prefix_prompts import PrefixCase, PrefixPrompt, exact_prompt, prefix_cases
from mtpserve.bench.prefix_report import format_goals, format_table, goals, summarize_length
from mtpserve.bench.serve_launch import start_all, stop_all

LENGTHS = (512, 1024, 2048)
SERVE_ARGS = "--num-speculative-tokens 2 --speculative-adaptive false"  # acceptance at a fixed k=2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefix", help="prefix caching: TTFT, decode tok/s and acceptance on a hit vs a "
                              "miss, and the hit rate, per shared-prefix length")
    p.add_argument("--base-url", default=None, help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", default=SERVE_ARGS, help="flags of the `mtpserve serve` started without "
                   f"--base-url (default: '{SERVE_ARGS}')")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (the reset endpoint needs it)")
    p.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="shared prefix lengths, tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="tokens after the shared prefix")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (with ignore_eos)")
    p.add_argument("--repeats", type=int, default=5, help="cases per length; figures are their medians")
    p.add_argument("--seed", type=int, default=0, help="chooses the prompt text")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait before scraping /metrics (engine stats arrive every 0.5 s)")
    p.add_argument("--out", type=Path, default=Path("prefix-bench.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    instances = [] if args.base_url else start_all([f"prefix={args.serve_args}"])
    try:
        report = asyncio.run(measure(args, args.base_url or instances[0].url))
    finally:
        stop_all(instances)
    print(format_table(report["rows"]))
    print(format_goals(report["goals"]))
    print(f"hit rate over the measured requests: {_fmt(report['hit_rate']['hit_rate'])}; "
          f"cached blocks at the end: {_fmt(report['cache_blocks'], 0)}")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}")
    return 0 if all(row["failed"] == 0 for row in report["rows"]) else 1


async def measure(args: argparse.Namespace, base_url: str) -> dict:
    async with session(args.api_key) as http:
        model = args.model or (await BenchClient.first_model(http, base_url))[0]
        client = BenchClient(http, base_url, model)
        can_reset = await client.reset_prefix_cache() is not None  # NOTE: also starts from an empty cache
        cases = prefix_cases(args.seed, args.lengths, args.repeats, args.suffix_len)
        rows, samples = [], []
        for length in args.lengths:
            prompts = [await _tokenized(client, case, args.suffix_len) for case in cases if case.length == length]
            row, measured = await measure_length(client, args, prompts, can_reset)
            print(f"prefix {length}: {row['requests']} requests, {row['failed']} failed", flush=True)
            rows.append(row)
            samples += measured
        end = await client.metrics()
    return {"benchmark": "prefix", "base_url": args.base_url, "launch": None if args.base_url else args.serve_args,
            "model": model, "config": _config(args), "reset_available": can_reset, "rows": rows,
            "goals": goals(rows), "hit_rate": _overall(rows), "cache_blocks": end["mtpserve:prefix_cache_blocks"],
            "samples": samples}


async def measure_length(client: BenchClient, args: argparse.Namespace, prompts: list[PrefixPrompt],
                         can_reset: bool) -> tuple[dict, list[dict]]:
    """Warm-ups, then the measured cases between two scrapes of /metrics."""
    for prompt in (p for p in prompts if p.repeat < 0):
        await run_case(client, args, prompt, can_reset)
    await asyncio.sleep(args.settle)
    before = await client.metrics()
    samples = [s for p in prompts if p.repeat >= 0 for s in await run_case(client, args, p, can_reset)]
    await asyncio.sleep(args.settle)
    after = await client.metrics()
    return summarize_length(prompts[0].length, samples, hit_rate(before, after)), samples


async def run_case(client: BenchClient, args: argparse.Namespace, prompt: PrefixPrompt, can_reset: bool
                   ) -> list[dict]:
    """miss, hit and (with a reset endpoint) the hit's prompt again, cold: one sample each."""
    miss = await _complete(client, args, prompt.miss_ids)
    hit = await _complete(client, args, prompt.hit_ids)
    samples = [_sample(prompt, "miss", len(prompt.miss_ids), miss), _sample(prompt, "hit", len(prompt.hit_ids), hit)]
    if can_reset and await client.reset_prefix_cache() is not None:
        cold = await _complete(client, args, prompt.hit_ids)
        same = {"output": cold.text == hit.text,
                "acceptance": cold.usage.get("spec_decode") == hit.usage.get("spec_decode")}
        samples.append({**_sample(prompt, "miss_reset", len(prompt.hit_ids), cold), "same_as_hit": same})
    return samples


async def _tokenized(client: BenchClient, case: PrefixCase, suffix_len: int) -> PrefixPrompt:
    prefix_ids = await client.tokenize(case.prefix_text)
    a, b = [await client.tokenize(text) for text in case.suffix_texts]
    return exact_prompt(case, prefix_ids, (a, b), suffix_len)


async def _complete(client: BenchClient, args: argparse.Namespace, ids: list[int]) -> Reply:
    body = {"prompt": ids, "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    return await client.stream("/v1/completions", body)


def _sample(prompt: PrefixPrompt, kind: str, num_sent: int, reply: Reply) -> dict:
    return {"prefix_tokens": prompt.length, "repeat": prompt.repeat, "kind": kind, "prompt_tokens_sent": num_sent,
            **reply.figures(), **({} if reply.ok else {"error": reply.error})}


def _overall(rows: list[dict]) -> dict:
    """The rows' counter deltas added up (None when any row's is unknown)."""
    queried, hits = (None if any(r[k] is None for r in rows) else sum(r[k] for r in rows)
                     for k in ("queried_tokens", "hit_tokens"))
    return {"queried_tokens": queried, "hit_tokens": hits,
            "hit_rate": hits / queried if queried and hits is not None else None}


def _config(args: argparse.Namespace) -> dict:
    keep = ("lengths", "suffix_len", "output_len", "repeats", "seed")
    return {**{k: getattr(args, k) for k in keep}, "temperature": 0.0, "ignore_eos": True}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "unknown" if value is None else f"{value:.{digits}f}"
