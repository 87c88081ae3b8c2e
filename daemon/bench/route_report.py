"""The figures of `bench route`: one policy's row, the goal ratios, the KV capacity check, the table.

A scrape is one instance's /metrics figures (route_launch.INSTANCE_METRICS, None when not exported). A
row's hit rate is the aggregate one: hit tokens over queried tokens, each the sum over instances of the
counter's change during the run. Figures a server did not give are None, and so is anything built on them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from mtpserve.bench.prefix_client import HITS, QUERIES
from mtpserve.bench.prefix_report import number, ratio

SUCCESS = "vllm:request_success_total"  # an instance's finished requests (summed over finish reasons)
PREEMPTIONS = "vllm:num_preemptions_total"  # running requests preempted to free KV blocks
HIT_RATE_GOAL = 1.8  # cache_aware's aggregate hit rate over round_robin's
BASELINE, CANDIDATE = "round_robin", "cache_aware"

Scrape = dict[str, float | None]


def delta(before: Scrape, after: Scrape, name: str) -> float | None:
    b, a = before.get(name), after.get(name)
    return None if a is None or b is None else a - b


def instance_figures(url: str, before: Scrape, after: Scrape) -> dict:
    """One instance over one run: requests finished, tokens queried and hit, its hit rate, preemptions."""
    queried, hits = delta(before, after, QUERIES), delta(before, after, HITS)
    return {"url": url, "requests": delta(before, after, SUCCESS), "queried_tokens": queried, "hit_tokens": hits,
            "hit_rate": ratio(hits, queried), "preemptions": delta(before, after, PREEMPTIONS)}


def policy_row(policy: str, summary: dict, instances: Sequence[dict], decisions: dict[str, float]) -> dict:
    """One policy's run: `summary` is bench serve's (serve_report.summarize), `instances` instance_figures
    per instance, `decisions` the router's policy decisions by reason during the run ({} when unknown)."""
    queried = _sum(i["queried_tokens"] for i in instances)
    hits = _sum(i["hit_tokens"] for i in instances)
    requests = [i["requests"] for i in instances]
    known = [r for r in requests if r is not None]
    return {"policy": policy, "requests": summary["completed"] + summary["failed"], "failed": summary["failed"],
            "queried_tokens": queried, "hit_tokens": hits, "hit_rate": ratio(hits, queried),
            "ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "output_tok_s": summary["output_throughput"], "duration_s": summary["duration_s"],
            "request_split": requests, "largest_share": max(known) / sum(known) if known and sum(known) else None,
            "instances": list(instances), "decisions": decisions, "summary": summary}


def goals(rows: Sequence[dict]) -> dict:
    """The issue's goals as measured ratios (nothing is asserted): cache_aware's hit rate over round_robin's
    (at least HIT_RATE_GOAL), and round_robin's TTFT p50 over cache_aware's (above 1: cache_aware lower).
    None when either policy was not run or a figure is unknown."""
    by_policy = {row["policy"]: row for row in rows}
    base, cand = by_policy.get(BASELINE), by_policy.get(CANDIDATE)
    hit = ratio(cand["hit_rate"], base["hit_rate"]) if base and cand else None
    ttft = ratio(base["ttft_p50_ms"], cand["ttft_p50_ms"]) if base and cand else None
    return {"hit_rate_ratio": hit, "hit_rate_goal": HIT_RATE_GOAL,
            "hit_rate_met": None if hit is None else hit >= HIT_RATE_GOAL,
            "ttft_p50_ratio": ttft, "ttft_p50_met": None if ttft is None else ttft > 1.0}


def capacity(kv_blocks: int | None, block_size: int | None, prefix_tokens: Sequence[int], num_prefixes: int,
             num_instances: int) -> dict:
    """How many of the `num_prefixes` shared prefixes (`prefix_tokens`: the lengths of those measured) one
    instance's KV cache holds (the running requests' own blocks not counted), and whether the comparison
    means anything: only when one instance cannot hold them all, so that which instance a prefix goes to
    decides whether it is still cached."""
    known = kv_blocks is not None and block_size and prefix_tokens
    per_prefix = math.ceil(max(prefix_tokens) / block_size) if known and block_size else None
    fit = kv_blocks // per_prefix if kv_blocks is not None and per_prefix else None
    return {"kv_blocks": kv_blocks, "block_size": block_size, "num_prefixes": num_prefixes,
            "prefix_tokens_max": max(prefix_tokens, default=None),
            "prefix_tokens_min": min(prefix_tokens, default=None), "blocks_per_prefix": per_prefix,
            "prefixes_per_instance": fit, "all_fit_one_instance": None if fit is None else fit >= num_prefixes,
            "share_fits_one_instance": None if fit is None else fit >= math.ceil(num_prefixes / num_instances)}


def labeled(text: str, name: str, label: str) -> dict[str, float]:
    """A metric's values summed by one label's value (Prometheus text format); {} when not exported."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} ([0-9.eE+-]+)$", text, re.M):
        key = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get(label, "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def labeled_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in sorted(after.items())}


def format_table(rows: Sequence[dict]) -> str:
    lines = [f"{'policy':<13} {'requests':>8} {'failed':>6} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'out tok/s':>9}  requests per instance",
             f"{'':<13} {'':>8} {'':>6} {'':>8} {'ms':>9} {'ms':>9}"]
    for r in rows:
        split = " / ".join(number(n, 0, 0) for n in r["request_split"])
        lines.append(f"{r['policy']:<13} {r['requests']:>8} {r['failed']:>6} {number(r['hit_rate'], 8, 3)} "
                     f"{number(r['ttft_p50_ms'], 9, 1)} {number(r['ttft_p99_ms'], 9, 1)} "
                     f"{number(r['output_tok_s'], 9, 1)}  {split}")
    for r in rows:
        rates = ", ".join(number(i["hit_rate"], 0, 3) for i in r["instances"])
        decisions = ", ".join(f"{reason} {count:.0f}" for reason, count in r["decisions"].items() if count)
        lines.append(f"{r['policy']}: hit rate per instance {rates}"
                     + (f"; router decisions: {decisions}" if decisions else ""))
    return "\n".join(lines)


def format_goals(g: dict) -> str:
    return "\n".join([
        f"hit rate {CANDIDATE} / {BASELINE}: {number(g['hit_rate_ratio'], 0, 2)}x (goal: at least "
        f"{g['hit_rate_goal']:g}x){_met(g['hit_rate_met'])}",
        f"TTFT p50 {BASELINE} / {CANDIDATE}: {number(g['ttft_p50_ratio'], 0, 2)}x (goal: above 1, {CANDIDATE} "
        f"lower){_met(g['ttft_p50_met'])}"])


def format_capacity(c: dict) -> str:
    if c["prefixes_per_instance"] is None:
        return (f"KV capacity of an instance unknown (blocks {c['kv_blocks']}, block size {c['block_size']}): "
                "whether one instance holds every prefix is not known")
    head = (f"KV cache of one instance: {c['kv_blocks']} blocks x {c['block_size']} tokens; a prefix is up to "
            f"{c['prefix_tokens_max']} tokens = {c['blocks_per_prefix']} blocks: room for "
            f"{c['prefixes_per_instance']} prefixes of the {c['num_prefixes']} (before the running requests' "
            "own blocks)")
    if c["all_fit_one_instance"]:
        return (head + f"\n  WARNING: one instance holds all {c['num_prefixes']} prefixes, so the policies differ "
                "only by their first misses; lower --num-kv-blocks for a meaningful comparison")
    if not c["share_fits_one_instance"]:
        return head + "\n  NOTE: not even an even share of the prefixes fits one instance: every policy evicts"
    return head + "; one instance cannot hold them all, the two together can: the comparison is meaningful"


def _met(met: bool | None) -> str:
    return "" if met is None else (": met" if met else ": NOT met")


def _sum(values) -> float | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)
