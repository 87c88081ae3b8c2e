"""The figures of `bench chat`: one configuration's summary, the side-by-side comparison, the table.

A sample is one turn's figures (prefix_client.Reply.figures) plus `conversation`, `turn` and
`answer_sha1`. Figures a server did not give are None, and so is anything built on them.
"""

from __future__ import annotations

import numpy as np

from mtpserve.bench.prefix_report import median, number, ratio


def percentile(values: list[float | None], p: float) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.percentile(known, p)) if known else None


def summarize_chat(samples: list[dict], duration_s: float, cache: dict) -> dict:
    """TTFT over all turns and per turn, output tok/s over the run's wall time, the share of prompt tokens
    the usage says were cached, and `cache` (prefix_client.hit_rate over the run)."""
    ok = [s for s in samples if s["ok"]]
    ttft = [s["ttft_ms"] for s in ok]
    turns = sorted({s["turn"] for s in samples})
    last = [s["prompt_tokens"] for s in ok if s["turn"] == turns[-1]] if turns else []
    output = sum(s["completion_tokens"] or 0 for s in ok)
    prompt = sum(s["prompt_tokens"] or 0 for s in ok)
    cached = None if any(s["cached_tokens"] is None for s in ok) else sum(s["cached_tokens"] for s in ok)
    return {"requests": len(samples), "failed": len(samples) - len(ok), "duration_s": duration_s,
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "mean": _mean(ttft)},
            "ttft_p50_ms_by_turn": [percentile([s["ttft_ms"] for s in ok if s["turn"] == t], 50) for t in turns],
            "output_tokens": output, "output_tok_s": output / duration_s if duration_s > 0 else None,
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": ratio(cached, prompt),
            "last_turn_prompt_tokens": {"median": median(last), "max": max((v for v in last if v), default=None)},
            **cache}


def compare(results: list[dict]) -> list[dict]:
    """Each configuration against the first: TTFT p50/p99 and output tok/s as ratios (this / first), and
    how many of its answers equal the first's (same seed and greedy: all of them, if caching is exact)."""
    first = results[0]
    answers = {(s["conversation"], s["turn"]): s["answer_sha1"] for s in first["samples"] if s["ok"]}
    rows = []
    for result in results[1:]:
        mine, base = result["summary"], first["summary"]
        same = [answers.get((s["conversation"], s["turn"])) == s["answer_sha1"] for s in result["samples"] if s["ok"]]
        rows.append({"label": result["label"], "against": first["label"],
                     "ttft_p50_ratio": ratio(mine["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                     "ttft_p99_ratio": ratio(mine["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
                     "output_tok_s_ratio": ratio(mine["output_tok_s"], base["output_tok_s"]),
                     "equal_answers": sum(same), "answers": len(same)})
    return rows


def format_table(results: list[dict], comparison: list[dict]) -> str:
    lines = [f"{'config':<14} {'turns':>5} {'failed':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9} "
             f"{'hit rate':>8} {'cached':>7} {'last prompt':>11}",
             f"{'':<14} {'':>5} {'':>6} {'ms':>9} {'ms':>9}"]
    for r in results:
        s = r["summary"]
        lines.append(f"{r['label']:<14} {s['requests']:>5} {s['failed']:>6} {number(s['ttft_ms']['p50'], 9, 1)} "
                     f"{number(s['ttft_ms']['p99'], 9, 1)} {number(s['output_tok_s'], 9, 1)} "
                     f"{number(s['hit_rate'], 8, 3)} {number(s['cached_share'], 7, 3)} "
                     f"{number(s['last_turn_prompt_tokens']['median'], 11, 0)}")
    for r in results:
        by_turn = ", ".join(f"{turn + 1}: {number(ms, 0, 1)}"
                            for turn, ms in enumerate(r["summary"]["ttft_p50_ms_by_turn"]))
        lines.append(f"{r['label']}: TTFT p50 by turn (ms) {by_turn}")
    for c in comparison:
        lines.append(f"{c['label']} / {c['against']}: TTFT p50 {number(c['ttft_p50_ratio'], 0, 2)}x, "
                     f"p99 {number(c['ttft_p99_ratio'], 0, 2)}x, "
                     f"output tok/s {number(c['output_tok_s_ratio'], 0, 2)}x; "
                     f"answers equal {c['equal_answers']}/{c['answers']}")
    return "\n".join(lines)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None

