"""`mtpserve bench chat`: its conversations (seeded, each prompt extending the last, within the bundled
model's context), its figures and comparison; against a stand-in server with no prefix caching; and
once against two real daemons, caching on and off."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestServer

from bench_fake_server import fake_app
from daemon_harness import BUNDLED, model_available
from mtpserve.bench import chat
from mtpserve.bench.chat import TooLong, chat_script, check_fits, estimated_last_prompt, next_messages
from mtpserve.bench.chat_report import compare, format_table, percentile, summarize_chat


def args(**over) -> argparse.Namespace:
    base = {"conversations": 8, "turns": 4, "system_len": 256, "user_len": 192, "output_len": 128, "seed": 0,
            "api_key": None, "model": None, "settle": 0.0, "base_url": "given", "launch": None, "serve_args": ""}
    return argparse.Namespace(**{**base, **over})


def test_the_script_is_seeded_and_has_a_message_per_turn():
    script = chat_script(3, num_conversations=2, num_turns=3, system_len=64, user_len=32)
    assert script == chat_script(3, 2, 3, 64, 32) and script != chat_script(4, 2, 3, 64, 32)
    assert [len(turns) for turns in script.users] == [3, 3]
    assert len({text for turns in script.users for text in turns} | {script.system, script.warmup}) == 8
    assert chat_script(3, 1, 1, 0, 32).system == ""


def test_each_turn_extends_the_last_with_its_answer_and_a_new_user_message():
    first = next_messages([{"role": "system", "content": "S"}], None, "u1")
    second = next_messages(first, "a1", "u2")
    assert first == [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}]
    assert second[:2] == first
    assert second[2:] == [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]


def test_the_defaults_fit_the_bundled_models_context_and_grow_to_over_a_thousand_tokens():
    max_len = json.loads((BUNDLED / "config.json").read_text())["max_position_embeddings"]
    check_fits(args(), max_len)
    assert 1000 <= estimated_last_prompt(args()) <= 2048
    with pytest.raises(TooLong, match="max_model_len 4096"):
        check_fits(args(turns=12), 4096)
    check_fits(args(turns=12), None)  # a server that does not say: not checked


def sample(conversation: int, turn: int, ttft: float | None, *, ok=True, cached: int | None = 10,
           answer: str = "x") -> dict:
    return {"conversation": conversation, "turn": turn, "ok": ok, "ttft_ms": ttft,
            "completion_tokens": 8 if ok else None, "prompt_tokens": 100 * (turn + 1) if ok else None,
            "cached_tokens": cached, "answer_sha1": answer}


def test_a_summary_has_percentiles_per_run_and_per_turn():
    samples = [sample(c, t, 10.0 * (t + 1) + c) for c in range(2) for t in range(3)] + [sample(2, 0, None, ok=False)]
    s = summarize_chat(samples, 2.0, {"queried_tokens": 1200.0, "hit_tokens": 60.0, "hit_rate": 0.05})
    assert (s["requests"], s["failed"]) == (7, 1)
    assert s["ttft_ms"]["p50"] == pytest.approx(20.5) and s["ttft_ms"]["p99"] == pytest.approx(percentile(
        [10, 11, 20, 21, 30, 31], 99))
    assert s["ttft_p50_ms_by_turn"] == [10.5, 20.5, 30.5]
    assert s["output_tok_s"] == 6 * 8 / 2.0
    assert s["cached_share"] == pytest.approx(60 / 1200) and s["last_turn_prompt_tokens"]["median"] == 300
    assert s["hit_rate"] == 0.05
    unknown = summarize_chat([sample(0, 0, 5.0, cached=None)], 1.0, {"hit_rate": None})
    assert unknown["cached_tokens"] is None and unknown["cached_share"] is None


def test_the_comparison_is_against_the_first_configuration():
    on = [sample(0, t, 10.0) for t in range(2)]
    off = [sample(0, 0, 30.0), sample(0, 1, 30.0, answer="y")]
    results = [{"label": label, "samples": s, "summary": summarize_chat(s, 1.0, {"hit_rate": None})}
               for label, s in (("cache-on", on), ("cache-off", off))]
    (row,) = compare(results)
    assert (row["label"], row["against"]) == ("cache-off", "cache-on")
    assert row["ttft_p50_ratio"] == pytest.approx(3.0) and row["output_tok_s_ratio"] == pytest.approx(1.0)
    assert (row["equal_answers"], row["answers"]) == (1, 2)
    assert "cache-off / cache-on: TTFT p50 3.00x" in format_table(results, [row])


async def test_against_a_server_without_prefix_caching_the_cache_figures_are_unknown():
    script = chat_script(0, 2, 3, 16, 16)
    async with TestServer(fake_app()) as server:
        result = await chat.measure(args(output_len=4), "fake", str(server.make_url("")), script)
    json.dumps(result)
    s = result["summary"]
    assert (s["requests"], s["failed"]) == (6, 0)
    assert s["hit_rate"] is None and s["cached_share"] is None and s["output_tokens"] == 24
    by_turn = {t: [x["prompt_tokens"] for x in result["samples"] if x["turn"] == t] for t in range(3)}
    assert all(a < b for a, b in zip(by_turn[0], by_turn[1])) and all(a < b for a, b in zip(by_turn[1], by_turn[2]))


async def test_a_conversation_too_long_for_the_server_is_refused_before_it_runs():
    async with TestServer(fake_app(max_model_len=512)) as server:
        with pytest.raises(TooLong):
            await chat.measure(args(), "fake", str(server.make_url("")), chat_script(0, 1, 4, 256, 192))


@pytest.mark.skipif(not model_available(), reason="no bundled model")
def test_the_command_against_two_launched_daemons_writes_every_figure(tmp_path):
    out = tmp_path / "chat.json"
    done = subprocess.run([sys.executable, "-m", "mtpserve.cli", "bench", "chat", "--conversations", "2", "--turns",
                           "2", "--system-len", "32", "--user-len", "32", "--output-len", "8", "--settle", "0.6",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["results"]] == ["cache-on", "cache-off"]
    for result in report["results"]:
        s = result["summary"]
        assert (s["requests"], s["failed"]) == (4, 0)
        assert s["ttft_ms"]["p50"] > 0 and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"] and s["output_tok_s"] > 0
        assert "hit_rate" in s  # None until the daemon counts hits
    (row,) = report["comparison"]
    assert row["label"] == "cache-off" and row["ttft_p50_ratio"] > 0 and row["answers"] == 4
