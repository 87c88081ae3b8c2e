"""The figures of `bench prefix`: medians per prefix length, the goal ratios, and the table.

A sample is one request's figures (prefix_client.Reply.figures) plus `kind`:
  miss        P+A, P never sent before;
  hit         P+B, right after the miss;
  miss_reset  P+B again after POST /reset_prefix_cache (only when the server has it): the hit's own
              prompt computed cold, with `same_as_hit` = {"output": bool, "acceptance": bool}.
The miss figures are the miss_reset samples' when there are any (like compared with like: the hits' own
prompts), else the plain misses'. Every figure a server did not give is None, and so is every median or
ratio built on it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

TTFT_GOAL = 10.0  # a hit on the longest prefix: TTFT at least this many times lower than a miss
ACCEPTANCE_GOAL = 1.0  # acceptance length on a hit / on a miss


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def summarize_length(length: int, samples: list[dict], cache: dict) -> dict:
    """One prefix length's row: medians of its samples, the ratios, and `cache` (prefix_client.hit_rate
    over its measured requests) with the hit rate those requests allow at most."""
    ok = [s for s in samples if s["ok"]]
    miss_kind = "miss_reset" if any(s["kind"] == "miss_reset" for s in samples) else "miss"
    misses, hits = [s for s in ok if s["kind"] == miss_kind], [s for s in ok if s["kind"] == "hit"]
    pairs = [s["same_as_hit"] for s in ok if s["kind"] == "miss_reset"]
    figures: dict[str, float | None] = {}
    for name in ("ttft_ms", "decode_tok_s", "acceptance_length"):
        figures[f"{name}_miss"] = median(s[name] for s in misses)
        figures[f"{name}_hit"] = median(s[name] for s in hits)
    sent = sum(s["prompt_tokens_sent"] for s in samples)
    return {"prefix_tokens": length, "requests": len(samples), "failed": len(samples) - len(ok),
            "miss_kind": miss_kind, **figures, "ttft_speedup": ratio(figures["ttft_ms_miss"], figures["ttft_ms_hit"]),
            "acceptance_ratio": ratio(figures["acceptance_length_hit"], figures["acceptance_length_miss"]),
            "cached_tokens_hit": median(s["cached_tokens"] for s in hits),
            "same_prompt_pairs": len(pairs), "equal_output": sum(p["output"] for p in pairs),
            "equal_acceptance": sum(p["acceptance"] for p in pairs),
            **cache, "hit_rate_bound": length * len(hits) / sent if sent else None}


def goals(rows: list[dict]) -> dict:
    """The issue's goals as measured ratios (nothing is asserted): the longest prefix's TTFT miss/hit,
    and acceptance hit/miss per length."""
    longest = max(rows, key=lambda r: r["prefix_tokens"])
    return {"ttft_speedup": {"prefix_tokens": longest["prefix_tokens"], "ratio": longest["ttft_speedup"],
                             "goal": TTFT_GOAL},
            "acceptance_ratio": {str(r["prefix_tokens"]): r["acceptance_ratio"] for r in rows},
            "acceptance_goal": ACCEPTANCE_GOAL,
            "same_prompt": {"pairs": sum(r["same_prompt_pairs"] for r in rows),
                            "equal_output": sum(r["equal_output"] for r in rows),
                            "equal_acceptance": sum(r["equal_acceptance"] for r in rows)}}


def format_table(rows: list[dict]) -> str:
    head = (f"{'prefix':>6} {'TTFT miss':>10} {'TTFT hit':>9} {'miss/hit':>8} {'tok/s miss':>10} {'tok/s hit':>9} "
            f"{'acc miss':>8} {'acc hit':>7} {'hit/miss':>8} {'cached':>6} {'hit rate':>8} {'bound':>6} {'failed':>6}")
    lines = [head, f"{'tokens':>6} {'ms':>10} {'ms':>9}"]
    for r in rows:
        lines.append(f"{r['prefix_tokens']:>6} {number(r['ttft_ms_miss'], 10, 1)} {number(r['ttft_ms_hit'], 9, 1)} "
                     f"{number(r['ttft_speedup'], 7, 2)}x {number(r['decode_tok_s_miss'], 10, 1)} "
                     f"{number(r['decode_tok_s_hit'], 9, 1)} {number(r['acceptance_length_miss'], 8, 3)} "
                     f"{number(r['acceptance_length_hit'], 7, 3)} {number(r['acceptance_ratio'], 8, 3)} "
                     f"{number(r['cached_tokens_hit'], 6, 0)} {number(r['hit_rate'], 8, 3)} "
                     f"{number(r['hit_rate_bound'], 6, 3)} {r['failed']:>6}")
    return "\n".join(lines)


def format_goals(g: dict) -> str:
    speedup = g["ttft_speedup"]
    acceptance = ", ".join(f"{length}: {number(value, 0, 3)}" for length, value in g["acceptance_ratio"].items())
    same = g["same_prompt"]
    lines = [f"TTFT miss/hit at {speedup['prefix_tokens']} tokens: {number(speedup['ratio'], 0, 2)}x "
             f"(goal: at least {speedup['goal']:g}x)",
             f"acceptance hit/miss: {acceptance} (goal: {g['acceptance_goal']:.3f})"]
    if same["pairs"]:
        lines.append(f"the hit's prompt computed cold after a reset: equal output {same['equal_output']}/"
                     f"{same['pairs']}, equal acceptance {same['equal_acceptance']}/{same['pairs']}")
    else:
        lines.append("POST /reset_prefix_cache unavailable (no such endpoint, or refused: --api-key?): hits were "
                     "not compared with their own prompt computed cold")
    return "\n".join(lines)


def number(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
