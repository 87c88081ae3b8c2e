"""`mtpserve bench serve` against the daemon as a user starts it: every level sends the same first prompts, so
each one starts from an empty prefix cache unless --keep-prefix-cache, and the level reports the share of
its prompt tokens the cache held."""

from __future__ import annotations

import argparse

import pytest

from daemon_harness import Daemon, model_available
from mtpserve.bench import serve

pytestmark = pytest.mark.skipif(not model_available(), reason="bundled model weights not present")


def _args(base_url: str, tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    # NOTE: no warm-up: its requests are the level's first prompts, and they would hit after a reset too
    return parser.parse_args(["serve", "--base-url", base_url, "--num-prompts", "6", "--input-len", "96",
                              "--output-len", "4", "--concurrency", "1", "2", "--warmup", "0", "--settle", "0.7",
                              "--out", str(tmp_path / "b.json"), "--no-progress", *extra])


async def test_each_level_starts_from_an_empty_prefix_cache_unless_told_to_keep_it(tmp_path):
    daemon = Daemon.start(tmp_path, "--num-speculative-tokens", "0", "--speculative-adaptive", "false")
    try:
        daemon.wait_healthy()
        reset = await serve.run_all(_args(daemon.url, tmp_path))
        kept = await serve.run_all(_args(daemon.url, tmp_path, "--keep-prefix-cache"))
    finally:
        assert daemon.stop() == 0
    rates = [[run["summary"]["prefix_cache_hit_rate"] for run in report["runs"]] for report in (reset, kept)]
    # NOTE: 96-token prompts are five full 16-token blocks of six: a second pass over them holds ~80%
    assert rates[0] == [0.0, 0.0]
    assert all(rate > 0.5 for rate in rates[1]), rates
