"""`mtpserve bench ipc` runs end to end on a tiny grid and writes its JSON."""

import argparse
import json

from mtpserve.bench import ipc as bench_ipc


def test_bench_ipc_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    bench_ipc.add_parser(parser.add_subparsers())
    out = tmp_path / "b.json"
    args = parser.parse_args(["ipc", "--batches", "3", "--tokens", "2", "--topk", "0,2",
                              "--transports", "posix,sysv", "--payload", "ring", "--steps", "5",
                              "--warmup", "1", "--pipelined", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert len(report["serial"]) == 4 and len(report["pipelined"]) == 4
    assert all(r["bytes_per_step"] > 64 and r["us_per_step"] > 0 for r in report["serial"])
