"""Run the real HTTP process (`python -m mtpserve.server.main`) against the fake engine, for measuring
the API process alone (e.g. with `mtpserve bench serve`) before the real engine is wired in.

Usage: python tests/server/fake_stack.py MODEL_DIR [--port 8011] [--step-ms 1] [--k 2]
MODEL_DIR without a tokenizer.json gets a freshly trained one (4096 tokens, ChatML template).
Prints the HTTP process's pid (for `mtpserve bench serve --server-pid`). Ctrl-C or SIGTERM stops all.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from server_harness import start_fake_engine, write_model_dir  # noqa: E402
from mtpserve.config import Config  # noqa: E402
from mtpserve.tokenizer import Tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--step-ms", default="1")
    parser.add_argument("--k", default="2")
    parser.add_argument("--max-model-len", default="4096")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # NOTE: SIGINT is ignored when started in the background
    with tempfile.TemporaryDirectory(prefix="mtpserve-fake-") as tmp:
        runtime = Path(tmp) / "rt"
        if not (args.model_dir / "tokenizer.json").exists():
            write_model_dir(args.model_dir, vocab_size=4096)
        vocab = Tokenizer.from_model_dir(args.model_dir).vocab_size
        engine = start_fake_engine(runtime, vocab, "--step-ms", args.step_ms, "--k", args.k,
                                   "--max-model-len", args.max_model_len)
        base = Config()
        server = dataclasses.replace(base.server, port=args.port, max_concurrent_requests=1024)
        config = dataclasses.replace(base, server=server,
                                     engine=dataclasses.replace(base.engine, model=str(args.model_dir)))
        (runtime / "config.json").write_bytes(msgspec.json.encode(config))
        http = subprocess.Popen([sys.executable, "-m", "mtpserve.server.main", str(runtime / "config.json")])
        print(f"serving on http://127.0.0.1:{args.port} (fake engine, step {args.step_ms} ms, k={args.k}); "
              f"HTTP pid {http.pid}", flush=True)
        try:
            while http.poll() is None and engine.proc.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            http.send_signal(signal.SIGTERM)
            http.wait(30)
            engine.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
