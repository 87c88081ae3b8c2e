"""The engine benchmark runs end to end and writes its figures (no speed is asserted here)."""

import argparse
import json

from mtpserve.bench import engine


def test_synthetic_benchmark_writes_json(tmp_path):
    parser = argparse.ArgumentParser()
    engine.add_parser(parser.add_subparsers())
    out = tmp_path / "engine.json"
    args = parser.parse_args(["engine", "--batch", "1", "4", "--step-ms", "1", "--warmup-steps", "3",
                              "--measure-steps", "10", "--max-tokens", "8", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    rows = report["synthetic"]
    assert [(r["batch"], r["overlap"]) for r in rows] == [(1, False), (1, True), (4, False), (4, True)]
    assert all(0 < r["busy_fraction"] <= 1.0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(1.0 <= r["mean_acceptance_length"] <= 4.0 for r in rows)
