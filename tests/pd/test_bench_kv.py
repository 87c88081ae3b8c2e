"""`bench kv` runs end to end (holder process, reads, byte check) and reports coherent figures."""

from __future__ import annotations

import argparse
import json

from mtpserve.bench import kv


def test_bench_kv_small_run(tmp_path):
    out = tmp_path / "kv.json"
    assert kv.main(["--lengths", "40", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    contiguous, scattered = report["results"]
    assert report["num_buffers"] == 2 * (report["shape"]["layers"] + report["shape"]["depths"])
    assert contiguous["blocks"] == scattered["blocks"] == 3  # ceil(40 / 16)
    assert contiguous["descriptors"] == report["num_buffers"]
    assert scattered["descriptors"] == 3 * report["num_buffers"]
    assert contiguous["bytes"] == scattered["bytes"] == 3 * report["block_bytes"] * report["num_buffers"]


def test_bench_kv_plugs_into_the_bench_subcommands():
    parser = argparse.ArgumentParser()
    kv.add_parser(parser.add_subparsers())
    args = parser.parse_args(["kv", "--lengths", "128", "256"])
    assert args.func is kv.run and args.lengths == [128, 256] and args.protocol == "tcp"
