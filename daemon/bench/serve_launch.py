"""Instances `mtpserve bench serve --launch LABEL=ARGS` starts itself, so configurations are compared side
by side in one run: every instance is up for the whole run and each level visits them in turn, so a noisy
minute of the machine lands on all of them alike.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import typing
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Instance:
    label: str
    url: str
    proc: subprocess.Popen
    name: str  # the instance name (--instance): it keys the IPC objects
    health_path: typing.ClassVar[str] = "/health"  # answers 200 once the server serves

    @classmethod
    def start(cls, spec: str, log_path: Path | None = None) -> Instance:
        """spec: "LABEL=serve flags", e.g. "k0=--num-speculative-tokens 0 --speculative-adaptive false";
        leading NAME=VALUE words set that instance's environment, e.g. "traced=MTP_STEP_TRACE=/tmp/t
        --num-speculative-tokens 3" (another tree's package: PYTHONPATH=...); log_path: the instance's
        output is appended there (default: this process's)."""
        label, _, flags = spec.partition("=")
        env, args = instance_environment(shlex.split(flags))
        port, name = _free_port(), f"bench-{label}-{uuid.uuid4().hex[:6]}"
        argv = [sys.executable, "-m", "mtpserve.cli", "serve", "--port", str(port), "--instance", name,
                "--log-level", "warning", *args]
        # NOTE: every launch profiles its step costs afresh unless told otherwise: a relaunched round is
        # another draw of the whole start, and with a kept profile every round of an instance would plan
        # with the first one's (docs/speculation.md, "The profile kept for restarts")
        env = {PROFILE_CACHE_VAR: "off", **(os.environ if env is None else env)}
        return cls(label, f"http://127.0.0.1:{port}", popen_logged(argv, log_path, env), name)

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"instance {self.label} exited during start ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"instance {self.label} not healthy in {timeout_s} s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


PROFILE_CACHE_VAR = "MTPSERVE_SPECULATIVE_PROFILE_CACHE"  # speculative.profile_cache (config/loader.py)
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def instance_environment(words: list[str]) -> tuple[dict[str, str] | None, list[str]]:
    """The environment of an instance whose flags start with NAME=VALUE words (this process's, with those
    set; None if there are none), and its flags without them."""
    count = next((i for i, word in enumerate(words) if not _ASSIGNMENT.match(word)), len(words))
    if not count:
        return None, words
    return {**os.environ, **dict(word.split("=", 1) for word in words[:count])}, words[count:]


def popen_logged(argv: list[str], log_path: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `argv` (in `env`, None: this process's) with its stdout and stderr appended to `log_path`
    (None: inherited)."""
    if log_path is None:
        return subprocess.Popen(argv, env=env)
    with open(log_path, "ab") as log:  # NOTE: the child holds its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def start_all(specs: list[str], log_dir: Path | None = None) -> list[Instance]:
    """Every instance started and waited for, one after the other; log_dir: each one's output in
    `LABEL.log` there.

    NOTE: one at a time: an adaptive instance times its step costs at start-up (a profile of a few
    seconds, serving nobody); with the others starting beside it on the same cores it timed their
    contention instead, and planned with it for the whole run."""
    instances: list[Instance] = []
    try:
        for spec in specs:
            instances.append(Instance.start(spec, log_dir / f"{spec.partition('=')[0]}.log" if log_dir else None))
            instances[-1].wait_healthy()
    except BaseException:
        stop_all(instances)
        raise
    return instances


def stop_all(instances: list[Instance]) -> None:
    for instance in instances:
        instance.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def comparison(levels: dict[int, dict[str, list[dict]]], labels: list[str]) -> list[dict]:
    """Per concurrency and label (in `labels` order): the median output tok/s of its rounds, and its ratio
    to the first label's and to the best other's; and the paired ratio to the best other (paired_ratios).

    NOTE: a visit in which any request failed (an instance that died, say) measures the failure, not the
    configuration: it is left out of the medians and the pairs, and its round is listed in `failed_rounds`.
    Counted as its throughput, one k=1 rank's crash made its median at 64 streams a round of 0."""
    rows = []
    for concurrency, by_label in levels.items():
        rounds = {label: [s["output_throughput"] for s in by_label[label]] for label in labels}
        good = {label: [s["output_throughput"] if not s.get("failed") else None for s in by_label[label]]
                for label in labels}
        rates = {label: _median(values) for label, values in good.items()}
        first = rates[labels[0]]
        for label, rate in rates.items():
            others = [r for other, r in rates.items() if other != label and r is not None]
            rows.append({"concurrency": concurrency, "label": label, "output_throughput": rate,
                         "rounds": rounds[label],
                         "failed_rounds": [i + 1 for i, v in enumerate(good[label]) if v is None],
                         "ratio_to_first": rate / first if rate is not None and first else None,
                         "ratio_to_best_other": rate / max(others) if rate is not None and others and max(others)
                         else None,
                         "paired_to_best_other": paired_ratios(good, label),
                         "paired_interval": paired_interval(good, label)})
    return rows


def paired_ratios(rounds: dict[str, list[float | None]], label: str) -> float | None:
    """The lowest, over the other labels, of the median over rounds of label's rate / that label's rate in
    the same round (rounds where either visit failed, None, left out).

    NOTE: the host drifts by ±10-15% over a minute, and one round visits every label within one: a ratio
    taken inside a round cancels most of the drift that two medians of separate visits keep. Like
    ratio_to_best_other it takes the worst over the others (biased downwards by what noise is left), but of
    figures with less noise in them."""
    worst = _worst_pairs(rounds, label)
    return None if worst is None else statistics.median(worst)


MIN_INTERVAL_ROUNDS = 3  # NOTE: with two, the interval is the two ratios' range


def paired_interval(rounds: dict[str, list[float | None]], label: str, level: float = 0.9,
                    resamples: int = 2000) -> tuple[float, float] | None:
    """A `level` bootstrap interval of `paired_ratios` (the median of the rounds' ratios to the other label it
    is lowest against): the percentiles of that median over the rounds resampled with replacement; None
    with fewer than MIN_INTERVAL_ROUNDS pairs.

    NOTE: whether a gap is the configuration's or the host's: on the 2-vCPU hosts one configuration's rounds
    spread ±5-30%, and a paired ratio of 0.94 from three rounds (1.02, 0.93, 0.85) said little either way.
    Seeded, so that a report's figures can be computed again from its rounds."""
    worst = _worst_pairs(rounds, label)
    if worst is None or len(worst) < MIN_INTERVAL_ROUNDS:
        return None
    ratios = np.asarray(worst)
    picks = np.random.default_rng(0).integers(0, len(ratios), (resamples, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)



def _worst_pairs(rounds: dict[str, list[float | None]], label: str) -> list[float] | None:
    """label's rate / the other's in each round where both visits served, against the other label whose
    median ratio is the lowest; None where no round pairs."""
    mine = rounds[label]
    pairs = [[a / b for a, b in zip(mine, theirs) if a is not None and b]
             for other, theirs in rounds.items() if other != label]
    return min((p for p in pairs if p), key=statistics.median, default=None)


def _median(values: list[float | None] | list[float]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def format_comparison(rows: list[dict]) -> str:
    lines = [f"{'conc':>5} {'label':<14} {'out tok/s':>10} {'/first':>7} {'/best other':>11} {'paired':>7} "
             f"{'90% interval':>13}"]
    for r in rows:
        rate = "-" if r["output_throughput"] is None else f"{r['output_throughput']:.1f}"
        failed = r.get("failed_rounds")
        interval = r.get("paired_interval")
        lines.append(f"{r['concurrency']:>5} {r['label']:<14} {rate:>10} "
                     f"{_ratio(r['ratio_to_first']):>7} {_ratio(r['ratio_to_best_other']):>11} "
                     f"{_ratio(r['paired_to_best_other']):>7} "
                     f"{'-' if interval is None else f'{interval[0]:.3f}-{interval[1]:.3f}':>13}"
                     + (f"  (left out: round {', '.join(map(str, failed))}, requests failed)" if failed else ""))
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
