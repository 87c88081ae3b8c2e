"""`mtpserve bench sampling`: the CPU op and the Paddle path timed side by side, through the CLI."""

from __future__ import annotations

import json

import pytest

from mtpserve.cli import main
from mtpserve.engine.spec_verify import host_sampling_available

pytestmark = pytest.mark.skipif(not host_sampling_available(), reason="the CPU sampling op is not built")


def test_every_shape_is_timed_both_ways_and_written(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    assert main(["bench", "sampling", "--requests", "1", "3", "--windows", "1", "3", "--top-p", "1", "0.5",
                 "--vocab", "256", "--repeats", "3", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["top_p"], c["requests"], c["window"]) for c in cases] == [
        (p, r, w) for p in (1.0, 0.5) for r in (1, 3) for w in (1, 3)]
    for case in cases:
        assert case["paddle_us"] > 0 and case["op_us"] > 0
        assert case["speedup"] == pytest.approx(case["paddle_us"] / case["op_us"], rel=0.05)
    assert "wrote" in capsys.readouterr().out
