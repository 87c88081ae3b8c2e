"""`mtpserve bench route`: the router's policies side by side over mixed instances (issue 18).

1. Start `--num-instances` mixed instances (`mtpserve serve`, the bundled model, `--num-kv-blocks` and
   `--serve-args`) once, and read how many KV blocks each allocated (its log) and so how many of the
   shared prefixes one instance's cache holds.
2. For each policy of `--policies` in turn: start `mtpserve router --instance URL... --policy P` on a free
   port, wait for its /health, send a few warm-up requests through it, reset every instance's prefix
   cache, scrape every instance's /metrics, run `bench serve`'s client through the router with the
   shared-prefix dataset (serve_shared_prefix.py: `--num-prefixes` system prompts of `--prefix-len`
   tokens, each request one of them at random plus its own user turn), scrape again, stop the router.
   Every policy gets the same requests in the same order.
3. Per policy: the aggregate prefix-cache hit rate (hit over queried tokens, the counters' changes summed
   over instances), TTFT p50/p99, output tok/s, the requests each instance finished and the router's
   decisions by reason; then the goals as ratios (route_report.goals). Writes JSON (`--out`); the
   processes' logs go to `--log-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import aiohttp

from mtpserve.bench import serve
from mtpserve.bench.prefix_client import BenchClient, session
from mtpserve.bench.route_launch import (ROUTER_DECISIONS, effective_engine_config, engine_kv_blocks, metrics_text,
                                         scrape, start_router)
from mtpserve.bench.route_report import (capacity, format_capacity, format_goals, format_table, goals,
                                         instance_figures, labeled, labeled_delta, policy_row)
from mtpserve.bench.serve_dataset import make_dataset
from mtpserve.bench.serve_launch import Instance, start_all, stop_all
from mtpserve.bench.serve_shared_prefix import SharedPrefixPrompt, requests_per_prefix
from mtpserve.instance import BUNDLED_MODEL

POLICIES = ("cache_aware", "round_robin", "least_loaded")
NUM_KV_BLOCKS = 144  # 9 prefixes of 1024 tokens at 64 tokens a block: the pair holds all 16, one does not
ROUTER_START_TIMEOUT_S = 120.0
WARMUP_PROMPT = "def warm_up(router):\n"  # shares no block with the dataset's prompts


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("route", help="router policies side by side over mixed instances: prefix-cache "
                              "hit rate, TTFT p50/p99, tok/s (shared system prompts)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=["cache_aware", "round_robin"])
    p.add_argument("--num-instances", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=NUM_KV_BLOCKS,
                   help="KV blocks of each instance, so that one instance cannot cache every prefix (0: the "
                   f"instance's default from --kv-cache-mb; default: {NUM_KV_BLOCKS})")
    p.add_argument("--serve-args", default="", help="flags added to every instance's `mtpserve serve`")
    p.add_argument("--router-args", default="", help="flags added to every `mtpserve router`")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat: the prefix is the system message, the turn the user message")
    p.add_argument("--num-prefixes", type=int, default=16, help="distinct shared system prompts")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens of each system prompt")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each request's own user turn")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (with ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests per policy")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight through the router")
    p.add_argument("--seed", type=int, default=0, help="chooses the texts and each request's prefix")
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL, metavar="MODEL_DIR",
                   help="cuts the texts to exact token counts (default: the bundled model's)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait before scraping /metrics (engine stats arrive every 0.5 s)")
    p.add_argument("--log-dir", type=Path, default=None, help="the instances' and routers' logs (default: a "
                   "new temporary directory)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=Path("route-bench.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mtpserve-bench-route-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    serve_args = instance_serve_args(args)
    print(f"starting {args.num_instances} instances: mtpserve serve {serve_args} (logs: {log_dir})", flush=True)
    instances = start_all([f"instance{n}={serve_args}" for n in range(args.num_instances)], log_dir)
    try:
        report = asyncio.run(measure(args, instances, log_dir))
    finally:
        stop_all(instances)
    report["serve_args"] = serve_args
    print(format_table(report["rows"]))
    print(format_capacity(report["capacity"]))
    print(format_goals(report["goals"]))
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}")
    return 0 if all(row["failed"] == 0 for row in report["rows"]) else 1


def instance_serve_args(args: argparse.Namespace) -> str:
    """Info logs as JSON (the "engine ready" line names the KV blocks), the KV size, then --serve-args."""
    blocks = f"--num-kv-blocks {args.num_kv_blocks} " if args.num_kv_blocks else ""
    return f"--log-level info --log-format json {blocks}{args.serve_args}".strip()


async def measure(args: argparse.Namespace, instances: list[Instance], log_dir: Path) -> dict:
    prompts = shared_prefix_dataset(args)
    async with session(None) as http:
        model = (await BenchClient.first_model(http, instances[0].url))[0]
        clients = [BenchClient(http, instance.url, model) for instance in instances]
        cap = await measure_capacity(args, clients[0], instances, log_dir, prompts)
        print(format_capacity(cap), flush=True)
        rows = [await run_policy(http, args, policy, clients, prompts, log_dir) for policy in args.policies]
    return {"benchmark": "route", "model": model, "config": _config(args), "router_args": args.router_args,
            "instances": [instance.url for instance in instances], "capacity": cap,
            "requests_per_prefix": requests_per_prefix(prompts), "rows": rows, "goals": goals(rows),
            "logs": str(log_dir)}


def shared_prefix_dataset(args: argparse.Namespace) -> list[SharedPrefixPrompt]:
    prompts = make_dataset(serve_namespace(args, ""))
    return [p for p in prompts if isinstance(p, SharedPrefixPrompt)]


def serve_namespace(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    """`bench serve`'s arguments for this run: the shared-prefix dataset, one level, no warm-up of its own."""
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args([
        "serve", "--base-url", base_url, "--endpoint", args.endpoint, "--dataset", "shared-prefix",
        "--num-prefixes", str(args.num_prefixes), "--prefix-len", str(args.prefix_len),
        "--input-len", str(args.user_len), "--output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency), "--seed", str(args.seed),
        "--tokenizer", str(args.tokenizer), "--warmup", "0", "--settle", str(args.settle),
        *(["--no-progress"] if args.no_progress else [])])


async def measure_capacity(args: argparse.Namespace, client: BenchClient, instances: list[Instance],
                           log_dir: Path, prompts: list[SharedPrefixPrompt]) -> dict:
    """The prefixes' token counts by the instance's own tokenizer, and the KV blocks of the smallest
    instance (its log; else the configuration's explicit block count)."""
    engine = await asyncio.to_thread(effective_engine_config, instance_serve_args(args))
    logged = [engine_kv_blocks(_read(log_dir / f"{instance.label}.log")) for instance in instances]
    known = [blocks for blocks in logged if blocks is not None]
    kv_blocks = min(known) if known else (engine.get("num_kv_blocks") or None)
    texts = {p.prefix_index: p.system for p in prompts}
    tokens = [len(await client.tokenize(text)) for _, text in sorted(texts.items())]
    return {**capacity(kv_blocks, engine.get("block_size"), tokens, args.num_prefixes, len(instances)),
            "kv_blocks_logged": logged}


async def run_policy(http: aiohttp.ClientSession, args: argparse.Namespace, policy: str,
                     clients: list[BenchClient], prompts: list[SharedPrefixPrompt], log_dir: Path) -> dict:
    """One policy's router, started and stopped around one run of the dataset from cold caches."""
    log_path = log_dir / f"router-{policy}.log"
    router = start_router([c.base_url for c in clients], policy, args.router_args, log_path)
    try:
        try:
            await asyncio.to_thread(router.wait_healthy, ROUTER_START_TIMEOUT_S)
        except RuntimeError as exc:
            raise RuntimeError(f"mtpserve router --policy {policy}: {exc}; its log: {log_path}") from exc
        row = await measure_policy(http, args, policy, clients, prompts, router.url)
    finally:
        await asyncio.to_thread(router.stop)
    print(f"{policy}: {row['requests']} requests, {row['failed']} failed in {row['duration_s']:.1f} s, "
          f"hit rate {row['hit_rate']}", flush=True)
    return row


async def measure_policy(http: aiohttp.ClientSession, args: argparse.Namespace, policy: str,
                         clients: list[BenchClient], prompts: list[SharedPrefixPrompt], router_url: str) -> dict:
    """Warm-up, reset, scrape, the run through `router_url`, scrape: the policy's row."""
    warm = BenchClient(http, router_url, clients[0].model)
    for _ in clients:
        await warm.stream("/v1/completions", {"prompt": WARMUP_PROMPT, "max_tokens": 4, "ignore_eos": True})
    resets = [await client.reset_prefix_cache() for client in clients]
    await asyncio.sleep(args.settle)
    before = [await scrape(http, c.base_url) for c in clients]
    decisions_before = labeled(await metrics_text(http, router_url), ROUTER_DECISIONS, "reason")
    summary = await serve.run_level(http, serve_namespace(args, router_url), clients[0].model, prompts,
                                    args.concurrency)
    after = [await scrape(http, c.base_url) for c in clients]
    decisions = labeled_delta(decisions_before, labeled(await metrics_text(http, router_url), ROUTER_DECISIONS,
                                                         "reason"))
    figures = [instance_figures(c.base_url, b, a) for c, b, a in zip(clients, before, after)]
    return {**policy_row(policy, summary, figures, decisions), "caches_reset": all(r is not None for r in resets)}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _config(args: argparse.Namespace) -> dict:
    keep = ("policies", "num_instances", "num_kv_blocks", "serve_args", "endpoint", "num_prefixes", "prefix_len",
            "user_len", "output_len", "num_prompts", "concurrency", "seed")
    return {**{k: getattr(args, k) for k in keep}, "tokenizer": str(args.tokenizer), "temperature": 0.0,
            "ignore_eos": True}
