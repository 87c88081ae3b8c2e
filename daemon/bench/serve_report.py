"""Aggregates of one benchmark run (vllm/sglang bench conventions), the table, and the PNG plots."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mtpserve.bench.serve_client import RequestResult

PERCENTILES = (50, 90, 95, 99)
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def parse_counters(text: str, names: tuple[str, ...] = SPEC_COUNTERS) -> dict[str, float]:
    """Sum each counter over its label sets (Prometheus text format)."""
    out = {}
    for name in names:
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = sum(map(float, values))
    return out


def parse_chosen_drafts(text: str) -> dict[str, float]:
    """mtpserve's histogram of the drafts its policy gave each row: cumulative counts by `le`."""
    found = re.findall(r'^mtpserve:spec_decode_chosen_drafts_bucket{le="([0-9]+)(?:\.0)?"[^}]*} ([0-9.eE+-]+)$', text, re.M)
    return {f"chosen_le_{le}": float(value) for le, value in found}


def chosen_shares(before: dict[str, float], after: dict[str, float]) -> list[float] | None:
    """Share of rows given k = 0, 1, ... drafts between two scrapes; None where the server has no policy."""
    cumulative = []
    for k in range(64):
        key = f"chosen_le_{k}"
        if key not in after:
            break
        cumulative.append(after[key] - before.get(key, 0.0))
    if not cumulative or cumulative[-1] <= 0:
        return None
    counts = np.diff(np.array([0.0, *cumulative]))
    return (counts / cumulative[-1]).tolist()


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "std": float(arr.std()),
            **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean acceptance length = 1 + accepted drafts per draft round, from counter deltas."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = (d[k] for k in SPEC_COUNTERS)
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "chosen_drafts_share": chosen_shares(before, after)}


def prefix_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Share of the prompt tokens looked up in the prefix cache whose KV it held, between two scrapes; None
    where the server exports no such counters or looked nothing up."""
    queries, hits = (after.get(k, 0.0) - before.get(k, 0.0) for k in PREFIX_COUNTERS)
    return hits / queries if queries > 0 else None


def summarize(results: list[RequestResult], duration: float, spec: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "tokens_per_chunk": out_tokens / max(sum(r.num_chunks for r in ok), 1),
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
        "spec_decode": spec,
    }


def format_run(label: str, s: dict) -> str:
    def row(name: str, key: str) -> str:
        st = s[key]
        if st["mean"] is None:
            return f"  {name:<6} n/a"
        return f"  {name:<6} mean {st['mean']:9.2f}  p50 {st['p50']:9.2f}  p90 {st['p90']:9.2f}  p99 {st['p99']:9.2f}"

    acc = s["spec_decode"].get("acceptance_length")
    lines = [f"== {label}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f}s",
             f"  req/s {s['request_throughput']:.2f}  out tok/s {s['output_throughput']:.1f}  "
             f"total tok/s {s['total_token_throughput']:.1f}  tokens/chunk {s['tokens_per_chunk']:.2f}  "
             f"acceptance length {acc:.3f}" if acc else
             f"  req/s {s['request_throughput']:.2f}  out tok/s {s['output_throughput']:.1f}  "
             f"total tok/s {s['total_token_throughput']:.1f}  tokens/chunk {s['tokens_per_chunk']:.2f}",
             *([f"  drafts chosen (share of rows, k = 0, 1, ...): "
                + " ".join(f"{share:.0%}" for share in s["spec_decode"]["chosen_drafts_share"])]
               if s["spec_decode"].get("chosen_drafts_share") else []),
             *([f"  prefix cache hits: {s['prefix_cache_hit_rate']:.1%} of prompt tokens"]
               if s.get("prefix_cache_hit_rate") is not None else []),
             *([f"  server CPU {s['server_cpu_s']:.2f}s = {s['server_cpu_us_per_token']:.1f} us/token"]
               if "server_cpu_s" in s else []),
             "  (ms)", row("TTFT", "ttft_ms"), row("TPOT", "tpot_ms"), row("ITL", "itl_ms"), row("E2E", "e2el_ms")]
    return "\n".join(lines)


def plot(runs: list[dict], out_dir: Path) -> list[str]:
    """Throughput and latency vs concurrency; [] when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    xs = [r["concurrency"] for r in runs]
    paths = [_plot_throughput(plt, runs, xs, out_dir / "serve-throughput.png"),
             _plot_latency(plt, runs, xs, out_dir / "serve-latency.png")]
    return [str(p) for p in paths]


def _plot_throughput(plt, runs: list[dict], xs: list, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["summary"]["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.plot(xs, [r["summary"]["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    ax.set(xscale="log", xlabel="concurrency", ylabel="tokens / s", title="mtpserve bench serve: throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_latency(plt, runs: list[dict], xs: list, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    metrics = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))
    for (key, label), color in zip(metrics, ("C0", "C1", "C2", "C3")):
        ax.plot(xs, [r["summary"][key]["p50"] for r in runs], "o-", color=color, label=f"{label} p50")
        ax.plot(xs, [r["summary"][key]["p99"] for r in runs], "x:", color=color, label=f"{label} p99")
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency percentiles")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_compare(reports: dict[str, dict], path: Path) -> str | None:
    """Several runs' JSON (label -> report) side by side: throughput and TPOT/TTFT vs concurrency."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for (label, report), color in zip(reports.items(), [f"C{i}" for i in range(10)]):
        xs = [r["concurrency"] for r in report["runs"]]
        left.plot(xs, [r["summary"]["output_throughput"] for r in report["runs"]], "o-", color=color, label=label)
        right.plot(xs, [r["summary"]["tpot_ms"]["p50"] for r in report["runs"]], "o-", color=color,
                   label=f"{label} TPOT p50")
        right.plot(xs, [r["summary"]["ttft_ms"]["p50"] for r in report["runs"]], "x:", color=color,
                   label=f"{label} TTFT p50")
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens / s", title="throughput")
    right.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_launched(rows: list[dict], path: Path) -> str | None:
    """`bench serve --launch`'s comparison (serve_launch.comparison rows): each label's median output tok/s
    against concurrency, its visits as dots, and its ratio to the best other label: of the medians (solid)
    and paired by round (dashed)."""
    plt = _pyplot()
    if plt is None:
        return None
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, color in zip(labels, [f"C{i}" for i in range(10)]):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        left.plot(xs, [_nan(r["output_throughput"]) for r in mine], "o-", color=color, label=label)
        for r in mine:
            good = [v for i, v in enumerate(r["rounds"], 1) if i not in r.get("failed_rounds", ())]
            left.plot([r["concurrency"]] * len(good), good, ".", color=color, alpha=0.4)
        right.plot(xs, [_nan(r["ratio_to_best_other"]) for r in mine], "o-", color=color, label=label)
        paired = [r.get("paired_to_best_other") for r in mine]  # absent from reports older than it
        if any(p is not None for p in paired):
            right.plot(xs, [_nan(p) for p in paired], "x--", color=color, alpha=0.6)
    right.axhline(1.0, color="grey", lw=0.8)
    right.axhline(0.95, color="grey", lw=0.8, ls=":")
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens / s (median of visits)", title="throughput")
    right.set(xscale="log", xlabel="concurrency", ylabel="/ best other label",
              title="ratio to the best other (medians; dashed: paired by round)")
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (left, right):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    return _save(plt, fig, path)


def _nan(value: float | None) -> float:
    """A figure to plot: a missing one (every visit failed) leaves a gap."""
    return float("nan") if value is None else value


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
