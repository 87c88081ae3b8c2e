"""`mtpserve bench route`: the shared-prefix dataset (seeded, exact lengths, interleaved prefixes), the
request bodies it makes, the figures (aggregate hit rate, goals, KV capacity), what it reads from logs and
/metrics; one policy's run against stand-in instances with a small prefix cache; and once the whole
command with real instances and the router."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from daemon_harness import BUNDLED, model_available
from mtpserve.bench import route, serve, serve_dataset
from mtpserve.bench.prefix_client import BenchClient, HITS, QUERIES, session
from mtpserve.bench.route_launch import ROUTER_DECISIONS, effective_engine_config, engine_kv_blocks
from mtpserve.bench.route_report import (PREEMPTIONS, SUCCESS, capacity, format_capacity, format_goals, format_table,
                                         goals, instance_figures, labeled, labeled_delta, policy_row)
from mtpserve.bench.serve_shared_prefix import (SharedPrefixPrompt, load_tokenizer, requests_per_prefix,
                                                shared_prefix_prompts)


# ---- the dataset ----------------------------------------------------------------------------------

def test_the_dataset_is_seeded_and_cut_to_exact_token_counts():
    tokenizer = load_tokenizer(BUNDLED)
    assert tokenizer is not None
    prompts = shared_prefix_prompts(3, num_prefixes=4, prefix_len=256, user_len=24, num_requests=40,
                                     tokenizer=tokenizer)
    assert prompts == shared_prefix_prompts(3, 4, 256, 24, 40, tokenizer)
    assert prompts != shared_prefix_prompts(4, 4, 256, 24, 40, tokenizer)
    systems = {p.prefix_index: p.system for p in prompts}
    assert sorted(systems) == [0, 1, 2, 3]
    for p in prompts:
        assert p.system == systems[p.prefix_index]  # every request of a prefix sends the same text
        assert len(tokenizer.encode(p.system, add_special_tokens=False)) == 256
        assert len(tokenizer.encode(p.user, add_special_tokens=False)) == 24
        assert p.text == p.system + p.user
    assert len({p.user for p in prompts}) == 40  # every turn is the request's own
    assert len({text.splitlines()[0] for text in systems.values()}) == 4  # no two prefixes share a first block


def test_the_prefixes_interleave_so_round_robin_sends_each_one_to_both_instances():
    prompts = shared_prefix_prompts(0, num_prefixes=16, prefix_len=8, user_len=8, num_requests=256)
    counts = requests_per_prefix(prompts)
    assert len(counts) == 16 and sum(counts) == 256 and min(counts) > 0
    for instance in (0, 1):
        assert {p.prefix_index for p in prompts[instance::2]} == set(range(16))
    assert [p.prefix_index for p in prompts] != sorted(p.prefix_index for p in prompts)


def test_without_a_tokenizer_the_lengths_are_estimated_and_bad_sizes_are_refused(tmp_path):
    assert load_tokenizer(tmp_path) is None and load_tokenizer(None) is None
    prompts = shared_prefix_prompts(0, num_prefixes=2, prefix_len=100, user_len=10, num_requests=4)
    assert all(200 <= len(p.system) <= 800 for p in prompts)
    with pytest.raises(ValueError):
        shared_prefix_prompts(0, num_prefixes=0, prefix_len=100, user_len=10, num_requests=4)
    assert requests_per_prefix([]) == []


def serve_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--dataset", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "32",
                              "--input-len", "8", "--num-prompts", "6", "--output-len", "5", *extra])


def test_bench_serve_sends_the_prefix_as_the_system_message_or_ahead_of_the_prompt():
    args = serve_args("--endpoint", "chat")
    prompts = serve_dataset.make_dataset(args)
    assert len(prompts) == 6 and all(isinstance(p, SharedPrefixPrompt) for p in prompts)
    first = prompts[0]
    assert isinstance(first, SharedPrefixPrompt)
    chat = serve_dataset.request_body(args, "m", first)
    assert chat["messages"] == [{"role": "system", "content": first.system}, {"role": "user", "content": first.user}]
    assert chat["max_tokens"] == 5 and chat["stream"] is True
    completion = serve_dataset.request_body(serve_args("--endpoint", "completions"), "m", first)
    assert completion["prompt"] == first.system + first.user and "messages" not in completion
    assert serve_dataset.request_body(args, "m", "plain")["messages"] == [{"role": "user", "content": "plain"}]
    assert serve._config(args)["num_prefixes"] == 3
    assert "num_prefixes" not in serve._config(serve_args("--dataset", "code"))


# ---- the figures -----------------------------------------------------------------------------------

def scrape(queries: float | None, hits: float | None, success: float = 0.0) -> dict[str, float | None]:
    return {QUERIES: queries, HITS: hits, SUCCESS: success, PREEMPTIONS: 0.0}


def summary(ttft_p50: float, ttft_p99: float, completed: int = 10, failed: int = 0) -> dict:
    return {"completed": completed, "failed": failed, "ttft_ms": {"p50": ttft_p50, "p99": ttft_p99},
            "output_throughput": 100.0, "duration_s": 2.0}


def test_the_hit_rate_is_hits_over_queries_summed_over_instances_not_a_mean_of_rates():
    a = instance_figures("http://a", scrape(100, 10, 1), scrape(1100, 910, 7))  # 900 / 1000
    b = instance_figures("http://b", scrape(0, 0, 0), scrape(3000, 0, 3))  # 0 / 3000
    assert (a["requests"], a["hit_rate"], b["hit_rate"]) == (6, 0.9, 0.0)
    row = policy_row("cache_aware", summary(20.0, 90.0), [a, b], {"cache": 7.0})
    assert row["hit_rate"] == pytest.approx(900 / 4000)
    assert (row["queried_tokens"], row["hit_tokens"], row["request_split"]) == (4000, 900, [6, 3])
    assert row["largest_share"] == pytest.approx(6 / 9) and row["decisions"] == {"cache": 7.0}
    json.dumps(row)
    unknown = instance_figures("http://c", scrape(None, None), scrape(None, None))
    assert unknown["hit_rate"] is None
    assert policy_row("round_robin", summary(1, 2), [a, unknown], {})["hit_rate"] is None


def test_the_goals_are_ratios_of_cache_aware_against_round_robin():
    def row(policy: str, hits: float, ttft: float) -> dict:
        figures = instance_figures("http://a", scrape(0, 0), scrape(1000, hits))
        return policy_row(policy, summary(ttft, 2 * ttft), [figures], {})

    g = goals([row("cache_aware", 900, 50.0), row("round_robin", 450, 80.0)])
    assert g["hit_rate_ratio"] == pytest.approx(2.0) and g["hit_rate_met"] is True
    assert g["ttft_p50_ratio"] == pytest.approx(1.6) and g["ttft_p50_met"] is True
    assert "2.00x (goal: at least 1.8x): met" in format_goals(g)
    worse = goals([row("round_robin", 600, 40.0), row("cache_aware", 900, 50.0)])
    assert worse["hit_rate_met"] is False and worse["ttft_p50_met"] is False
    alone = goals([row("cache_aware", 900, 50.0)])
    assert alone["hit_rate_ratio"] is None and alone["hit_rate_met"] is None
    format_goals(alone)
    table = format_table([row("cache_aware", 900, 50.0), row("round_robin", 450, 80.0)])
    assert "cache_aware" in table and "0.900" in table and "0.450" in table


def test_the_capacity_says_how_many_prefixes_one_instance_holds():
    c = capacity(576, 16, [1024] * 16, 16, 2)
    assert (c["blocks_per_prefix"], c["prefixes_per_instance"]) == (64, 9)
    assert c["all_fit_one_instance"] is False and c["share_fits_one_instance"] is True
    assert "room for 9 prefixes of the 16" in format_capacity(c) and "meaningful" in format_capacity(c)
    everything = capacity(5460, 16, [1024] * 16, 16, 2)
    assert everything["all_fit_one_instance"] is True and "WARNING" in format_capacity(everything)
    assert "NOTE" in format_capacity(capacity(256, 16, [1030] * 16, 16, 2))  # 65 blocks a prefix: 3 fit
    unknown = capacity(None, 16, [1024], 16, 2)
    assert unknown["prefixes_per_instance"] is None and "unknown" in format_capacity(unknown)


def test_labeled_metrics_are_summed_by_one_label():
    text = (f'{ROUTER_DECISIONS}{{role="instance",reason="cache"}} 5.0\n'
            f'{ROUTER_DECISIONS}{{role="prefill",reason="cache"}} 2.0\n'
            f'{ROUTER_DECISIONS}{{role="instance",reason="balance"}} 1.0\n'
            f'# HELP {ROUTER_DECISIONS} x\nother_total{{reason="cache"}} 9.0\n')
    assert labeled(text, ROUTER_DECISIONS, "reason") == {"cache": 7.0, "balance": 1.0}
    assert labeled("", ROUTER_DECISIONS, "reason") == {}
    assert labeled_delta({"cache": 2.0}, {"cache": 7.0, "balance": 1.0}) == {"balance": 1.0, "cache": 5.0}


# ---- what it reads from the processes ------------------------------------------------------------

def test_the_kv_blocks_come_from_the_engine_ready_log_lines():
    log = "\n".join([
        json.dumps({"event": "engine ready", "model_name": "m", "max_model_len": 4096}),  # the HTTP process
        "not json: engine ready",
        json.dumps({"event": "engine ready", "kv_blocks": 576, "rank": 0}),
        json.dumps({"event": "engine ready", "kv_blocks": 570, "rank": 1}),
    ])
    assert engine_kv_blocks(log) == 570
    assert engine_kv_blocks('{"event": "starting"}\n') is None


def test_instance_flags_and_the_effective_configuration():
    parser = argparse.ArgumentParser()
    route.add_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--serve-args", "--block-size 32", "--num-prompts", "6"])
    flags = route.instance_serve_args(args)
    assert flags == "--log-level info --log-format json --num-kv-blocks 144 --block-size 32"
    engine = effective_engine_config(flags)
    assert (engine["num_kv_blocks"], engine["block_size"]) == (144, 32)
    zero = parser.parse_args(["route", "--num-kv-blocks", "0"])
    assert "--num-kv-blocks" not in route.instance_serve_args(zero)
    ns = route.serve_namespace(args, "http://router")
    assert (ns.dataset, ns.base_url, ns.num_prompts, ns.warmup, ns.endpoint) == ("shared-prefix", "http://router",
                                                                                  6, 0, "chat")
    assert len(route.shared_prefix_dataset(args)) == 6


# ---- one policy against stand-in instances --------------------------------------------------------

def cache_app(capacity_prefixes: int) -> web.Application:
    """A stand-in instance: streamed chat answers; /metrics counts a prompt's characters as queried
    tokens and its system message as hit when it is among the last `capacity_prefixes` seen (LRU);
    /reset_prefix_cache forgets them."""
    app, seen, counts = web.Application(), list[str](), {"queries": 0, "hits": 0, "done": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prefix = next((m["content"] for m in body.get("messages", ()) if m["role"] == "system"), None)
        counts["queries"] += sum(len(m["content"]) for m in body.get("messages", ())) + len(body.get("prompt", ""))
        if prefix is not None:
            if prefix in seen:
                counts["hits"] += len(prefix)
                seen.remove(prefix)
            seen[:] = (seen + [prefix])[-capacity_prefixes:]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}, "text": "x"}]}\n\n')
        usage = {"prompt_tokens": 1, "completion_tokens": body["max_tokens"]}
        await response.write(f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'.encode())
        counts["done"] += 1
        return response

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=f"{QUERIES} {counts['queries']}\n{HITS} {counts['hits']}\n"
                            f'{SUCCESS}{{finished_reason="length"}} {counts["done"]}\n')

    async def reset(request: web.Request) -> web.Response:
        seen.clear()
        return web.json_response({"num_blocks": 0})

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset)
    return app


async def test_one_policy_resets_the_caches_and_takes_the_counters_changes_over_the_run():
    parser = argparse.ArgumentParser()
    route.add_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--num-prefixes", "2", "--prefix-len", "16", "--user-len", "4",
                              "--output-len", "3", "--num-prompts", "12", "--concurrency", "1", "--settle", "0",
                              "--no-progress"])
    prompts = route.shared_prefix_dataset(args)
    async with TestServer(cache_app(4)) as a, TestServer(cache_app(4)) as b, session(None) as http:
        urls = [str(server.make_url("")).rstrip("/") for server in (a, b)]
        clients = [BenchClient(http, url, "m") for url in urls]
        # NOTE: the "router" here is instance a itself: every request lands there
        row = await route.measure_policy(http, args, "cache_aware", clients, prompts, urls[0])
    first_of_each = {p.prefix_index: n for n, p in reversed(list(enumerate(prompts)))}
    hit_chars = sum(len(p.system) for n, p in enumerate(prompts) if first_of_each[p.prefix_index] != n)
    assert (row["requests"], row["failed"], row["request_split"]) == (12, 0, [12, 0])
    assert row["hit_tokens"] == hit_chars and row["caches_reset"] is True
    assert row["queried_tokens"] == sum(len(p.system) + len(p.user) for p in prompts)
    assert row["instances"][1]["hit_rate"] is None and row["decisions"] == {}
    assert row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0
    json.dumps(row)


# ---- the whole command: real instances and the router ---------------------------------------------

def router_has_mixed_instances() -> bool:
    """The router takes `--instance` (issue 18); before that, the command cannot run."""
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "router", "--help"], capture_output=True,
                          text=True, timeout=60)
    return "--instance" in done.stdout and "--policy" in done.stdout


@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_the_command_compares_the_policies_through_the_router(tmp_path: Path):
    assert router_has_mixed_instances(), "mtpserve router has no --instance/--policy yet"
    out = tmp_path / "route.json"
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "route", "--num-prefixes", "4",
                           "--prefix-len", "64", "--user-len", "16", "--output-len", "8", "--num-prompts", "16",
                           "--concurrency", "4", "--num-kv-blocks", "16", "--settle", "0.6", "--no-progress",
                           "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hit rate cache_aware / round_robin" in done.stdout
    report = json.loads(out.read_text())
    assert report["capacity"]["kv_blocks"] == 16 and report["capacity"]["kv_blocks_logged"] == [16, 16]
    assert report["capacity"]["prefix_tokens_max"] == 64 and report["capacity"]["prefixes_per_instance"] == 16
    assert [row["policy"] for row in report["rows"]] == ["cache_aware", "round_robin"]
    for row in report["rows"]:
        assert (row["requests"], row["failed"], row["caches_reset"]) == (16, 0, True)
        assert sum(row["request_split"]) == 16  # the warm-up ran before the first scrape
        assert 0 < row["hit_rate"] < 1 and row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0
    round_robin = report["rows"][1]
    assert round_robin["request_split"] == [8, 8]
    assert report["goals"]["hit_rate_ratio"] is not None
