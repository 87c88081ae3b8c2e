"""`mtpserve bench peer`: mtpserve against llama.cpp on the same weights, rerunnable end to end.

1. convert the model's main decoder to GGUF, F32 and Q8_0, into the cache directory (peer_gguf.py);
2. set llama.cpp up there: llama-server and llama-cpp-python's server (peer_llama.py; each step is
   skipped when its output exists);
3. start every server asked for, plus llama.cpp F32 and mtpserve k=2 when the checks run;
4. check that llama.cpp tokenizes the benchmark's prompts as mtpserve does (stop if not);
5. check greedy equality, llama.cpp F32 against mtpserve k=2: token for token, and at a divergence the
   top-2 logprob gap mtpserve saw there (a near-tie explains it);
6. run `mtpserve bench serve`'s levels (its client, in-process) against every server: per output
   length and concurrency the servers take turns, each level starting with the next one;
7. print output tok/s, TPOT p50 and TTFT p50 with the ratio to llama.cpp F32; write JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import aiohttp
import gguf

from mtpserve.bench import serve as serve_bench
from mtpserve.bench.peer_gguf import write_gguf
from mtpserve.bench.peer_llama import (LlamaCache, llama_greedy, llama_tokenize, setup, start_llama_server,
                                       start_python_server)
from mtpserve.bench.serve_dataset import make_prompts
from mtpserve.bench.serve_launch import Instance, stop_all
from mtpserve.bench.serve_report import format_run
from mtpserve.instance import BUNDLED_MODEL
from mtpserve.tokenizer import Tokenizer


class Server(NamedTuple):
    label: str
    kind: str  # "llama-server", "llama-cpp-python" or "mtpserve"
    setting: str  # the GGUF's quantization, or mtpserve's flags


SERVERS = {s.label: s for s in (
    Server("llama-f32", "llama-server", "F32"),
    Server("llama-q8", "llama-server", "Q8_0"),
    Server("llamapy-f32", "llama-cpp-python", "F32"),
    Server("mtp-k0", "mtpserve", "--num-speculative-tokens 0 --speculative-adaptive false"),
    Server("mtp-k2", "mtpserve", "--num-speculative-tokens 2 --speculative-adaptive false"),
    # NOTE: llama.cpp keeps its KV cache in F16 by default (-ctk/-ctv f16); this is mtpserve doing the same
    Server("mtp-k2-kv16", "mtpserve", "--num-speculative-tokens 2 --speculative-adaptive false "
           "--kv-cache-dtype float16"),
    Server("mtp-adaptive", "mtpserve", "--num-speculative-tokens 3"),
)}
REFERENCE, CHECKED = "llama-f32", "mtp-k2"  # the checks compare these two; ratios are to REFERENCE
QTYPES = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


class CheckFailed(RuntimeError):
    """The servers do not see the same tokens, so their figures would not be comparable."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("peer", help="mtpserve against llama.cpp (llama-server, llama-cpp-python) on "
                              "the same weights: GGUF conversion, build, checks, `bench serve` levels")
    p.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS), metavar="LABEL",
                   help="any of: " + "; ".join(f"{s.label} ({s.kind} {s.setting})" for s in SERVERS.values()))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--output-len", type=int, nargs="+", default=[128, 512])
    p.add_argument("--num-prompts", type=int, default=64, help="requests per level (the `code` dataset)")
    p.add_argument("--input-len", type=int, default=128, help="approximate prompt tokens")
    p.add_argument("--warmup", type=int, default=2, help="requests sent before each level, not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy-prompts", type=int, default=20)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--skip-checks", action="store_true", help="no tokenizer or greedy check")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (generation and batch)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs when building llama.cpp")
    p.add_argument("--model-dir", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--cache-dir", type=Path, default=Path("build/peer"),
                   help="GGUF files, the llama.cpp sdist, its venv and build, server logs")
    p.add_argument("--setup-only", action="store_true", help="convert and build, then stop")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=Path("peer-bench.json"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cache = LlamaCache(args.cache_dir)
    ggufs = {name: write_gguf(args.model_dir, args.cache_dir / f"{args.model_dir.name}-{name}.gguf", qtype)
             for name, qtype in QTYPES.items()}
    labels = _with_checked(args.servers, args.skip_checks)
    kinds = {SERVERS[label].kind for label in labels}
    build_s = setup(cache, "llama-cpp-python" in kinds, "llama-server" in kinds, args.jobs)
    print(f"GGUF: {', '.join(str(p) for p in ggufs.values())}; build seconds: {build_s}", flush=True)
    if args.setup_only:
        return 0
    report = {"benchmark": "peer", "config": _config(args), "gguf": {k: str(p) for k, p in ggufs.items()},
              "build_seconds": build_s}
    try:
        report |= asyncio.run(compare(args, cache, ggufs, labels))
    except CheckFailed as exc:
        print(f"mtpserve bench peer: stopped: {exc}", flush=True)
        return 1
    finally:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"JSON: {args.out}")
    return 0 if all(r["summary"]["failed"] == 0 for r in report["runs"]) else 1


def _with_checked(labels: list[str], skip_checks: bool) -> list[str]:
    return labels if skip_checks else [*dict.fromkeys([REFERENCE, *labels, CHECKED])]


async def compare(args: argparse.Namespace, cache: LlamaCache, ggufs: dict[str, Path], labels: list[str]) -> dict:
    instances = start_servers(args, cache, ggufs, labels)
    report: dict = {"servers": {label: _command(instance) for label, instance in instances.items()}}
    try:
        async with serve_bench._session(_serve_args(args)) as session:
            if not args.skip_checks:
                tokenizer = Tokenizer.from_model_dir(args.model_dir)
                report["checks"] = await run_checks(session, args, tokenizer, instances)
            report["runs"] = await run_levels(session, args, {label: instances[label] for label in args.servers})
    finally:
        stop_all(list(instances.values()))
    report["table"] = table(report["runs"], args.servers)
    print(format_table(report["table"]), flush=True)
    return report


def start_servers(args: argparse.Namespace, cache: LlamaCache, ggufs: dict[str, Path],
                  labels: list[str]) -> dict[str, Instance]:
    """Every server up at once (so each level visits them in turn), healthy before anything is sent."""
    slots, slot_context = max(args.concurrency), max(args.output_len) + 8 * args.input_len
    instances: dict[str, Instance] = {}
    try:
        for label in labels:
            server = SERVERS[label]
            if server.kind == "llama-server":
                instance = start_llama_server(label, cache, ggufs[server.setting], args.threads, slots, slot_context)
            elif server.kind == "llama-cpp-python":
                instance = start_python_server(label, cache, ggufs[server.setting], args.threads, slot_context)
            else:
                instance = Instance.start(f"{label}={server.setting}")
            instances[label] = instance
        for instance in instances.values():
            instance.wait_healthy()
    except BaseException:
        stop_all(list(instances.values()))
        raise
    return instances


async def run_checks(session: aiohttp.ClientSession, args: argparse.Namespace, tokenizer: Tokenizer,
                     instances: dict[str, Instance]) -> dict:
    reference, checked = instances[REFERENCE].url, instances[CHECKED].url
    prompts = make_prompts(_serve_args(args, num_prompts=max(args.num_prompts, args.greedy_prompts)))
    tokens = await check_tokenizer(session, reference, tokenizer, prompts)
    print(f"tokenizer: llama.cpp and mtpserve agree on {tokens['agree']}/{tokens['prompts']} prompts", flush=True)
    if tokens["disagreements"]:
        raise CheckFailed(f"tokenizers differ: {tokens['disagreements'][:3]} (GGUF metadata or pre-tokenizer?)")
    greedy = await check_greedy(session, reference, checked, tokenizer, prompts[:args.greedy_prompts],
                                args.greedy_tokens)
    print(format_greedy(greedy), flush=True)
    return {"tokenizer": tokens, "greedy": greedy}


async def check_tokenizer(session: aiohttp.ClientSession, url: str, tokenizer: Tokenizer,
                          prompts: list[str]) -> dict:
    """llama-server's /tokenize against mtpserve's tokenizer, prompt by prompt."""
    disagreements = []
    for index, text in enumerate(prompts):
        theirs = await llama_tokenize(session, url, text)
        ours = tokenizer.encode(text)
        if theirs != ours:
            at = first_difference(ours, theirs)
            disagreements.append({"prompt": index, "position": at, "mtpserve": ours[at:at + 3],
                                  "llama.cpp": theirs[at:at + 3]})
    return {"prompts": len(prompts), "agree": len(prompts) - len(disagreements), "disagreements": disagreements}


async def check_greedy(session: aiohttp.ClientSession, reference: str, checked: str, tokenizer: Tokenizer,
                       prompts: list[str], max_tokens: int) -> dict:
    """Both servers get the same prompt ids and stop at EOS; a trailing EOS is dropped on both sides (one
    may return it, the other not). Tokens are compared as mtpserve's logprobs name them: each id decoded
    alone. NOTE: a few ids share a text (byte fragments of a UTF-8 character all decode to U+FFFD), so a
    position where both sides show such a text is counted as unresolved: equal as text, maybe not as id."""
    eos = None if tokenizer.eos_token_id is None else _token_texts(tokenizer, [tokenizer.eos_token_id])[0]
    shared = shared_texts(tokenizer)
    rows = []
    for index, text in enumerate(prompts):
        ids = tokenizer.encode(text)
        theirs = _token_texts(tokenizer, await llama_greedy(session, reference, ids, max_tokens))
        ours, tops = await _mtpserve_greedy(session, checked, ids, max_tokens)
        ours, theirs = _without_eos(ours, eos), _without_eos(theirs, eos)
        at = first_difference(ours, theirs)
        row = {"prompt": index, "tokens": len(ours), "equal": ours == theirs,
               "unresolved": sum(a == b and a in shared for a, b in zip(ours, theirs))}
        if not row["equal"]:
            row |= {"position": at, "mtpserve": _at(ours, at), "llama.cpp": _at(theirs, at),
                    "top2_gap": top2_gap(tops[at]) if at < len(tops) else None}
        rows.append(row)
    return {"prompts": len(rows), "max_tokens": max_tokens, "equal": sum(r["equal"] for r in rows),
            "unresolved": sum(r["unresolved"] for r in rows), "rows": rows}


async def _mtpserve_greedy(session: aiohttp.ClientSession, url: str, ids: list[int],
                           max_tokens: int) -> tuple[list[str], list[dict[str, float]]]:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 2}
    logprobs = (await _post(session, f"{url}/v1/completions", body))["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["top_logprobs"]


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        return await resp.json()


def shared_texts(tokenizer: Tokenizer) -> set[str]:
    """Texts that more than one id decodes to alone."""
    texts = _token_texts(tokenizer, list(range(tokenizer.inner.get_vocab_size())))
    return {text for text, n in collections.Counter(texts).items() if n > 1}


def _token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    # NOTE: as mtpserve's HTTP process names tokens in logprobs (server/text_model.py, decode_each)
    return tokenizer.inner.decode_batch([[i] for i in ids], skip_special_tokens=False)


def _without_eos(texts: list[str], eos: str | None) -> list[str]:
    return texts[:-1] if texts and eos is not None and texts[-1] == eos else texts


def _at(texts: list[str], position: int) -> str | None:
    return texts[position] if position < len(texts) else None


def first_difference(a: list, b: list) -> int:
    """The first position where a and b differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_gap(top: dict[str, float]) -> float | None:
    """Logprob of the best token minus the second best (None with fewer than two)."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) >= 2 else None


def format_greedy(greedy: dict) -> str:
    lines = [f"greedy: {greedy['equal']}/{greedy['prompts']} prompts token-for-token equal over "
             f"{greedy['max_tokens']} tokens (llama.cpp F32 vs mtpserve k=2); {greedy['unresolved']} equal "
             f"positions show a text several ids share"]
    for r in (r for r in greedy["rows"] if not r["equal"]):
        gap = "n/a" if r["top2_gap"] is None else f"{r['top2_gap']:.4f}"
        lines.append(f"  prompt {r['prompt']}: first differs at token {r['position']} "
                     f"(mtpserve {r['mtpserve']!r}, llama.cpp {r['llama.cpp']!r}), mtpserve top-2 gap {gap}")
    return "\n".join(lines)


async def run_levels(session: aiohttp.ClientSession, args: argparse.Namespace,
                     instances: dict[str, Instance]) -> list[dict]:
    """`bench serve`'s run_level per output length × concurrency × server, the servers in turn."""
    prompts = make_prompts(_serve_args(args))
    models = {label: await _model_name(session, instance.url) for label, instance in instances.items()}
    labels, runs, turn = list(instances), [], 0
    for output_len in args.output_len:
        for concurrency in args.concurrency:
            # NOTE: each level starts with the next server, so no server always runs first
            for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
                level = _serve_args(args, instances[label].url, output_len)
                summary = await serve_bench.run_level(session, level, models[label], prompts, concurrency)
                print(format_run(f"{label} concurrency {concurrency} output {output_len}", summary), flush=True)
                runs.append({"label": label, "concurrency": concurrency, "output_len": output_len,
                             "summary": summary})
            turn += 1
    return runs


def _serve_args(args: argparse.Namespace, base_url: str = "", output_len: int | None = None,
                num_prompts: int | None = None) -> argparse.Namespace:
    """`mtpserve bench serve`'s own arguments (its defaults: completions, temperature 0, ignore_eos, burst)."""
    parser = argparse.ArgumentParser()
    serve_bench.add_parser(parser.add_subparsers())
    argv = ["serve", "--base-url", base_url, "--dataset", "code", "--num-prompts",
            str(num_prompts or args.num_prompts), "--input-len", str(args.input_len), "--output-len",
            str(output_len or args.output_len[0]), "--seed", str(args.seed), "--warmup", str(args.warmup),
            "--no-keepalive"]  # every server alike: llama-server drops kept-alive connections mid-run
    return parser.parse_args(argv + (["--no-progress"] if args.no_progress else []))


def _command(instance: Instance) -> str:
    argv = instance.proc.args  # what Popen was given (a list, here)
    if isinstance(argv, (str, bytes, os.PathLike)):
        return os.fsdecode(argv)
    return " ".join(os.fsdecode(a) for a in argv)


async def _model_name(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


def table(runs: list[dict], labels: list[str]) -> list[dict]:
    """One row per server × concurrency × output length, with output tok/s over llama.cpp F32's."""
    reference = {(r["output_len"], r["concurrency"]): r["summary"]["output_throughput"]
                 for r in runs if r["label"] == REFERENCE}
    rows = []
    for r in sorted(runs, key=lambda r: (r["output_len"], r["concurrency"], labels.index(r["label"]))):
        s, base = r["summary"], reference.get((r["output_len"], r["concurrency"]))
        rows.append({"output_len": r["output_len"], "concurrency": r["concurrency"], "label": r["label"],
                     "output_throughput": s["output_throughput"], "tpot_p50_ms": s["tpot_ms"]["p50"],
                     "ttft_p50_ms": s["ttft_ms"]["p50"],
                     "tokens_per_request": s["total_output_tokens"] / max(s["completed"], 1),
                     "failed": s["failed"], "ratio_to_llama_f32": s["output_throughput"] / base if base else None})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'out len':>7} {'conc':>4} {'server':<13} {'out tok/s':>9} {'TPOT p50':>9} {'TTFT p50':>9} "
             f"{'tok/req':>7} {'failed':>6} {'/llama-f32':>10}"]
    for r in rows:
        ratio = "-" if r["ratio_to_llama_f32"] is None else f"{r['ratio_to_llama_f32']:.2f}"
        lines.append(f"{r['output_len']:>7} {r['concurrency']:>4} {r['label']:<13} {r['output_throughput']:>9.1f} "
                     f"{_ms(r['tpot_p50_ms']):>9} {_ms(r['ttft_p50_ms']):>9} {r['tokens_per_request']:>7.1f} "
                     f"{r['failed']:>6} {ratio:>10}")
    return "\n".join(lines + ["(TPOT, TTFT: ms)"])


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _config(args: argparse.Namespace) -> dict:
    keep = ("servers", "concurrency", "output_len", "num_prompts", "input_len", "warmup", "seed",
            "greedy_prompts", "greedy_tokens", "skip_checks", "threads")
    return {k: getattr(args, k) for k in keep} | {"model_dir": str(args.model_dir)}


def main(argv: list[str] | None = None) -> int:
    """`python -m mtpserve.bench.peer ARGS`: the same as `mtpserve bench peer ARGS`."""
    parser = argparse.ArgumentParser(prog="mtpserve bench")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["peer", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
