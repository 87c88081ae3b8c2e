"""`mtpserve bench serve` against the HTTP app + fake engine: every request completes, token counts
and acceptance (from /metrics deltas and from usage) agree, JSON and PNG plots are written."""

import argparse
import json

import pytest

from mtpserve.bench import serve, serve_dataset


def _args(base_url, tmp_path, *extra):
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--base-url", base_url, "--num-prompts", "8", "--input-len", "40",
                              "--output-len", "20", "--concurrency", "1", "4", "--out", str(tmp_path / "b.json"),
                              "--no-progress", "--settle", "0.2", *extra])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_bench_serve_against_fake_engine(fake_server, tmp_path, endpoint):
    base_url, _ = fake_server
    import os
    args = _args(base_url, tmp_path, "--endpoint", endpoint, "--server-pid", str(os.getpid()))
    report = await serve.run_all(args)
    assert [r["concurrency"] for r in report["runs"]] == [1, 4]
    for run in report["runs"]:
        s = run["summary"]
        assert s["completed"] == 8 and s["failed"] == 0
        assert s["total_output_tokens"] == 8 * 20
        assert s["tokens_per_chunk"] > 1  # MTP: several tokens per chunk
        spec = s["spec_decode"]
        assert spec["acceptance_length"] == pytest.approx(spec["per_request_acceptance_length"], rel=1e-6)
        assert s["server_cpu_s"] > 0  # the in-process app's CPU (here the test process itself)
        assert s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p99"] >= s["tpot_ms"]["p50"]
    assert len(report["plots"]) == 2
    json.dumps(report)


def test_prompts_are_deterministic(tmp_path):
    a = _args("http://x", tmp_path)
    assert serve_dataset.make_prompts(a) == serve_dataset.make_prompts(a)
    assert len(serve_dataset.make_prompts(a)) == 8


def test_compare_plots_earlier_runs(tmp_path):
    report = {"runs": [{"concurrency": c, "summary": {"output_throughput": 10.0 * c, "tpot_ms": {"p50": 5.0},
                                                      "ttft_ms": {"p50": 20.0 * c}}} for c in (1, 4)]}
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    args = _args("http://unused", tmp_path, "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                 "--plot-dir", str(tmp_path / "plots"))
    assert serve.run(args) == 0
    assert (tmp_path / "plots" / "serve-compare.png").stat().st_size > 1000
