"""`mtpserve bench chat`: a multi-turn chat load with prefix caching on and off, side by side (issue 16).

`--conversations` C at once, `--turns` T each, one turn after the other within a conversation. Turn t
sends the previous turn's messages, that turn's answer (as the assistant's message) and a new user
message, streamed to /v1/chat/completions (greedy, ignoring EOS, `--output-len` tokens), so each prompt
extends the last one. Every conversation opens with one shared system prompt, as chat and agent
deployments do. The text is seeded code (code_corpus.py): every configuration gets the same messages.

Per configuration, each `--launch LABEL=FLAGS` started and stopped one after the other so no two share
the CPU (or one running server, `--base-url`): 1. one warm-up request, 2. scrape /metrics, 3. run every
conversation, 4. scrape again. Reports TTFT p50/p99 over all turns and p50 per turn, output tok/s, the
hit rate from the /metrics counters and the share of prompt tokens the usage reports cached; then each
configuration's ratios to the first. Writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

from mtpserve.bench.chat_report import compare, format_table, summarize_chat
from mtpserve.bench.code_corpus import CodeCorpus
from mtpserve.bench.prefix_client import BenchClient, Reply, hit_rate, session
from mtpserve.bench.serve_launch import start_all, stop_all

LAUNCH = ("cache-on=--enable-prefix-caching true", "cache-off=--enable-prefix-caching false")
MESSAGE_OVERHEAD = 5  # template tokens around one message (ChatML: <|im_start|>role\n ... <|im_end|>\n)
TEXT_SLACK = 1.25  # code windows run past their estimated length (whole lines, characters per token)


class TooLong(Exception):
    """The conversations would outgrow the server's context."""


class ChatScript(NamedTuple):
    system: str  # shared by every conversation ("" for none)
    users: list[list[str]]  # [conversation][turn]: the user messages
    warmup: str  # the warm-up request's user message (shares no prefix with the conversations)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="multi-turn chat load, prefix caching on vs off: TTFT p50/p99, "
                              "output tok/s, hit rate")
    p.add_argument("--base-url", default=None, help="one running server instead of --launch")
    p.add_argument("--launch", nargs="+", default=list(LAUNCH), metavar="LABEL=FLAGS",
                   help="one `mtpserve serve` per entry, one after the other (default: caching on, then off)")
    p.add_argument("--serve-args", default="", help="flags added to every --launch entry")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    p.add_argument("--conversations", type=int, default=8, help="conversations at once")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-len", type=int, default=256, help="approximate tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=192, help="approximate tokens of each user message")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each turn (with ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="chooses the messages")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait before scraping /metrics (engine stats arrive every 0.5 s)")
    p.add_argument("--out", type=Path, default=Path("chat-bench.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = chat_script(args.seed, args.conversations, args.turns, args.system_len, args.user_len)
    try:
        results = ([asyncio.run(measure(args, "server", args.base_url, script))] if args.base_url
                   else [_launched(args, spec, script) for spec in args.launch])
    except TooLong as exc:
        print(f"mtpserve bench chat: {exc}")
        return 2
    comparison = compare(results)
    print(format_table(results, comparison))
    report = {"benchmark": "chat", "base_url": args.base_url, "launch": None if args.base_url else args.launch,
              "serve_args": args.serve_args, "config": _config(args), "results": results, "comparison": comparison}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}")
    return 0 if all(r["summary"]["failed"] == 0 for r in results) else 1


def _launched(args: argparse.Namespace, spec: str, script: ChatScript) -> dict:
    instances = start_all([f"{spec} {args.serve_args}".strip()])
    try:
        return asyncio.run(measure(args, instances[0].label, instances[0].url, script))
    finally:
        stop_all(instances)


def chat_script(seed: int, num_conversations: int, num_turns: int, system_len: int, user_len: int) -> ChatScript:
    corpus = CodeCorpus(seed)
    system = corpus.window(system_len) if system_len > 0 else ""
    users = [[corpus.window(user_len) for _ in range(num_turns)] for _ in range(num_conversations)]
    return ChatScript(system, users, corpus.window(user_len))


def next_messages(messages: list[dict], answer: str | None, user: str) -> list[dict]:
    """The next turn's messages: the last turn's, its answer (when there was a turn) and the user's new one."""
    said = [{"role": "assistant", "content": answer}] if answer is not None else []
    return [*messages, *said, {"role": "user", "content": user}]


def estimated_last_prompt(args: argparse.Namespace) -> int:
    """Tokens of the last turn's prompt, over-estimated: the system prompt, every user message, every
    answer but the last, and the template around each message."""
    text = args.system_len + args.turns * args.user_len
    num_messages = (args.system_len > 0) + 2 * args.turns - 1
    return round(text * TEXT_SLACK) + (args.turns - 1) * args.output_len + num_messages * MESSAGE_OVERHEAD


def check_fits(args: argparse.Namespace, max_model_len: int | None) -> None:
    need = estimated_last_prompt(args) + args.output_len
    if max_model_len is not None and need > max_model_len:
        raise TooLong(f"the last turn may need ~{need} tokens, more than the server's max_model_len "
                         f"{max_model_len}: lower --turns, --user-len, --system-len or --output-len")


async def measure(args: argparse.Namespace, label: str, base_url: str, script: ChatScript) -> dict:
    async with session(args.api_key) as http:
        model, max_model_len = await BenchClient.first_model(http, base_url)
        check_fits(args, max_model_len)
        client = BenchClient(http, base_url, args.model or model)
        await _turn(client, args, next_messages([], None, script.warmup))
        await asyncio.sleep(args.settle)
        before, start = await client.metrics(), time.perf_counter()
        runs = await asyncio.gather(*(run_conversation(client, args, n, script.system, users)
                                      for n, users in enumerate(script.users)))
        duration = time.perf_counter() - start
        await asyncio.sleep(args.settle)
        after = await client.metrics()
    samples = [s for conversation in runs for s in conversation]
    print(f"{label}: {len(samples)} turns in {duration:.1f} s", flush=True)
    return {"label": label, "base_url": base_url, "model": client.model,
            "summary": summarize_chat(samples, duration, hit_rate(before, after)), "samples": samples}


async def run_conversation(client: BenchClient, args: argparse.Namespace, conversation: int, system: str,
                           users: list[str]) -> list[dict]:
    """One conversation's turns in order; a failed turn ends it (the next prompt would lack its answer)."""
    messages = [{"role": "system", "content": system}] if system else []
    answer, samples = None, []
    for turn, user in enumerate(users):
        messages = next_messages(messages, answer, user)
        reply = await _turn(client, args, messages)
        samples.append({"conversation": conversation, "turn": turn, **reply.figures(),
                        "answer_sha1": hashlib.sha1(reply.text.encode()).hexdigest()[:16],
                        **({} if reply.ok else {"error": reply.error})})
        if not reply.ok:
            break
        answer = reply.text
    return samples


async def _turn(client: BenchClient, args: argparse.Namespace, messages: list[dict]) -> Reply:
    body = {"messages": messages, "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    return await client.stream("/v1/chat/completions", body)


def _config(args: argparse.Namespace) -> dict:
    keep = ("conversations", "turns", "system_len", "user_len", "output_len", "seed")
    return {**{k: getattr(args, k) for k in keep}, "temperature": 0.0, "ignore_eos": True,
            "estimated_last_prompt_tokens": estimated_last_prompt(args)}
