"""`mtpserve bench serve`: a load generator for any OpenAI-compatible server (ours, vLLM, SGLang).

For each concurrency level: 1. scrape /metrics, 2. send `--num-prompts` streamed requests, Poisson
arrivals at `--request-rate` (inf: all at once) with at most `concurrency` in flight, 3. scrape
/metrics again. Reports TTFT, TPOT, ITL, E2E percentiles, request and token throughput, and the
mean acceptance length from the spec-decode counter deltas (vLLM's names, which mtpserve exports).
Writes JSON (`--out`) and PNG plots (`--plot-dir`, needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from mtpserve.bench.serve_client import RequestResult, reset_prefix_cache, send_request
from mtpserve.bench.serve_dataset import Prompt, make_dataset, request_body
from mtpserve.bench.serve_launch import Instance, comparison, format_comparison, start_all, stop_all
from mtpserve.bench.serve_levels import check_levels, level_prompts, slice_prompts, step_part
from mtpserve.bench.serve_report import (PREFIX_COUNTERS, acceptance, format_run, parse_chosen_drafts, parse_counters,
                                         plot, plot_compare, plot_launched, prefix_hit_rate, summarize)
from mtpserve.bench.serve_step_load import format_step_load, step_load
from mtpserve.instance import BUNDLED_MODEL


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server: latency, throughput, "
                              "acceptance length")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--dataset", choices=("code", "random", "shared-prefix"), default="code",
                   help="code: windows of Python standard-library sources (the bundled model's domain); "
                   "random: random words from that corpus; shared-prefix: --num-prefixes system prompts, each "
                   "request one of them at random plus its own user turn of --input-len tokens "
                   "(serve_shared_prefix.py)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompts-per-stream", type=int, default=0,
                   help="each level sends at least this many prompts per stream (with 96 prompts, a level of 64 "
                   "streams is over in seconds, and its ramp and tail weigh as much as its steady state)")
    p.add_argument("--level-prompts", type=int, nargs="+", default=None, metavar="N",
                   help="prompts of each level, one per --concurrency (instead of --num-prompts and "
                   "--prompts-per-stream): visits of about equal length at every level, e.g. 64 160 640 1280 for "
                   "1 4 16 64 streams")
    p.add_argument("--input-len", type=int, default=128, help="approximate prompt tokens (shared-prefix: the "
                   "user turn's)")
    p.add_argument("--num-prefixes", type=int, default=16, help="shared-prefix: distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each system prompt")
    p.add_argument("--tokenizer", type=Path, default=BUNDLED_MODEL, metavar="MODEL_DIR",
                   help="shared-prefix: cut texts to exact token counts with this directory's tokenizer.json "
                   "(default: the bundled model's; a directory without one: lengths estimated)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: burst")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None,
                   help="ask for the sampled token's logprob and this many top logprobs per token")
    p.add_argument("--max-draft-tokens", type=int, default=None,
                   help="send mtpserve's per-request draft cap (0: no drafting for these requests)")
    p.add_argument("--no-keepalive", action="store_true",
                   help="a new connection per request (servers that drop kept-alive connections)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent before each level, not measured")
    p.add_argument("--keep-prefix-cache", dest="reset_prefix_cache", action="store_false",
                   help="do not empty the server's prefix cache before each level (by default each visit "
                   "starts with POST /reset_prefix_cache where the server has it, as SGLang's bench flushes "
                   "its cache: every level sends the same first prompts)")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds to wait before scraping /metrics (engine stats arrive periodically)")
    p.add_argument("--out", type=Path, default=Path("serve-bench.json"))
    p.add_argument("--plot-dir", type=Path, default=None, help="PNG plots here (default: next to --out)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compare", type=Path, nargs="+", default=None, metavar="JSON",
                   help="do not run: plot these earlier --out files side by side (label = file stem) into "
                   "serve-compare.png in --plot-dir")
    p.add_argument("--server-pid", type=int, default=None,
                   help="also report this local process's CPU time per streamed token (Linux /proc)")
    _add_side_by_side(p)
    p.set_defaults(func=run)


def _add_side_by_side(p: argparse.ArgumentParser) -> None:
    """The options of --launch: instances started here and compared side by side, by levels or a step load."""
    p.add_argument("--launch", nargs="+", default=None, metavar="LABEL=FLAGS",
                   help="start one `mtpserve serve` per entry with these flags (instead of --base-url) and "
                   "visit them in turn at every level, e.g. 'k0=--num-speculative-tokens 0' "
                   "'adaptive=--num-speculative-tokens 3'; prints each one's throughput ratios. Leading "
                   "NAME=VALUE words set that instance's environment, e.g. 'old=PYTHONPATH=/tmp/old "
                   "--num-speculative-tokens 3'")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --launch: visit every instance this many times per level; the comparison takes "
                   "each one's median output tok/s (the machine's drift lands on every configuration)")
    p.add_argument("--slices", type=int, default=1,
                   help="with --launch: split each level's prompts into this many slices and visit every "
                   "instance with each slice in turn; each slice visit counts as a round of its own in the "
                   "comparison (the host's drift over a visit of ~15 s lands on the instances alike). With "
                   "--step-load: split --duration into this many parts of whole LOW and HIGH phase pairs")
    p.add_argument("--relaunch", action="store_true",
                   help="with --launch: start the instances afresh for every round (identical instances differ "
                   "by a few %% for as long as they live; see serve.py _launches)")
    p.add_argument("--step-load", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="instead of levels: streams alternate between LOW and HIGH every --step-period "
                   "seconds for --duration seconds (serve_step_load.py)")
    p.add_argument("--step-period", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=120.0)


def run(args: argparse.Namespace) -> int:
    check_levels(args)
    if args.compare:
        reports = {path.stem: json.loads(path.read_text()) for path in args.compare}
        print(f"plot: {plot_compare(reports, (args.plot_dir or Path('.')) / 'serve-compare.png')}")
        return 0
    report = asyncio.run(run_launched(args) if args.launch else run_all(args))
    args.out.write_text(json.dumps(report, indent=2))
    print(f"JSON: {args.out}")
    for path in report["plots"]:
        print(f"plot: {path}")
    return 0 if all(r["summary"]["failed"] == 0 for r in report["runs"]) else 1


async def run_launched(args: argparse.Namespace) -> dict:
    """Every --launch instance up at once; each level (or the step load) visits them in turn. With
    --relaunch, every round has instances of its own."""
    labels = [spec.partition("=")[0] for spec in args.launch]
    runs: list[dict] = []
    visits: dict[int, dict[str, list[dict]]] = {}  # level (the step load: its HIGH) -> label -> summaries
    model = args.model
    for rounds in _launches(args):
        instances = start_all(args.launch)
        try:
            async with _session(args) as session:
                model = model or await _first_model(session, instances[0].url)
                await _visit_all(session, args, model, instances, rounds, runs, visits)
        finally:
            stop_all(instances)
    table = comparison(visits, labels)
    print(format_comparison(table), flush=True)
    if args.step_load:
        return {"benchmark": "serve-step-load", "launch": args.launch, "model": model, "config": _config(args),
                "runs": runs, "comparison": table, "plots": []}
    plot_path = plot_launched(table, (args.plot_dir or args.out.parent) / f"{args.out.stem}-launched.png")
    return {"benchmark": "serve", "launch": args.launch, "model": model, "config": _config(args), "runs": runs,
            "comparison": table, "plots": [plot_path] if plot_path else []}


def _launches(args: argparse.Namespace) -> list[range]:
    """The rounds each launch of the instances serves: all of them, or one each with --relaunch.

    NOTE: identical instances launched side by side differ by a few % for as long as they live (four
    k=2 instances at one stream: 0.94-1.03 of the best other over four rounds; one was faster than its
    round's mean in all four, another slower in all four, by ~3% each): where a process's memory lands
    decides how well the bundled model's 24 MB stay in this host's 32 MB cache. One launch per round
    makes that a draw per round, which the rounds' medians average."""
    return [range(r, r + 1) for r in range(args.rounds)] if args.relaunch else [range(args.rounds)]


async def _visit_all(session: aiohttp.ClientSession, args: argparse.Namespace, model: str,
                     instances: list[Instance], rounds: range, runs: list[dict],
                     visits: dict[int, dict[str, list[dict]]]) -> None:
    """These rounds of every level (or of the step load), each visiting every instance in turn; appends
    to `runs` and `visits`."""
    prompts = None if args.step_load else make_dataset(args)
    levels = [args.step_load[1]] if args.step_load else args.concurrency
    slices = args.slices
    for (index, concurrency), round_, part in [(c, r, s) for c in enumerate(levels) for r in rounds
                                               for s in range(slices)]:
        # NOTE: each round (slice) of a level starts with the next instance, so no configuration always goes
        # first at a level. Turned by the visits so far, two instances at two or four levels were aliased: k0
        # went first at every round at one and 16 streams, adaptive at four and 64.
        turn = round_ * slices + part + index
        name = f"round {round_ + 1}" + (f" slice {part + 1}" if slices > 1 else "")
        for instance in instances[turn % len(instances):] + instances[:turn % len(instances)]:
            if prompts is None:
                summary = await _step_load(session, _at(args, instance.url), model, part)
                print(format_step_load(f"{instance.label} {name}", summary), flush=True)
            else:
                mine = slice_prompts(prompts[:level_prompts(args, concurrency)], slices, part)
                summary = await run_level(session, _at(args, instance.url), model, mine, concurrency)
                print(format_run(f"{instance.label} concurrency {concurrency} {name}", summary), flush=True)
            runs.append({"label": instance.label, **({} if prompts is None else {"concurrency": concurrency}),
                         "round": round_ + 1, **({"slice": part + 1} if slices > 1 else {}), "summary": summary})
            visits.setdefault(concurrency, {}).setdefault(instance.label, []).append(summary)


async def _step_load(session: aiohttp.ClientSession, args: argparse.Namespace, model: str, part: int = 0) -> dict:
    """The step load against one server: --duration seconds, or with --slices its part `part` of them."""
    low, high = args.step_load
    bodies = [request_body(args, model, p) for p in step_part(make_dataset(args), args.slices, part)]
    if args.reset_prefix_cache:
        await reset_prefix_cache(session, args.base_url)
    return await step_load(session, _url(args), bodies, low, high, args.step_period, args.duration / args.slices)


def _at(args: argparse.Namespace, url: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "base_url": url})


def _session(args: argparse.Namespace) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # NOTE: llama.cpp's server closes a kept-alive connection after a few requests, racing the client's
    # next write on it ("Can not write request body"); --no-keepalive opens a connection per request
    connector = aiohttp.TCPConnector(limit=0, force_close=args.no_keepalive)
    return aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)


async def run_all(args: argparse.Namespace) -> dict:
    async with _session(args) as session:
        model = args.model or await _first_model(session, args.base_url)
        if args.step_load:
            report = await _step_load(session, args, model)
            print(format_step_load(args.base_url, report), flush=True)
            return {"benchmark": "serve-step-load", "base_url": args.base_url, "model": model,
                    "config": _config(args), "runs": [{"label": args.base_url, "summary": report}], "plots": []}
        prompts = make_dataset(args)
        runs = []
        for concurrency in args.concurrency:
            summary = await run_level(session, args, model, prompts, concurrency)
            print(format_run(f"concurrency {concurrency}", summary), flush=True)
            runs.append({"concurrency": concurrency, "summary": summary})
    plots = plot(runs, args.plot_dir or args.out.resolve().parent)
    return {"benchmark": "serve", "base_url": args.base_url, "model": model, "config": _config(args),
            "runs": runs, "plots": plots}


def _config(args: argparse.Namespace) -> dict:
    keep = ("endpoint", "dataset", "num_prompts", "prompts_per_stream", "level_prompts", "input_len", "output_len",
            "range_ratio", "concurrency", "request_rate", "temperature", "no_ignore_eos", "seed", "logprobs",
            "step_load", "step_period", "duration")
    shared = ("num_prefixes", "prefix_len") if args.dataset == "shared-prefix" else ()
    return {k: getattr(args, k) for k in (*keep, *shared)}


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run_level(session: aiohttp.ClientSession, args: argparse.Namespace, model: str,
                    prompts: Sequence[Prompt], concurrency: int) -> dict:
    url, bodies = _url(args), [request_body(args, model, p) for p in prompts[:level_prompts(args, concurrency)]]
    if getattr(args, "reset_prefix_cache", False):  # NOTE: peer and router benches pass their own namespaces
        await reset_prefix_cache(session, args.base_url)
    await asyncio.gather(*(send_request(session, url, b) for b in bodies[:args.warmup]))
    await asyncio.sleep(args.settle)
    before, cpu_before = await _scrape(session, args.base_url), process_cpu_s(args.server_pid)
    start = time.perf_counter()
    results = await _drive(session, url, bodies, concurrency, args)
    duration = time.perf_counter() - start
    cpu = process_cpu_s(args.server_pid) - cpu_before
    await asyncio.sleep(args.settle)
    after = await _scrape(session, args.base_url)
    summary = summarize(results, duration, {**acceptance(before, after), **_per_request_spec(results)})
    summary["prefix_cache_hit_rate"] = prefix_hit_rate(before, after)
    if args.server_pid is not None:
        summary["server_cpu_s"] = cpu
        summary["server_cpu_us_per_token"] = 1e6 * cpu / max(summary["total_output_tokens"], 1)
    return summary


def process_cpu_s(pid: int | None) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (0 without a pid)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(session: aiohttp.ClientSession, url: str, bodies: list[dict], concurrency: int,
                 args: argparse.Namespace) -> list[RequestResult]:
    limit, rng = asyncio.Semaphore(concurrency), random.Random(args.seed)
    bar = _progress(len(bodies), args.no_progress, concurrency)

    async def one(body: dict) -> RequestResult:
        async with limit:
            result = await send_request(session, url, body)
        bar.update(1)
        return result

    tasks = []
    for body in bodies:
        tasks.append(asyncio.create_task(one(body)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    bar.close()
    return results


def _progress(total: int, disabled: bool, concurrency: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"c={concurrency}", disable=disabled or not sys.stderr.isatty(), leave=False)


async def _scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            text = await resp.text()
            if resp.status != 200:
                return {}
            return parse_counters(text) | parse_counters(text, PREFIX_COUNTERS) | parse_chosen_drafts(text)
    except aiohttp.ClientError:
        return {}


def _per_request_spec(results: list[RequestResult]) -> dict:
    """mtpserve's usage.spec_decode extension, pooled over requests (absent on other servers)."""
    stats = [r.spec_decode for r in results if r.ok and r.spec_decode]
    steps = sum(s["num_decode_steps"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    return {"per_request_acceptance_length": 1.0 + accepted / steps if steps else None}


def _url(args: argparse.Namespace) -> str:
    return f"{args.base_url}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
