"""The HTTP process's CPU per streamed token (serving_cost.py): measured per interval, idle spells
dropped, and sent to the engine while a real stream runs (/metrics shows the figure it sent)."""

import aiohttp
import pytest
from server_harness import MODEL_NAME

from mtpserve.server.serving_cost import INTERVAL_S, MIN_TOKENS, ServingCostMeter


class Clocks:
    def __init__(self) -> None:
        self.cpu, self.now = 0.0, 0.0


def meter() -> tuple[ServingCostMeter, Clocks]:
    clocks = Clocks()
    return ServingCostMeter(lambda: clocks.cpu, lambda: clocks.now), clocks


def test_a_figure_is_the_cpu_of_an_interval_over_its_tokens():
    m, clocks = meter()
    clocks.cpu, clocks.now = 0.02, INTERVAL_S / 2
    assert m.sample(500) is None  # the interval has not passed
    clocks.cpu, clocks.now = 0.04, INTERVAL_S
    cost = m.sample(1000)
    assert cost is not None and cost.cpu_seconds_per_token == pytest.approx(0.04 / 1000)
    clocks.cpu, clocks.now = 0.07, 2 * INTERVAL_S
    cost = m.sample(1500)
    assert cost is not None and cost.cpu_seconds_per_token == pytest.approx(0.03 / 500)


def test_an_idle_interval_is_dropped_not_divided_by_the_tokens_after_it():
    m, clocks = meter()
    clocks.cpu, clocks.now = 0.5, 60.0  # a minute of health checks and scrapes, few tokens
    assert m.sample(MIN_TOKENS - 1) is None
    clocks.cpu, clocks.now = 0.52, 61.0
    cost = m.sample(MIN_TOKENS - 1 + 400)
    assert cost is not None and cost.cpu_seconds_per_token == pytest.approx(0.02 / 400)


async def test_a_stream_reports_the_http_processs_cost_per_token(fake_server):
    base_url, _ = fake_server
    body = {"model": MODEL_NAME, "prompt": "x " * 8, "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # enough tokens, and over an interval
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        async with session.get(f"{base_url}/metrics") as resp:
            text = await resp.text()
    line = next(ln for ln in text.splitlines() if ln.startswith("mtpserve:serving_cpu_seconds_per_token{"))
    assert 0 < float(line.split()[-1]) < 0.01
