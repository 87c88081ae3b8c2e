"""`mtpserve bench prefix`: its prompts (exact lengths, sharing exactly the prefix, seeded), its client's
parsing (metrics, usage, SSE), its figures; against a stand-in server with no prefix caching (unknown
figures are None, nothing crashes); and once against a real daemon."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestServer

from bench_fake_server import MODEL, fake_app
from daemon_harness import model_available
from mtpserve.bench import prefix
from mtpserve.bench.prefix_client import HITS, QUERIES, Reply, chunk_text, hit_rate, parse_sse, read_metric
from mtpserve.bench.prefix_prompts import exact_prompt, prefix_cases
from mtpserve.bench.prefix_report import format_goals, format_table, goals, summarize_length


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


# ---- prompts ------------------------------------------------------------------------------------

def test_cases_are_seeded_and_count_warmups_as_negative_repeats():
    cases = prefix_cases(7, [16, 32], repeats=3, suffix_len=4)
    assert cases == prefix_cases(7, [16, 32], repeats=3, suffix_len=4)
    assert cases != prefix_cases(8, [16, 32], repeats=3, suffix_len=4)
    assert [(c.length, c.repeat) for c in cases] == [(n, r) for n in (16, 32) for r in range(-1, 3)]
    assert len({c.prefix_text.splitlines()[0] for c in cases}) == len(cases)  # every prefix starts unlike the others


def test_miss_and_hit_share_exactly_the_prefix_and_have_exact_lengths():
    for case in prefix_cases(0, [64, 512], repeats=2, suffix_len=8):
        suffixes = (chars(case.suffix_texts[0]), chars(case.suffix_texts[1]))
        prompt = exact_prompt(case, chars(case.prefix_text), suffixes, 8)
        assert len(prompt.miss_ids) == len(prompt.hit_ids) == case.length + 8
        assert prompt.miss_ids[:case.length] == prompt.hit_ids[:case.length]
        assert prompt.miss_ids[case.length] != prompt.hit_ids[case.length]


def test_short_text_or_equal_suffix_heads_are_refused():
    case = prefix_cases(0, [64], repeats=1, suffix_len=4)[0]
    with pytest.raises(ValueError, match="fewer than"):
        exact_prompt(case, [1] * 63, ([1] * 4, [2] * 4), 4)
    with pytest.raises(ValueError, match="same token"):
        exact_prompt(case, [1] * 64, ([3, 1, 1, 1], [3, 2, 2, 2]), 4)


# ---- client parsing -------------------------------------------------------------------------------

METRICS = f"""# TYPE vllm:prefix_cache_queries_total counter
{QUERIES}{{model_name="m"}} 100.0
{QUERIES}{{model_name="n"}} 20.0
{HITS}{{model_name="m"}} 60.0
mtpserve:prefix_cache_blocks{{model_name="m"}} 7.0
"""


def test_metrics_are_summed_over_labels_and_missing_ones_are_unknown():
    assert read_metric(METRICS, QUERIES) == 120.0
    assert read_metric(METRICS, "mtpserve:prefix_cache_blocks") == 7.0
    assert read_metric(METRICS, "vllm:no_such_total") is None
    before = {QUERIES: 20.0, HITS: 10.0}
    assert hit_rate(before, {QUERIES: 120.0, HITS: 60.0}) == {"queried_tokens": 100.0, "hit_tokens": 50.0,
                                                               "hit_rate": 0.5}
    assert hit_rate({QUERIES: None, HITS: None}, {QUERIES: None, HITS: None})["hit_rate"] is None
    assert hit_rate(before, before)["hit_rate"] is None  # nothing queried: no rate


def test_reply_figures_come_from_the_usage_and_are_none_when_absent():
    usage = {"prompt_tokens": 100, "completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 64},
             "spec_decode": {"mean_acceptance_length": 2.5}}
    figures = Reply(True, "", "text", 0.1, 0.6, usage).figures()
    assert figures["ttft_ms"] == pytest.approx(100.0)
    assert figures["decode_tok_s"] == pytest.approx(10 / 0.5)
    assert (figures["cached_tokens"], figures["acceptance_length"], figures["prompt_tokens"]) == (64, 2.5, 100)
    bare = Reply(True, "", "t", 0.1, 0.1, {}).figures()
    assert (bare["decode_tok_s"], bare["cached_tokens"], bare["acceptance_length"]) == (None, None, None)
    assert Reply(False, "HTTP 500", "", 0.0, 0.2, {}).figures()["ttft_ms"] is None


def test_sse_lines_and_chunk_text():
    assert parse_sse(b"data: [DONE]\n") is None
    assert parse_sse(b": keep-alive\n") is None
    assert chunk_text(parse_sse(b'data: {"choices": [{"text": "ab"}]}\n') or {}) == "ab"
    assert chunk_text({"choices": [{"delta": {"content": "c"}}, {"delta": {}}]}) == "c"
    assert chunk_text({"choices": [], "usage": {}}) == ""


# ---- figures --------------------------------------------------------------------------------------

def sample(kind: str, ttft: float, tok_s: float, acceptance: float | None, cached: int | None = None, ok=True,
           **extra) -> dict:
    return {"kind": kind, "ok": ok, "ttft_ms": ttft if ok else None, "decode_tok_s": tok_s,
            "acceptance_length": acceptance, "cached_tokens": cached, "prompt_tokens_sent": 100, **extra}


def test_a_length_row_takes_medians_ratios_and_pairs():
    same, differs = {"output": True, "acceptance": True}, {"output": False, "acceptance": True}
    samples = [sample("miss", 100, 50, 2.0), sample("hit", 10, 52, 2.0, 64),
               sample("miss_reset", 120, 48, 2.0, 0, same_as_hit=same),
               sample("miss", 80, 50, 2.2), sample("hit", 12, 50, 2.2, 64),
               sample("miss_reset", 90, 49, 2.2, 0, same_as_hit=differs),
               sample("hit", 0, 0, None, ok=False)]
    cache = {"queried_tokens": 700.0, "hit_tokens": 128.0, "hit_rate": 128 / 700}
    row = summarize_length(64, samples, cache)
    assert (row["requests"], row["failed"]) == (7, 1)
    assert row["miss_kind"] == "miss_reset"  # the hits' own prompts, cold: the plain misses only warmed P
    assert row["ttft_ms_miss"] == 105.0 and row["ttft_ms_hit"] == 11.0  # the failed hit is left out
    assert row["ttft_speedup"] == pytest.approx(105 / 11) and row["decode_tok_s_miss"] == 48.5
    assert row["acceptance_length_miss"] == pytest.approx(2.1) and row["acceptance_ratio"] == pytest.approx(1.0)
    assert (row["same_prompt_pairs"], row["equal_output"], row["equal_acceptance"]) == (2, 1, 2)
    assert row["cached_tokens_hit"] == 64 and row["hit_rate"] == cache["hit_rate"]
    assert row["hit_rate_bound"] == pytest.approx(64 * 2 / 700)


def test_unknown_figures_stay_none_through_the_row_the_goals_and_the_table():
    samples = [sample("miss", 100, 50, None), sample("hit", 10, 50, None)]
    row = summarize_length(2048, samples, {"queried_tokens": None, "hit_tokens": None, "hit_rate": None})
    assert row["miss_kind"] == "miss" and row["ttft_ms_miss"] == 100
    assert row["acceptance_ratio"] is None and row["cached_tokens_hit"] is None
    g = goals([summarize_length(512, samples, {"queried_tokens": None, "hit_tokens": None, "hit_rate": None}), row])
    assert g["ttft_speedup"] == {"prefix_tokens": 2048, "ratio": 10.0, "goal": 10.0}
    assert g["acceptance_ratio"] == {"512": None, "2048": None}
    assert "2048" in format_table([row]) and "10.00x" in format_goals(g)
    assert "/reset_prefix_cache unavailable" in format_goals(g)


# ---- a server without prefix caching ------------------------------------------------------------

def args(**over) -> argparse.Namespace:
    base = {"api_key": None, "model": None, "lengths": [32, 64], "suffix_len": 4, "output_len": 5, "repeats": 2,
            "seed": 0, "settle": 0.0, "base_url": "given", "serve_args": ""}
    return argparse.Namespace(**{**base, **over})


async def test_against_a_server_without_prefix_caching_the_cache_figures_are_unknown():
    async with TestServer(fake_app()) as server:
        report = await prefix.measure(args(), str(server.make_url("")))
    json.dumps(report)  # the report is JSON as it is
    assert report["model"] == MODEL and report["reset_available"] is False
    assert report["hit_rate"] == {"queried_tokens": None, "hit_tokens": None, "hit_rate": None}
    assert report["cache_blocks"] is None
    assert [r["prefix_tokens"] for r in report["rows"]] == [32, 64]
    assert all(r["failed"] == 0 and r["requests"] == 4 and r["ttft_ms_hit"] > 0 for r in report["rows"])
    assert all(r["acceptance_length_hit"] is None and r["hit_rate"] is None for r in report["rows"])
    assert {(s["kind"], s["prompt_tokens"]) for s in report["samples"]} == {("miss", 36), ("hit", 36), ("miss", 68),
                                                                             ("hit", 68)}


# ---- a real daemon --------------------------------------------------------------------------------

@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_the_command_against_a_launched_daemon_writes_every_figure(tmp_path):
    out = tmp_path / "prefix.json"
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "prefix", "--lengths", "32", "64",
                           "--repeats", "1", "--suffix-len", "8", "--output-len", "8", "--settle", "0.6",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "TTFT miss/hit at 64 tokens" in done.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "prefix" and report["launch"] == prefix.SERVE_ARGS
    for row in report["rows"]:
        assert row["failed"] == 0
        assert row["ttft_ms_miss"] > 0 and row["ttft_ms_hit"] > 0 and row["decode_tok_s_hit"] > 0
        assert row["acceptance_length_miss"] is not None and row["acceptance_length_hit"] is not None  # k = 2
        assert "hit_rate" in row and "cached_tokens_hit" in row  # None until the daemon counts them
    assert set(report["goals"]) >= {"ttft_speedup", "acceptance_ratio", "same_prompt"}
