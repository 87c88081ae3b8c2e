"""The processes of `bench route` and what it reads from them: the router (one per policy), each instance's
KV block count (its "engine ready" log line), the effective configuration of the instances' flags, and
the /metrics figures scraped before and after each run.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp

from mtpserve.bench.prefix_client import CACHE_BLOCKS, HITS, QUERIES, read_metric
from mtpserve.bench.route_report import PREEMPTIONS, SUCCESS
from mtpserve.bench.serve_launch import Instance, _free_port, popen_logged

INSTANCE_METRICS = (QUERIES, HITS, SUCCESS, PREEMPTIONS, CACHE_BLOCKS)
ROUTER_DECISIONS = "mtpserve:router_policy_decisions_total"  # by reason (the router's policy.py)
ROUTER_CHOSEN = "mtpserve:router_backend_requests_total"  # by instance URL


def start_router(instance_urls: list[str], policy: str, router_args: str, log_path: Path | None) -> Instance:
    """`mtpserve router --instance URL... --policy POLICY` on a free port (not waited for)."""
    port = _free_port()
    argv = [sys.executable, "-m", "mtpserve.cli", "router", "--instance", *instance_urls, "--policy", policy,
            "--port", str(port), "--log-level", "warning", *shlex.split(router_args)]
    return Instance(policy, f"http://127.0.0.1:{port}", popen_logged(argv, log_path), f"router-{policy}")


def engine_kv_blocks(log_text: str) -> int | None:
    """The KV blocks an instance allocated, from its rank's "engine ready" JSON log line (the fewest over
    ranks); None when no such line was logged."""
    blocks = []
    for line in log_text.splitlines():
        if '"engine ready"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("kv_blocks"), int):
            blocks.append(record["kv_blocks"])
    return min(blocks) if blocks else None


def effective_engine_config(serve_args: str) -> dict:
    """The [engine] table `mtpserve config` prints for these serve flags ({} when it fails)."""
    argv = [sys.executable, "-m", "mtpserve.cli", "config", *shlex.split(serve_args)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {}
    return tomllib.loads(done.stdout).get("engine", {})


async def scrape(session: aiohttp.ClientSession, base_url: str, names: tuple[str, ...] = INSTANCE_METRICS
                 ) -> dict[str, float | None]:
    """Each metric summed over its label sets; None when not exported (or the scrape failed)."""
    text = await metrics_text(session, base_url)
    return {name: read_metric(text, name) for name in names}


async def metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            return await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        return ""
