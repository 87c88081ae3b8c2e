"""Count the mtpserve modules each process of a running instance loads to serve one streamed completion.

    python scripts/count_modules.py [--out build/modules.json]

Starts `mtpserve serve` under `strace -f` (Debian's strace; only this script needs it), waits for
/health, streams one completion, stops the instance, and reads from the trace which mtpserve source
files each process opened (its .py or its cached .pyc), grouped by process: the HTTP process
(mtpserve.server.main), rank 0 (mtpserve.engine.rank_main --rank 0) and the launcher. Run it with
PYTHONPATH pointing at another checkout's package tree to count that checkout the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import mtpserve
import mtpserve.config
import mtpserve.ipc

# NOTE: with several threads strace splits a call ("<unfinished ...>" ... "resumed"); Python opens only
# a module file it has already found, so every open of one (not failed outright) counts.
OPEN = re.compile(r'^(\d+) +openat\(AT_FDCWD, "([^"]+)"(?!.*= -1 )')
EXEC = re.compile(r'^(\d+) +execve\("[^"]*", \[([^\]]*)\]')
THREAD = re.compile(r'^(\d+) +clone3?\(.*CLONE_THREAD.*\) = (\d+)')
PROCESS_NAMES = {"mtpserve.server.main": "http", "mtpserve.engine.rank_main": "rank", "mtpserve": "launcher"}


def package_roots() -> list[tuple[str, str]]:
    """(directory, package) pairs, longest directory first: mtpserve's subpackages live elsewhere."""
    roots = [(p, "mtpserve") for p in mtpserve.__path__]
    roots += [(p, "mtpserve.ipc") for p in mtpserve.ipc.__path__]
    roots += [(p, "mtpserve.config") for p in mtpserve.config.__path__]
    return sorted(roots, key=lambda r: -len(r[0]))


def module_of(path: str, roots: list[tuple[str, str]]) -> str | None:
    for directory, package in roots:
        if path.startswith(directory + "/"):
            rel = path[len(directory) + 1:]
            if not re.search(r"\.py$|\.cpython-\d+\.pyc$", rel):
                return None  # a directory listing, a bytecode temp file, a library
            rel = re.sub(r"\.cpython-\d+\.pyc$|\.py$", "", re.sub(r"(^|/)__pycache__/", r"\1", rel))
            parts = [p for p in rel.split("/") if p != "__init__"]
            return ".".join([package, *parts]) if parts else package
    return None


def process_kind(argv: str) -> str:
    if "mtpserve.engine.rank_main" in argv:
        return "rank0" if re.search(r'"--rank", "0"', argv) or "--rank" not in argv else "rank"
    for marker, kind in PROCESS_NAMES.items():
        if marker in argv:
            return kind
    return "other"


def parse(trace: Path, roots: list[tuple[str, str]]) -> dict[str, list[str]]:
    owner: dict[str, str] = {}  # thread id -> process id
    kind: dict[str, str] = {}
    modules: dict[str, set[str]] = defaultdict(set)
    for line in trace.read_text().splitlines():
        if m := THREAD.match(line):
            owner[m.group(2)] = owner.get(m.group(1), m.group(1))
        elif m := EXEC.match(line):
            kind[m.group(1)] = process_kind(m.group(2))
        elif m := OPEN.match(line):
            name = module_of(m.group(2), roots)
            if name is not None:
                modules[owner.get(m.group(1), m.group(1))].add(name)
    by_kind: dict[str, set[str]] = defaultdict(set)
    for pid, names in modules.items():
        by_kind[kind.get(pid, "other")] |= names
    return {k: sorted(v) for k, v in by_kind.items()}


def wait_ready(port: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the instance did not become healthy")


def stream_one(port: int) -> int:
    body = json.dumps({"prompt": "def parse_args(argv):", "max_tokens": 16, "stream": True,
                       "logprobs": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return sum(1 for line in r if line.startswith(b"data:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/modules.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace = Path(tempfile.mkdtemp()) / "strace.txt"
    cmd = ["strace", "-f", "-qq", "-e", "trace=openat,execve,clone,clone3", "-o", str(trace),
           sys.executable, "-m", "mtpserve.cli", "serve", "--port", str(port), "--instance", f"count{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        wait_ready(port)
        events = stream_one(port)
    finally:
        # NOTE: signal the launcher (strace's child), not strace: a killed strace only detaches.
        launcher = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in launcher:
            os.kill(int(pid), signal.SIGTERM)
        proc.wait(timeout=60)
    counts = parse(trace, package_roots())
    report = {"events": events, "counts": {k: len(v) for k, v in counts.items()}, "modules": counts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for kind, names in sorted(counts.items()):
        print(f"{kind:9s} {len(names):4d} mtpserve modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
