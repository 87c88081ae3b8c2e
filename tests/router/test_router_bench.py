"""The router benchmark runs end to end (tiny sizes) and writes its report."""

import json

from mtpserve.router.bench import main


def test_bench_writes_report(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--requests", "4", "--concurrency", "2", "--tokens", "5", "--step-ms", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["direct"]["events"] == report["router"]["events"] == 4 * (5 + 1)  # tokens and [DONE]
    assert report["router_cpu_ms_per_request"] >= 0
