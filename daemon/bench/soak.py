"""`mtpserve bench soak`: mixed load against a real instance for a stated time, with faults on a schedule.

It starts the instance as a user does (`mtpserve serve`, --tensor-parallel-size as asked), sends the
mixed load of soak_load.py from a few workers, and every --fault-every-s seconds injects the next fault
of soak_faults.py, then times how long until a probe request succeeds. At the end it checks that the
engine let go of everything (KV blocks, running requests), that the output path lost and rejected
nothing, how much every process grew, and that the instance stops leaving nothing behind. Prints a
summary, writes JSON, and exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import time
from pathlib import Path

import aiohttp
import posix_ipc

from mtpserve.bench.serve_launch import Instance
from mtpserve.bench.serve_report import parse_counters
from mtpserve.bench.soak_faults import children, schedule
from mtpserve.bench.soak_load import Load, Outcome

COUNTERS = ("mtpserve:output_frames_lost_total", "mtpserve:output_seq_errors_total",
            "mtpserve:output_frames_rejected_total", "mtpserve:kv_blocks_used", "vllm:num_requests_running")
RECOVERY_LIMIT_S = 120.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("soak", help="mixed load and injected faults against a real instance; "
                              "checks nothing is lost or leaked")
    p.add_argument("--duration-s", type=float, default=1200.0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--fault-every-s", type=float, default=90.0)
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before the first RSS reading")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more `mtpserve serve` flags")
    p.add_argument("--json-out", type=Path, default=Path("soak.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _raise_open_files()
    report = asyncio.run(soak(args))
    args.json_out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"JSON: {args.json_out}")
    return 0 if report["passed"] else 1


async def soak(args: argparse.Namespace) -> dict:
    flags = f"--tensor-parallel-size {args.tensor_parallel_size} {args.serve_args}"
    instance = Instance.start(f"soak=--served-model-name soak {flags}")
    instance.wait_healthy()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            return await _soak(args, instance, session)
    finally:
        instance.stop()


async def _soak(args: argparse.Namespace, instance: Instance, session: aiohttp.ClientSession) -> dict:
    load = Load(instance.url, "soak")
    await load.prepare(session)
    before = await _scrape(session, instance.url)
    start = time.monotonic()
    stop = asyncio.Event()
    workers = [asyncio.create_task(_worker(load, session, random.Random(args.seed + i), stop))
               for i in range(args.workers)]
    await asyncio.sleep(args.warmup_s)
    rss_start, requests_at_warmup = _rss(instance), len(load.outcomes)
    faults = await _inject(args, instance, session, start, stop)
    stop.set()
    await asyncio.gather(*workers)
    rss_end = _rss(instance)
    settled = await _settle(session, instance.url)
    after = await _scrape(session, instance.url)
    exited = instance.proc.poll() is not None
    instance.stop()
    return _report(args, load.outcomes, faults, before, after, settled, rss_start, rss_end,
                   len(load.outcomes) - requests_at_warmup, time.monotonic() - start,
                   exited, _leftovers(instance.name))


async def _worker(load: Load, session: aiohttp.ClientSession, rng: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        outcome = await load.one(session, rng)
        if outcome.status >= 500 or outcome.cut.startswith("connection"):
            await asyncio.sleep(0.2)  # NOTE: the instance is down or refusing: do not spin


async def _inject(args, instance: Instance, session: aiohttp.ClientSession, start: float,
                  stop: asyncio.Event) -> list[dict]:
    """The fault schedule, cycling, until the duration is over; one record per fault."""
    plan, records, n = schedule(args.tensor_parallel_size), [], 0
    while time.monotonic() - start + args.fault_every_s < args.duration_s:
        await asyncio.sleep(args.fault_every_s / 2)
        fault = plan[n % len(plan)]
        began = time.monotonic()
        try:
            await fault(instance, session)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError, posix_ipc.Error) as exc:
            print(f"fault {fault.__name__} could not be injected: {exc!r}", flush=True)
        ended = time.monotonic()
        recovered = await _recovery(instance, session)
        records.append({"fault": fault.__name__, "at_s": round(began - start, 1), "began": began,
                        "ended": ended, "recovered_s": recovered})
        if recovered == "exited":
            break  # NOTE: nothing left to load; the report says whether exiting was the designed answer
        await asyncio.sleep(max(0.0, args.fault_every_s / 2 - (time.monotonic() - ended)))
        n += 1
    remaining = args.duration_s - (time.monotonic() - start)
    if remaining > 0 and instance.proc.poll() is None:
        await asyncio.sleep(remaining)
    return records


async def _recovery(instance: Instance, session: aiohttp.ClientSession) -> float | str:
    began = time.monotonic()
    body = {"model": "soak", "prompt": "x = ", "max_tokens": 2, "temperature": 0}
    while time.monotonic() - began < RECOVERY_LIMIT_S:
        if instance.proc.poll() is not None:
            return "exited"
        try:
            async with session.post(instance.url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 200:
                    return round(time.monotonic() - began, 3)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    return "not recovered"


async def _settle(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """KV blocks and running requests after the load: they must come back to 0."""
    deadline, now = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        now = await _scrape(session, url)
        if now.get("mtpserve:kv_blocks_used", 1) == 0 and now.get("vllm:num_requests_running", 1) == 0:
            break
        await asyncio.sleep(0.5)
    return now


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(url + "/metrics") as resp:
            return parse_counters(await resp.text(), COUNTERS)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


def _rss(instance: Instance) -> dict[str, int]:
    """Resident set size (KiB) of the launcher and each child, by role."""
    pids = {"launcher": instance.proc.pid, **children(instance.proc.pid)}
    out = {}
    for role, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out[role] = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return out


def _leftovers(name: str) -> list[str]:
    return [str(p) for d in ("/dev/shm", "/dev/mqueue") for p in Path(d).glob(f"*{name}*")]


def _raise_open_files() -> None:
    """1,000 idle connections plus the load need more descriptors than a shell's default 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))


def _report(args, outcomes: list[Outcome], faults: list[dict], before: dict, after: dict, settled: dict,
            rss_start: dict, rss_end: dict, requests_after_warmup: int, elapsed: float, exited: bool,
            leftovers: list[str]) -> dict:
    windows = [(f["began"], f["ended"] + (f["recovered_s"] if isinstance(f["recovered_s"], float) else 0) + 5)
               for f in faults]
    in_fault = lambda o: any(a <= o.started <= b for a, b in windows)  # noqa: E731
    errors_5xx = [o for o in outcomes if o.status >= 500]
    growth = {role: _growth(rss_start.get(role), rss_end.get(role), requests_after_warmup) for role in rss_start}
    deltas = {name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS[:3]}
    refused: dict[str, int] = {}
    for o in outcomes:
        if o.status and o.status != 200:
            refused[str(o.status)] = refused.get(str(o.status), 0) + 1
    cut: dict[str, int] = {}
    for o in outcomes:
        if o.cut:
            cut[o.cut] = cut.get(o.cut, 0) + 1
    report = {
        "duration_s": round(elapsed, 1), "tensor_parallel_size": args.tensor_parallel_size,
        "requests": {"sent": len(outcomes), "completed": sum(o.status == 200 and not o.cut for o in outcomes),
                     "refused": refused, "cut": cut},
        "tokens": {"requests_checked": sum(o.checked for o in outcomes), "lost": sum(o.lost for o in outcomes),
                   "duplicated": sum(o.duplicated for o in outcomes),
                   "greedy_diverged": sum(o.diverged for o in outcomes)},
        "output_path": deltas,
        "http_5xx": {"inside_faults": sum(in_fault(o) for o in errors_5xx),
                     "outside_faults": sum(not in_fault(o) for o in errors_5xx)},
        "rss_kib": {"start": rss_start, "end": rss_end, "growth_pct_per_10k_requests": growth},
        "after_load": {"kv_blocks_used": settled.get("mtpserve:kv_blocks_used"),
                       "num_requests_running": settled.get("vllm:num_requests_running")},
        "faults": [{k: v for k, v in f.items() if k not in ("began", "ended")} for f in faults],
        "instance_exited": exited, "left_behind": leftovers,
    }
    report["checks"] = _checks(report)
    report["passed"] = all(report["checks"].values())
    return report


def _growth(start: int | None, end: int | None, requests: int) -> float | None:
    if not start or end is None or requests <= 0:
        return None
    return round(100.0 * (end - start) / start * 10_000 / requests, 3)


def _checks(r: dict) -> dict[str, bool]:
    exits = [f for f in r["faults"] if f["recovered_s"] == "exited"]
    return {
        "no token lost or duplicated": r["tokens"]["lost"] == 0 and r["tokens"]["duplicated"] == 0,
        "output path lost and rejected nothing": not any(r["output_path"].values()),
        "no 5xx outside faults": r["http_5xx"]["outside_faults"] == 0,
        "RSS growth < 5% per 10k requests": all(g is None or g < 5.0
                                                for g in r["rss_kib"]["growth_pct_per_10k_requests"].values()),
        "KV and running back to 0": exits != [] or (r["after_load"]["kv_blocks_used"] == 0
                                                    and r["after_load"]["num_requests_running"] == 0),
        "every fault recovered or exited": all(f["recovered_s"] != "not recovered" for f in r["faults"]),
        "nothing left behind": not r["left_behind"],
    }


def format_report(r: dict) -> str:
    lines = [f"soak: {r['duration_s']} s at TP={r['tensor_parallel_size']}",
             f"  requests {json.dumps(r['requests'])}", f"  tokens {json.dumps(r['tokens'])}",
             f"  output path {json.dumps(r['output_path'])}", f"  5xx {json.dumps(r['http_5xx'])}",
             f"  RSS growth %/10k requests {json.dumps(r['rss_kib']['growth_pct_per_10k_requests'])}",
             f"  after load {json.dumps(r['after_load'])}"]
    lines += [f"  fault {f['fault']:<18} at {f['at_s']:>7} s  recovered {f['recovered_s']}" for f in r["faults"]]
    lines += [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in r["checks"].items()]
    return "\n".join(lines)
