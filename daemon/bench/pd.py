"""`mtpserve bench pd`: time to first token under PD, split into prefill, KV transfer and first decode
step, for several prompt lengths, plus the KV transfer throughput.

It plays the router's part itself so it can time each stage (one request at a time):
  1. POST the prompt (token ids) to the prefill instance: the answer carries the first token and
     `kv_transfer_params` -> `prefill` (TTFT as a client of the router sees it, minus the router hop);
  2. POST to the decode instance with those params, streamed, until its first chunk -> `decode_first`;
  3. the decode instance's `mtpserve:pd_kv_transfer_{seconds,bytes}` deltas -> `transfer` and GB/s;
     `first_step` = decode_first - transfer (admission, the first verify step, HTTP).
Without --prefill/--decode it starts both instances (`mtpserve serve --role ...`) and stops them after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mtpserve.bench.serve_report import parse_counters

LENGTHS = (128, 256, 512, 1024, 2048)
HEARTBEAT_S = 0.6  # the engine's stats reach /metrics every 0.5 s


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pd", help="PD: TTFT split into prefill / KV transfer / first decode step, "
                              "and KV transfer GB/s, by prompt length")
    p.add_argument("--prefill", default=None, help="a prefill instance's URL (default: start one)")
    p.add_argument("--decode", default=None, help="a decode instance's URL (default: start one)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths, tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("pd-bench.json"), help="JSON results file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with Instances(args.prefill, args.decode) as (prefill, decode):
        model = _get_json(prefill + "/v1/models")["data"][0]["id"]
        results = [measure(prefill, decode, model, length, args.repeats) for length in args.lengths]
    for r in results:
        print(format_row(r), flush=True)
    args.out.write_text(json.dumps({"benchmark": "pd", "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


def measure(prefill: str, decode: str, model: str, length: int, repeats: int) -> dict:
    samples = [one_request(prefill, decode, model, _prompt(length, seed)) for seed in range(repeats + 1)]
    samples = samples[1:]  # NOTE: the first request of a length warms the attention shapes up
    med = lambda key: statistics.median(s[key] for s in samples)  # noqa: E731
    return {"prompt_tokens": length, "repeats": repeats, "prefill_ms": med("prefill_ms"),
            "transfer_ms": med("transfer_ms"), "first_step_ms": med("first_step_ms"),
            "ttft_ms": med("prefill_ms"), "second_token_ms": med("decode_first_ms") + med("prefill_ms"),
            "kv_bytes": med("kv_bytes"), "transfer_gb_s": med("kv_bytes") / max(med("transfer_ms"), 1e-6) / 1e6}


def one_request(prefill: str, decode: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = _kv_counters(decode)
    begin = time.perf_counter()
    answer = _post(prefill + "/v1/completions", body, {"X-PD-Stage": "prefill"})
    prefilled = time.perf_counter()
    params = answer["kv_transfer_params"]
    first_chunk = _first_chunk_time(decode + "/v1/completions", {**body, "stream": True,
                                                               "kv_transfer_params": params})
    _post(prefill + "/v1/pd/release", {"transfer_ids": [params["transfer_id"]]})
    time.sleep(HEARTBEAT_S)
    after = _kv_counters(decode)
    transfer_s = after["seconds"] - before["seconds"]
    decode_first = first_chunk - prefilled
    return {"prefill_ms": 1e3 * (prefilled - begin), "decode_first_ms": 1e3 * decode_first,
            "transfer_ms": 1e3 * transfer_s, "first_step_ms": 1e3 * (decode_first - transfer_s),
            "kv_bytes": after["bytes"] - before["bytes"]}


def format_row(r: dict) -> str:
    return (f"prompt {r['prompt_tokens']:5d} tok  TTFT {r['ttft_ms']:7.1f} ms = prefill  |  then "
            f"transfer {r['transfer_ms']:6.2f} ms ({r['kv_bytes'] / 2**20:6.2f} MiB, "
            f"{r['transfer_gb_s']:5.2f} GB/s) + first decode step {r['first_step_ms']:6.1f} ms  "
            f"->  2nd token at {r['second_token_ms']:7.1f} ms")


def _prompt(length: int, seed: int) -> list[int]:
    # NOTE: ids from the middle of the vocabulary, shifted per seed so no two prompts share a prefix.
    return [(100 + seed * 37 + 7 * i) % 3000 + 500 for i in range(length)]


def _kv_counters(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    seconds, nbytes = "mtpserve:pd_kv_transfer_seconds_total", "mtpserve:pd_kv_transfer_bytes_total"
    counters = parse_counters(text, (seconds, nbytes))
    return {"seconds": counters[seconds], "bytes": counters[nbytes]}


def _first_chunk_time(url: str, body: dict) -> float:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json", "X-PD-Stage": "decode"})
    first = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the decode stage answered without a data event")
    return first


def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


class Instances:
    """The given instance URLs, or a prefill and a decode instance started for the run."""

    def __init__(self, prefill: str | None, decode: str | None) -> None:
        self.urls = (prefill, decode)
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> tuple[str, str]:
        prefill, decode = self.urls
        if prefill and decode:
            return prefill, decode
        urls = []
        for role in ("prefill", "decode"):
            port = _free_port()
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "mtpserve.cli", "serve", "--role", role, "--port", str(port),
                 "--instance", f"bench-pd-{role}-{port}", "--log-level", "warning"]))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            _wait_healthy(url)
        return tuple(urls)

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")
