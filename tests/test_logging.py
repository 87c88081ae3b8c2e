"""Logging: JSON lines off a terminal, bound context on every line, stdlib loggers rendered alike."""

import json
import logging
import subprocess
import sys

PROBE = """
import asyncio, logging
from mtpserve import log
log.configure("info", "auto", process="rank", rank=1, instance="i0")
logger = log.get_logger("probe")
logger.debug("hidden")
logger.info("plain")

async def handler(request_id):
    log.bind(request_id=request_id)
    logger.info("in request")

async def main():
    await asyncio.gather(handler("a"), handler("b"))
    logger.info("after")

asyncio.run(main())
logging.getLogger("aiohttp.access").warning("stdlib")
"""


def run_probe() -> list[dict]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_json_lines_with_bound_context_off_a_terminal():
    lines = run_probe()
    assert [line["event"] for line in lines] == ["plain", "in request", "in request", "after", "stdlib"]
    assert all(line["rank"] == 1 and line["instance"] == "i0" for line in lines)
    assert sorted(str(line.get("request_id")) for line in lines[1:3]) == ["a", "b"]
    assert "request_id" not in lines[3], "a task's request id leaked into the parent context"
    assert lines[4]["level"] == "warning" and lines[4]["logger"] == "aiohttp.access"
    assert all("timestamp" in line for line in lines)


def test_log_level_filters():
    assert "hidden" not in [line["event"] for line in run_probe()]
